"""The environment variables of kvcached: one table, and one typed reader per variable.

``VARIABLES`` lists every variable kvcached reads (name, type, default, meaning);
README.md's "Environment variables" table is generated from it
(``markdown_table()``; tests/test_config.py fails when they differ, and also when
a module under kvcached/ names a variable that is not in the table). Each reader
below goes through ``_raw(name, type)``, which refuses a name or type not in the table, so a
new variable cannot be read without being documented.

Rules shared by every reader:
  * read at call time, never at import time (tests and tools set them late);
  * unset and empty mean the default;
  * a value that cannot be parsed raises ValueError with one line that names
    the variable, the value and what to write instead: a typo must stop
    start-up, not silently pick a default.
  * booleans: true/1/yes/on and false/0/no/off (any case, surrounding spaces ignored).

Names follow the upstream kvcached project so existing deployments keep working
(upstream's own spellings are in the table too; docs/COMPAT.md).

Why this module is long: it is the one table of every variable plus one short
reader each; splitting it would split the table README is generated from.
No import beyond the standard library: the interpreter-start hook reads this.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from kvcached.units import parse_size  # a ground module: no torch, no extension

MiB = 1 << 20
DEFAULT_PAGE_SIZE = 2 * MiB

BOOL_TRUE = ("true", "1", "yes", "on")
BOOL_FALSE = ("false", "0", "no", "off")


@dataclass(frozen=True)
class Var:
    """One environment variable.

    ``type``: bool, int, float, size (bytes, ``512M``), str or spec (a
    mini-language described in ``meaning``). ``default``: what unset means, as
    README shows it ("-": nothing / off).
    """

    name: str
    type: str
    default: str
    meaning: str


VARIABLES: Tuple[Var, ...] = (
    Var(
        name="ENABLE_KVCACHED",
        type="bool",
        default="false",
        meaning="turn kvcached on in engine processes (enough on its own); true/1/yes/on or "
        "false/0/no/off, anything else stops start-up",
    ),
    Var(
        name="KVCACHED_AUTOPATCH",
        type="bool",
        default="true",
        meaning="`0` turns the interpreter-start import hook off (the engine's plugin entry point still patches)",
    ),
    Var(
        name="KVCACHED_ALLOW_UNSUPPORTED",
        type="bool",
        default="false",
        meaning="`1` tries a vLLM version outside the supported range anyway (the patches of the nearest "
        "supported version, one warning naming the seams known not to fit), or a model family not yet proven on a "
        "GPU (Mamba / gated-delta-net state, in vLLM and SGLang; one warning); unset, either stops start-up",
    ),
    Var(
        name="KVCACHED_IPC_NAME",
        type="str",
        default="`kvcached_<engine>_<pid>`",
        meaning="instance name: its record in `kvctl list` and its worker sockets; set by the first "
        "engine process, inherited by the others (rules in `kvcached/naming.py`)",
    ),
    Var(
        name="KVCACHED_PAGE_SIZE",
        type="int",
        default="2 MiB",
        meaning="kvcached page size in bytes (a multiple of the backend granularity); unset, a model whose "
        "blocks or state slots are larger than 2 MiB gets a page that holds them (chosen at start-up)",
    ),
    Var(
        name="KVCACHED_PAGE_SIZE_MB",
        type="int",
        default="-",
        meaning="upstream's spelling of the page size, in MiB (a positive integer); when `KVCACHED_PAGE_SIZE` "
        "is set too, the two must agree",
    ),
    Var(
        name="KVCACHED_CONTIGUOUS_LAYOUT",
        type="bool",
        default="false",
        meaning="one compound range `[chunk][layer][kv]` instead of one range per layer (upstream's CUDA "
        "default is true: see docs/COMPAT.md)",
    ),
    Var(
        name="KVCACHED_NIXL_CONTIGUOUS_LAYOUT",
        type="bool",
        default="-",
        meaning="upstream's NIXL spelling of `KVCACHED_CONTIGUOUS_LAYOUT`, used only when that one is unset",
    ),
    Var(
        name="KVCACHED_MIN_RESERVED_PAGES",
        type="int",
        default="5",
        meaning="mapped reserve pool: pages kept mapped ahead of demand",
    ),
    Var(
        name="KVCACHED_MAX_RESERVED_PAGES",
        type="int",
        default="10",
        meaning="mapped reserve pool: most free pages kept mapped",
    ),
    Var(
        name="KVCACHED_PAGE_PREALLOC_ENABLED",
        type="bool",
        default="true",
        meaning="refill the reserve pool on a background thread",
    ),
    Var(
        name="KVCACHED_KEEP_NULL_PAGE",
        type="bool",
        default="false",
        meaning="`true` keeps the page of the null block (vLLM's block 0, SGLang's padding slot) mapped for "
        "the engine's life; by default an idle give-back (a peer's want, a lowered limit) unmaps it too, "
        "and the next allocation maps it first",
    ),
    Var(
        name="KVCACHED_CAPACITY_TTL_MS",
        type="int",
        default="10",
        meaning="how long a manager may reuse its reading of free pages and device memory (0: read every time)",
    ),
    Var(
        name="KVCACHED_MAX_CACHED_TOKENS",
        type="int",
        default="-",
        meaning="cap on the tokens the prefix cache keeps (unset or -1: unbounded; 0: keep none). vLLM: "
        "evictable cached blocks above it are evicted when blocks are freed, whole pages first; "
        "SGLang: unlocked radix entries above it are evicted after each batch",
    ),
    Var(
        name="KVCACHED_MAX_CACHED_BLOCKS",
        type="int",
        default="1000",
        meaning="read as upstream does (`kvcached.utils.MAX_CACHED_BLOCKS`) and, as there, bounds nothing; "
        "the prefix-cache bound is `KVCACHED_MAX_CACHED_TOKENS`",
    ),
    Var(
        name="KVCACHED_SANITY_CHECK",
        type="bool",
        default="false",
        meaning="`true` runs `KVCacheManager.check_invariants()` after every alloc/free/reserve (slow; for "
        "debugging). Bad ids are refused with or without it",
    ),
    Var(
        name="KVCACHED_GPU_UTILIZATION",
        type="float",
        default="0.95",
        meaning="fraction in (0, 1] of a device's memory that all instances on it may map together (the device budget)",
    ),
    Var(
        name="KVCACHED_HOST_MEMORY_BUDGET",
        type="size",
        default="-",
        meaning="bytes all instances on the host backend (`cpu`) may map together, e.g. `8G` (unset: "
        "`KVCACHED_GPU_UTILIZATION` of the host memory)",
    ),
    Var(
        name="KVCACHED_IPC_TIMEOUT",
        type="float",
        default="10",
        meaning="seconds one TP request may take before the coordinator treats a live rank as not answering "
        "(recovery gets 3x); a rank whose worker process died is reported at once; `0` or less (upstream: no "
        "timeout) waits up to 3600 s, never forever",
    ),
    Var(
        name="KVCACHED_TRANSFER_TIMEOUT",
        type="float",
        default="120",
        meaning="seconds an offload copy (vLLM `--kv-offloading-size`, SGLang `--enable-hierarchical-cache`) may run "
        "before one error line names it; its blocks stay held and their pages mapped until it finishes (never unmapped "
        "under a copy); `0`: never report",
    ),
    Var(
        name="KVCACHED_PP_SIZE",
        type="int",
        default="1",
        meaning="pipeline stages a TP coordinator covers when built for every stage",
    ),
    Var(
        name="KVCACHED_IPC_SPIN_US",
        type="float",
        default="50",
        meaning="microseconds a TP coordinator polls for a reply before it sleeps (0: sleep at once)",
    ),
    Var(
        name="KVCACHED_LOG_LEVEL",
        type="str",
        default="-",
        meaning="level of the `kvcached` logger (DEBUG, INFO, WARNING, ERROR, CRITICAL); when set, kvcached "
        "logs through its own handler as upstream does (unset: records go to the engine's logging)",
    ),
    Var(
        name="KVCACHED_LOG_COLOR",
        type="bool",
        default="true",
        meaning="colour the level prefix of kvcached's own handler on a terminal (upstream's switch)",
    ),
    Var(
        name="KVCACHED_LOG_COLOR_CODE",
        type="str",
        default="`\\033[36m`",
        meaning="ANSI colour of kvcached's own handler for levels without their own colour (upstream's)",
    ),
    Var(
        name="KVCACHED_ZERO_PAGE",
        type="str",
        default="rw",
        meaning="`ro` maps the zero page behind unmapped KV memory read-only: a kernel writing where "
        "no page is mapped faults instead of changing what all unmapped memory reads (a probe: on a "
        "GPU the writing process dies with SIGSEGV; run on an H100 by tests/vmm/test_zero_page_read_only.py, "
        "docs/GPU.md)",
    ),
    Var(
        name="KVCACHED_TRACE",
        type="str",
        default="-",
        meaning="folder where every kvcached process appends a JSON-lines trace of how memory moves (wants, "
        "wakes, evictions, maps, unmaps, grants; one file per process, 0600); "
        "`python -m kvcached.bench burst --trace DIR` turns it into a timeline. Unset: no trace, no cost",
    ),
    Var(
        name="KVCACHED_FAULT_INJECT",
        type="spec",
        default="-",
        meaning="tests: `op:N[xM]` makes the Nth backend call fail (`create`, `map`, `set_access`, `unmap`, `release`)",
    ),
    Var(
        name="KVCACHED_TEST_ENGINE_PYTHONPATH",
        type="str",
        default="-",
        meaning="tests: PYTHONPATH of the engines the tests start, so a checkout's kvcached shadows "
        "the one installed in a cached engine venv",
    ),
    Var(
        name="KVCACHED_IPC_FAULT_INJECT",
        type="spec",
        default="-",
        meaning="tests: `command:nth:action[,...]` makes a TP worker drop, exit, delay or fail a request "
        "(see `kvcached/ipc/faults.py`)",
    ),
    Var(
        name="KVCACHED_BORROW_NAME",
        type="str",
        default="-",
        meaning="set by `kvctl borrow` for its command: the record holding the borrowed memory "
        "(read it, do not set it)",
    ),
    Var(
        name="KVCACHED_BORROW_DEVICE",
        type="str",
        default="-",
        meaning="set by `kvctl borrow` for its command: the device the memory is borrowed on",
    ),
    Var(
        name="KVCACHED_BORROW_BYTES",
        type="int",
        default="-",
        meaning="set by `kvctl borrow` for its command: the bytes held for it (less than asked with `--partial`)",
    ),
)

BY_NAME: Dict[str, Var] = {v.name: v for v in VARIABLES}

# Variables of the engines that kvcached reads to refuse a configuration it cannot
# serve; the engines define them, so they are not in VARIABLES (nor in README's table).
ENGINE_VARIABLES = ("SGLANG_ENABLE_POST_CAPTURE_KV_SIZING", "SGLANG_MOONCAKE_CUSTOM_MEM_POOL")


# ------------------------------------------------------------------- parsing


def _raw(name: str, *types: str) -> Optional[str]:
    """The value of table variable ``name`` (whose table type is one of ``types``),
    or None when unset or empty. A reader for a name or type not in the table is a bug."""
    var = BY_NAME.get(name)
    if var is None:
        raise KeyError(f"{name} is not in kvcached.config.VARIABLES; add it there (and to README) first")
    if var.type not in types:
        raise TypeError(f"{name} is a {var.type} in kvcached.config.VARIABLES, read here as {'/'.join(types)}")
    v = os.environ.get(name)
    if v is None or v.strip() == "":
        return None
    return v


def parse_bool(name: str, value: str) -> bool:
    s = value.strip().lower()
    if s in BOOL_TRUE:
        return True
    if s in BOOL_FALSE:
        return False
    raise ValueError(f"{name}={value!r} is not a boolean; use one of {'/'.join(BOOL_TRUE + BOOL_FALSE)}")


def get_bool(name: str, default: bool) -> bool:
    v = _raw(name, "bool")
    return default if v is None else parse_bool(name, v)


def _int(v: str) -> int:
    # 0x.. / 0o.. accepted as before; a leading zero ("010") is decimal, not an error.
    s = v.strip()
    try:
        return int(s, 0)
    except ValueError:
        return int(s, 10)


def get_int(name: str, default: int, *, minimum: Optional[int] = None) -> int:
    v = _raw(name, "int")
    if v is None:
        return default
    try:
        n = _int(v)
    except ValueError:
        raise ValueError(f"{name}={v!r} is not an integer") from None
    if minimum is not None and n < minimum:
        raise ValueError(f"{name}={v!r} must be >= {minimum}")
    return n


def get_float(name: str, default: float, *, unit: str = "a number") -> float:
    v = _raw(name, "float")
    if v is None:
        return default
    try:
        return float(v)
    except ValueError:
        raise ValueError(f"{name}={v!r} is not {unit}") from None


def get_str(name: str) -> Optional[str]:
    return _raw(name, "str", "spec")


# ------------------------------------------------------------------- readers


def enabled() -> bool:
    """ENABLE_KVCACHED, the switch of both engines: true/1/yes/on, or false/0/no/off/unset/empty.

    Anything else raises ValueError naming the accepted values (a typo such as
    ``ENABLE_KVCACHED=ture`` must not start the engine without kvcached silently)."""
    return get_bool("ENABLE_KVCACHED", False)


def autopatch_enabled() -> bool:
    """KVCACHED_AUTOPATCH (default true): false/0/no/off turns the interpreter-start hook off."""
    return get_bool("KVCACHED_AUTOPATCH", True)


def allow_unsupported() -> bool:
    """KVCACHED_ALLOW_UNSUPPORTED (default false): patch an engine version outside the supported range, or
    serve a model family not yet proven on a GPU, anyway."""
    return get_bool("KVCACHED_ALLOW_UNSUPPORTED", False)


def ipc_name_env() -> Optional[str]:
    """KVCACHED_IPC_NAME as set (not validated; kvcached.naming applies the rules)."""
    return get_str("KVCACHED_IPC_NAME")


def page_size() -> int:
    """KVCACHED_PAGE_SIZE in bytes, else upstream's KVCACHED_PAGE_SIZE_MB in MiB, else 2 MiB.

    Both set and different raises ValueError: which one was meant is unknown."""
    mb = get_int("KVCACHED_PAGE_SIZE_MB", 0)
    if _raw("KVCACHED_PAGE_SIZE_MB", "int") is not None and mb <= 0:
        raise ValueError(f"KVCACHED_PAGE_SIZE_MB={mb} must be a positive number of MiB, e.g. 2")
    size = get_int("KVCACHED_PAGE_SIZE", mb * MiB or DEFAULT_PAGE_SIZE)
    if mb and size != mb * MiB:
        raise ValueError(f"KVCACHED_PAGE_SIZE={size} and KVCACHED_PAGE_SIZE_MB={mb} disagree; unset one of them")
    return size


def page_size_set() -> bool:
    """Whether the page size was chosen by the user (KVCACHED_PAGE_SIZE or KVCACHED_PAGE_SIZE_MB):
    then it is kept even where another would fit the model's blocks better."""
    return _raw("KVCACHED_PAGE_SIZE", "int") is not None or _raw("KVCACHED_PAGE_SIZE_MB", "int") is not None


