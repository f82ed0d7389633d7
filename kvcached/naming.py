"""Every name kvcached derives: instances, their records in /dev/shm, and worker sockets.

One rule set, used by both engines and the tools (nothing else builds a name):

1. Instance name. ``KVCACHED_IPC_NAME`` when set, else ``kvcached_<engine>_<pid>``
   with the pid of the engine's first process. That process calls
   ``ensure_instance_name(engine)``, which exports the name to the environment,
   so every process it starts (schedulers, workers, spawned or forked) inherits
   the same name without talking to the others. Two engines on one host differ
   because their first processes do.
2. A valid name is 1-127 characters of printable ASCII without ``/`` or
   whitespace (a file name in /dev/shm, a word on a kvctl command line, a field
   of 128 bytes with its NUL in the record): ``validate_name``.
3. Sub-instances: one scheduler owns one record. Where an engine runs several
   schedulers under one instance name, each appends its own suffix, in this
   order: ``_dp<k>`` (vLLM data-parallel engine k, only when dp_size > 1),
   ``_pp<p>`` / ``_tp<r>`` (SGLang, one scheduler per PP/TP rank, only for a rank
   other than 0), ``_g<g>`` (KV cache group g > 0 that keeps its own limit).
   Rank / group 0 keeps the bare name, so a single-GPU instance is just its name.
4. TP fan-out without an engine (the upstream ``tp_ipc_util`` API, tests):
   ``KVCACHED_IPC_NAME`` or ``"kvcached"`` (``ipc_name()``), as upstream.
5. Worker sockets of an instance live in one private directory per name and user:
   ``<BASE_DIR>/kvcached-tp-<safe>-<hash>/w<rank>.sock`` for pipeline stage 0 and
   ``.../pp<k>/w<rank>.sock`` for stage k >= 1 (``socket_dir_name``,
   ``stage_dir_name``, ``socket_file_name``); ``<safe>`` is the name reduced to
   ``[A-Za-z0-9._-]`` (at most 40), ``<hash>`` covers the exact name and the uid.
   The directory itself (BASE_DIR, permissions, locking) is kvcached.ipc.paths.

No torch, no extension import: tools and the interpreter-start hook use this.
"""

from __future__ import annotations

import hashlib
import operator
import os
import re
from typing import Optional

from kvcached import config

ENV_IPC_NAME = "KVCACHED_IPC_NAME"
# The record keeps names in a 128-byte field with a terminating NUL.
MAX_NAME_LEN = 127
# Rule 4: the upstream default of the bare TP fan-out.
DEFAULT_IPC_NAME = "kvcached"
PREFIX = "kvcached"

_STAGE_DIR = re.compile(r"pp\d+")


def validate_name(name: str) -> str:
    """Returns ``name`` if it can name a record, else raises ValueError saying why (rule 2)."""
    if not isinstance(name, str) or not name:
        raise ValueError("instance name is empty; set KVCACHED_IPC_NAME or pass a name")
    if len(name) > MAX_NAME_LEN:
        raise ValueError(f"instance name {name[:20]!r}... is {len(name)} characters; use at most {MAX_NAME_LEN}")
    if name in (".", "..") or any(c == "/" or not c.isprintable() or c.isspace() or ord(c) > 126 for c in name):
        raise ValueError(f"instance name {name!r} is invalid; use printable ASCII without '/' or spaces")
    return name


def default_instance_name(engine: str, pid: Optional[int] = None) -> str:
    """``kvcached_<engine>_<pid>`` (pid: this process unless given), rule 1 without the environment."""
    if not engine or not isinstance(engine, str):
        raise ValueError(f"engine must be a non-empty string such as 'vllm', got {engine!r}")
    return validate_name(f"{PREFIX}_{engine}_{os.getpid() if pid is None else int(pid)}")


def env_instance_name() -> Optional[str]:
    """``KVCACHED_IPC_NAME`` validated, or None when unset or empty."""
    env = config.ipc_name_env()
    return validate_name(env) if env else None


def instance_name(engine: str) -> str:
    """This process's instance name: ``KVCACHED_IPC_NAME`` or ``kvcached_<engine>_<pid>`` (rule 1)."""
    return env_instance_name() or default_instance_name(engine)