def contiguous_layout() -> bool:
    """KVCACHED_CONTIGUOUS_LAYOUT, else upstream's KVCACHED_NIXL_CONTIGUOUS_LAYOUT, else false."""
    if _raw("KVCACHED_CONTIGUOUS_LAYOUT", "bool") is None:
        return get_bool("KVCACHED_NIXL_CONTIGUOUS_LAYOUT", False)
    return get_bool("KVCACHED_CONTIGUOUS_LAYOUT", False)


def sanity_check() -> bool:
    """KVCACHED_SANITY_CHECK (default false): verify the manager's whole state after every change."""
    return get_bool("KVCACHED_SANITY_CHECK", False)


def max_cached_blocks() -> int:
    """KVCACHED_MAX_CACHED_BLOCKS (default 1000), exported as upstream does; it bounds nothing."""
    return get_int("KVCACHED_MAX_CACHED_BLOCKS", 1000)


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def log_level() -> Optional[str]:
    """KVCACHED_LOG_LEVEL upper-cased (None: unset); a name not in LOG_LEVELS raises ValueError."""
    v = get_str("KVCACHED_LOG_LEVEL")
    if v is None:
        return None
    level = v.strip().upper()
    if level not in LOG_LEVELS:
        raise ValueError(f"KVCACHED_LOG_LEVEL={v!r} is not a level; use one of {', '.join(LOG_LEVELS)}")
    return level


def log_color() -> bool:
    """KVCACHED_LOG_COLOR (default true)."""
    return get_bool("KVCACHED_LOG_COLOR", True)


def log_color_code() -> str:
    """KVCACHED_LOG_COLOR_CODE (default cyan, ``\\033[36m``)."""
    return get_str("KVCACHED_LOG_COLOR_CODE") or "\033[36m"


def min_reserved_pages() -> int:
    return get_int("KVCACHED_MIN_RESERVED_PAGES", 5)


def max_reserved_pages() -> int:
    return get_int("KVCACHED_MAX_RESERVED_PAGES", 10)


def page_prealloc_enabled() -> bool:
    return get_bool("KVCACHED_PAGE_PREALLOC_ENABLED", True)


def keep_null_page() -> bool:
    return get_bool("KVCACHED_KEEP_NULL_PAGE", False)


def capacity_ttl_s() -> float:
    """How long KVCacheManager.available_size may reuse its reading of the data
    plane's free pages and the device's free memory when this manager did not
    change pages in between (KVCACHED_CAPACITY_TTL_MS, default 10 ms; 0: read
    every time). A limit change by another thread is seen within this time."""
    ms = get_int("KVCACHED_CAPACITY_TTL_MS", 10)
    if ms < 0:
        raise ValueError(f"KVCACHED_CAPACITY_TTL_MS={ms} must be >= 0")
    return ms / 1000.0