def ensure_instance_name(engine: str) -> str:
    """``instance_name(engine)``, exported to ``KVCACHED_IPC_NAME`` so every child
    process of the engine derives the same name. Call it in the engine's first process."""
    name = instance_name(engine)
    os.environ[ENV_IPC_NAME] = name
    return name


def ipc_name() -> str:
    """The IPC name of a TP fan-out built without one: ``KVCACHED_IPC_NAME`` or ``"kvcached"`` (rule 4)."""
    return config.ipc_name_env() or DEFAULT_IPC_NAME


def _index(what: str, value: int) -> int:
    try:
        v = -1 if isinstance(value, bool) else operator.index(value)  # also numpy / torch integer scalars
    except TypeError:
        v = -1
    if v < 0:
        raise ValueError(f"{what} must be an integer >= 0, got {value!r}")
    return v


def group_name(base: str, group_id: int) -> str:
    """The record of KV group ``group_id`` of ``base``: ``<base>_g<g>`` for g > 0, ``base`` for 0."""
    g = _index("group_id", group_id)
    return validate_name(base if g == 0 else f"{base}_g{g}")


def dp_name(base: str, dp_rank: int, dp_size: int) -> str:
    """The instance of data-parallel engine ``dp_rank``: ``<base>_dp<k>`` when dp_size > 1, else ``base``."""
    k, n = _index("dp_rank", dp_rank), _index("dp_size", dp_size)
    if n > 1 and k >= n:
        raise ValueError(f"dp_rank {k} is not below dp_size {n}")
    return validate_name(f"{base}_dp{k}" if n > 1 else base)


def rank_name(base: str, tp_rank: int = 0, pp_rank: int = 0) -> str:
    """The instance of the scheduler of TP rank ``tp_rank`` in PP stage ``pp_rank``
    (SGLang runs one per rank): ``base`` plus ``_pp<p>`` and ``_tp<r>`` for ranks other than 0."""
    t, p = _index("tp_rank", tp_rank), _index("pp_rank", pp_rank)
    name = base
    if p:
        name += f"_pp{p}"
    if t:
        name += f"_tp{t}"
    return validate_name(name)


def is_dp_name(base: str, name: str) -> bool:
    """True when ``name`` is ``base`` or one of its ``_dp<k>`` instances."""
    return name == base or re.fullmatch(re.escape(base) + r"_dp\d+", name) is not None


_SUFFIXES = r"(?:_dp\d+)?(?:_pp\d+)?(?:_tp\d+)?(?:_g\d+)?"


def belongs_to(base: str, name: str) -> bool:
    """True when ``name`` is instance ``base`` or one of its sub-instances (rule 3:
    ``_dp<k>``, ``_pp<p>``, ``_tp<r>``, ``_g<g>`` in that order), e.g. for a crash
    cleanup that removes every record of an engine."""
    return re.fullmatch(re.escape(base) + _SUFFIXES, name) is not None


# --------------------------------------------------------------- sockets (rule 5)


def socket_dir_name(name: str) -> str:
    """The socket directory's base name of instance ``name`` for this user."""
    if not name:
        raise ValueError("the IPC name must not be empty; set KVCACHED_IPC_NAME")
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", name)[:40]
    digest = hashlib.sha256(f"{os.geteuid()}\0{name}".encode()).hexdigest()[:10]
    return f"kvcached-tp-{safe}-{digest}"


def stage_dir_name(pp_rank: int) -> str:
    """The sub-directory of pipeline stage ``pp_rank`` >= 1 (stage 0 uses the root)."""
    return f"pp{_index('pp_rank', pp_rank)}"


def is_stage_dir_name(entry: str) -> bool:
    return _STAGE_DIR.fullmatch(entry) is not None


def socket_file_name(rank: int) -> str:
    """The socket file of worker ``rank`` within its stage directory."""
    return f"w{_index('rank', rank)}.sock"


__all__ = [
    "DEFAULT_IPC_NAME",
    "ENV_IPC_NAME",
    "MAX_NAME_LEN",
    "belongs_to",
    "default_instance_name",
    "dp_name",
    "ensure_instance_name",
    "env_instance_name",
    "group_name",
    "instance_name",
    "ipc_name",
    "is_dp_name",
    "is_stage_dir_name",
    "rank_name",
    "socket_dir_name",
    "socket_file_name",
    "stage_dir_name",
    "validate_name",
]