def max_cached_tokens() -> Optional[int]:
    """KVCACHED_MAX_CACHED_TOKENS, the prefix-cache bound of both engines.

    Unset, empty or -1: None (unbounded). An integer >= 0: that many tokens
    (0 keeps nothing cached). Anything else raises ValueError naming the fix."""
    name = "KVCACHED_MAX_CACHED_TOKENS"
    v = _raw(name, "int")
    if v is None:
        return None
    try:
        n = int(v.strip())
    except ValueError:
        raise ValueError(
            f"{name}={v!r} is not an integer number of tokens; use e.g. 65536, or -1 / unset for unbounded"
        ) from None
    if n == -1:
        return None
    if n < 0:
        raise ValueError(f"{name}={v!r} is negative; use a token count >= 0, or -1 / unset for unbounded")
    return n


DEFAULT_GPU_UTILIZATION = 0.95


def gpu_utilization() -> float:
    """KVCACHED_GPU_UTILIZATION as a fraction in (0, 1]; raises ValueError naming the fix."""
    name = "KVCACHED_GPU_UTILIZATION"
    f = get_float(name, DEFAULT_GPU_UTILIZATION, unit="a number; use a fraction such as 0.9")
    if not 0.0 < f <= 1.0:
        raise ValueError(f"{name}={os.environ.get(name)!r} is outside (0, 1]; use a fraction such as 0.9")
    return f


def host_memory_budget() -> Optional[int]:
    """KVCACHED_HOST_MEMORY_BUDGET in bytes (None: unset, ask the backend); ValueError names the fix."""
    name = "KVCACHED_HOST_MEMORY_BUDGET"
    v = _raw(name, "size")
    if v is None:
        return None
    try:
        n = parse_size(v)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
    if n <= 0:
        raise ValueError(f"{name}={v!r} must be a positive size such as 8G")
    return n


DEFAULT_IPC_TIMEOUT_S = 10.0
# KVCACHED_IPC_TIMEOUT <= 0 is upstream's "no timeout"; we still never wait forever.
NO_TIMEOUT_CAP_S = 3600.0


def ipc_timeout_s() -> float:
    """KVCACHED_IPC_TIMEOUT in seconds (default 10); 0 or less (upstream: no timeout) gives NO_TIMEOUT_CAP_S."""
    name = "KVCACHED_IPC_TIMEOUT"
    t = get_float(name, DEFAULT_IPC_TIMEOUT_S, unit="a number of seconds")
    if t != t or t == float("inf"):
        raise ValueError(f"{name}={os.environ.get(name)!r} must be a finite number of seconds (0: no timeout)")
    return t if t > 0 else NO_TIMEOUT_CAP_S


def transfer_timeout_s() -> float:
    """KVCACHED_TRANSFER_TIMEOUT in seconds (default 120; 0 or less: never report a late copy)."""
    t = get_float("KVCACHED_TRANSFER_TIMEOUT", 120.0, unit="a number of seconds")
    return t if t == t and t > 0 else 0.0


def pp_size() -> int:
    """KVCACHED_PP_SIZE (>= 1, default 1)."""
    return get_int("KVCACHED_PP_SIZE", 1, minimum=1)


DEFAULT_IPC_SPIN_US = 50.0


def ipc_spin_us() -> float:
    """KVCACHED_IPC_SPIN_US in microseconds (>= 0, default 50)."""
    name = "KVCACHED_IPC_SPIN_US"
    us = get_float(name, DEFAULT_IPC_SPIN_US, unit="a number of microseconds")
    if us < 0:
        raise ValueError(f"{name}={os.environ.get(name)!r} must be >= 0")
    return us


def trace_dir() -> Optional[str]:
    """KVCACHED_TRACE: the folder of the event trace (None: unset, no trace; kvcached.trace)."""
    return get_str("KVCACHED_TRACE")


def ipc_fault_inject() -> Optional[str]:
    """KVCACHED_IPC_FAULT_INJECT as set (parsed by kvcached.ipc.faults)."""
    return get_str("KVCACHED_IPC_FAULT_INJECT")


# ------------------------------------------------------------------- README


def markdown_table() -> str:
    """README's "Environment variables" table, generated from ``VARIABLES``."""
    rows = ["| variable | type | default | meaning |", "|---|---|---|---|"]
    for v in VARIABLES:
        rows.append(f"| `{v.name}` | {v.type} | {v.default} | {v.meaning} |")
    return "\n".join(rows)


README_START = "<!-- env table: generated by kvcached.config.readme_section() (tests/test_config.py checks it) -->"
README_END = "<!-- end of env table -->"


def readme_section() -> str:
    """The block README.md carries between its markers (checked by tests/test_config.py)."""
    return f"{README_START}\n{markdown_table()}\n{README_END}"
