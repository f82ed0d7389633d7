"""kvcached.config: the table of environment variables, README's copy of it, and the readers."""

from __future__ import annotations

import inspect
import os
import re

import pytest

from kvcached import config, devices
from kvcached.errors import InvalidArgumentError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "kvcached")

# Names that look like variables but are not read from the environment.
NOT_ENV = {"KVCACHED_TEST_STUB"}  # a module attribute of the engine stand-ins in tests/engines


def test_readme_table_is_the_config_table():
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    assert config.README_START in text and config.README_END in text, "README lost the env table markers"
    block = text[text.index(config.README_START) : text.index(config.README_END) + len(config.README_END)]
    assert block == config.readme_section(), (
        "README.md's environment table differs from kvcached/config.py; regenerate it with\n"
        "  python -c 'from kvcached import config; print(config.readme_section())'"
    )


def _names_in_package():
    found = {}
    # Not followed by "/": prose such as KVCACHED_MIN/MAX_RESERVED_PAGES names two table entries.
    pat = re.compile(r"\b(ENABLE_KVCACHED|KVCACHED_[A-Z0-9_]+)\b(?!/)")
    for d, _, files in os.walk(PACKAGE):
        for fn in files:
            if fn.endswith(".py"):
                path = os.path.join(d, fn)
                with open(path) as f:
                    for name in pat.findall(f.read()):
                        found.setdefault(name, path)
    return found


def test_every_variable_kvcached_names_is_in_the_table():
    missing = {n: p for n, p in _names_in_package().items() if n not in config.BY_NAME and n not in NOT_ENV}
    assert not missing, f"variables used under kvcached/ but not in config.VARIABLES: {missing}"


def test_table_is_well_formed():
    assert len(config.BY_NAME) == len(config.VARIABLES), "a variable is listed twice"
    for v in config.VARIABLES:
        assert v.type in ("bool", "int", "float", "size", "str", "spec"), v
        assert v.meaning and "|" not in v.meaning, v


def test_unknown_name_or_type_is_refused():
    with pytest.raises(KeyError, match="not in kvcached.config.VARIABLES"):
        config.get_bool("KVCACHED_NOT_A_VARIABLE", False)
    with pytest.raises(TypeError, match="KVCACHED_PAGE_SIZE is a int"):
        config.get_bool("KVCACHED_PAGE_SIZE", False)


def test_every_reader_runs_with_every_variable_unset(monkeypatch):
    # Each public reader checks its name and type against the table on every call.
    for v in config.VARIABLES:
        monkeypatch.delenv(v.name, raising=False)
    readers = [
        f
        for n, f in vars(config).items()
        if inspect.isfunction(f)
        and not n.startswith("_")
        and getattr(f, "__module__", "") == config.__name__
        and f.__code__.co_argcount == 0
        and n not in ("markdown_table", "readme_section")
    ]
    assert len(readers) >= 15
    for f in readers:
        f()


# ------------------------------------------------------------------ enabled()


@pytest.mark.parametrize("value", ["true", "1", "yes", "on", "TRUE", " On ", "Yes"])
def test_enabled_true(monkeypatch, value):
    monkeypatch.setenv("ENABLE_KVCACHED", value)
    assert config.enabled() is True


@pytest.mark.parametrize("value", [None, "", "  ", "false", "0", "no", "off", "FALSE", " Off "])
def test_enabled_false(monkeypatch, value):
    if value is None:
        monkeypatch.delenv("ENABLE_KVCACHED", raising=False)
    else:
        monkeypatch.setenv("ENABLE_KVCACHED", value)
    assert config.enabled() is False


@pytest.mark.parametrize("value", ["ture", "2", "enabled", "y", "-1", "true1"])
def test_enabled_refuses_anything_else(monkeypatch, value):
    monkeypatch.setenv("ENABLE_KVCACHED", value)
    with pytest.raises(ValueError) as e:
        config.enabled()
    msg = str(e.value)
    assert "\n" not in msg and "ENABLE_KVCACHED" in msg and repr(value) in msg
    for accepted in ("true", "1", "yes", "on", "false", "0", "no", "off"):
        assert accepted in msg


def test_autopatch_follows_the_same_rule(monkeypatch):
    monkeypatch.delenv("KVCACHED_AUTOPATCH", raising=False)
    assert config.autopatch_enabled() is True
    monkeypatch.setenv("KVCACHED_AUTOPATCH", "0")
    assert config.autopatch_enabled() is False
    monkeypatch.setenv("KVCACHED_AUTOPATCH", "1")
    assert config.autopatch_enabled() is True
    monkeypatch.setenv("KVCACHED_AUTOPATCH", "maybe")
    with pytest.raises(ValueError, match="KVCACHED_AUTOPATCH"):
        config.autopatch_enabled()


def test_autopatch_module_reads_the_table(monkeypatch):
    from kvcached import autopatch

    monkeypatch.setenv("ENABLE_KVCACHED", "on")
    monkeypatch.setenv("KVCACHED_AUTOPATCH", "off")
    assert autopatch.enabled() and autopatch.autopatch_disabled()
    monkeypatch.setenv("ENABLE_KVCACHED", "bogus")
    with pytest.raises(ValueError):
        autopatch.enabled()


def test_bad_enable_value_does_not_break_interpreter_start():
    import subprocess
    import sys

    env = dict(os.environ, ENABLE_KVCACHED="bogus")
    out = subprocess.run(
        [sys.executable, "-c", "import kvcached.autopatch as a; print(a.hook_installed())"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


# ------------------------------------------------------------ max_cached_tokens()


@pytest.mark.parametrize(
    "value, expect",
    [
        (None, None),
        ("", None),
        (" ", None),
        ("-1", None),
        (" -1 ", None),
        ("0", 0),
        ("1", 1),
        ("65536", 65536),
        (" 42 ", 42),
    ],
)
def test_max_cached_tokens(monkeypatch, value, expect):
    if value is None:
        monkeypatch.delenv("KVCACHED_MAX_CACHED_TOKENS", raising=False)
    else:
        monkeypatch.setenv("KVCACHED_MAX_CACHED_TOKENS", value)
    assert config.max_cached_tokens() == expect


@pytest.mark.parametrize(
    "value, why",
    [
        ("-2", "negative"),
        ("-100", "negative"),
        ("lots", "not an integer"),
        ("1.5", "not an integer"),
        ("64k", "not an integer"),
    ],
)
def test_max_cached_tokens_refuses(monkeypatch, value, why):
    monkeypatch.setenv("KVCACHED_MAX_CACHED_TOKENS", value)
    with pytest.raises(ValueError, match=why) as e:
        config.max_cached_tokens()
    msg = str(e.value)
    assert "\n" not in msg and "KVCACHED_MAX_CACHED_TOKENS" in msg and "-1" in msg  # names the fix


# ------------------------------------------------------------------ the others


def test_defaults(monkeypatch):
    for v in config.VARIABLES:
        monkeypatch.delenv(v.name, raising=False)
    assert config.page_size() == 2 << 20
    assert config.contiguous_layout() is False
    assert (config.min_reserved_pages(), config.max_reserved_pages()) == (5, 10)
    assert config.page_prealloc_enabled() is True
    assert config.capacity_ttl_s() == pytest.approx(0.010)
    assert config.gpu_utilization() == pytest.approx(0.95)
    assert config.host_memory_budget() is None
    assert config.ipc_timeout_s() == 10.0
    assert config.pp_size() == 1
    assert config.ipc_spin_us() == 50.0
    assert config.ipc_name_env() is None and config.ipc_fault_inject() is None


def test_integers(monkeypatch):
    monkeypatch.setenv("KVCACHED_PAGE_SIZE", "0x10000")
    assert config.page_size() == 1 << 16
    monkeypatch.setenv("KVCACHED_PAGE_SIZE", "65536")
    assert config.page_size() == 1 << 16
    monkeypatch.setenv("KVCACHED_MIN_RESERVED_PAGES", "010")  # decimal, as people mean it
    assert config.min_reserved_pages() == 10
    monkeypatch.setenv("KVCACHED_PAGE_SIZE", "2M")
    with pytest.raises(ValueError, match="KVCACHED_PAGE_SIZE='2M' is not an integer"):
        config.page_size()
    monkeypatch.setenv("KVCACHED_CAPACITY_TTL_MS", "-1")
    with pytest.raises(ValueError, match=">= 0"):
        config.capacity_ttl_s()
    monkeypatch.setenv("KVCACHED_PP_SIZE", "0")
    with pytest.raises(ValueError, match="KVCACHED_PP_SIZE='0' must be >= 1"):
        config.pp_size()


def test_floats_and_sizes(monkeypatch):
    monkeypatch.setenv("KVCACHED_GPU_UTILIZATION", "0.5")
    assert config.gpu_utilization() == 0.5
    for bad in ("0", "1.5", "half"):
        monkeypatch.setenv("KVCACHED_GPU_UTILIZATION", bad)
        with pytest.raises(ValueError, match="KVCACHED_GPU_UTILIZATION"):
            config.gpu_utilization()
    monkeypatch.setenv("KVCACHED_HOST_MEMORY_BUDGET", "8G")
    assert config.host_memory_budget() == 8 << 30
    monkeypatch.setenv("KVCACHED_HOST_MEMORY_BUDGET", "lots")
    with pytest.raises(ValueError, match="KVCACHED_HOST_MEMORY_BUDGET"):
        config.host_memory_budget()
    for off in ("0", "-1"):  # upstream's "no timeout": the longest bound, never forever
        monkeypatch.setenv("KVCACHED_IPC_TIMEOUT", off)
        assert config.ipc_timeout_s() == config.NO_TIMEOUT_CAP_S
    monkeypatch.setenv("KVCACHED_IPC_TIMEOUT", "inf")
    with pytest.raises(ValueError, match="finite"):
        config.ipc_timeout_s()
    monkeypatch.setenv("KVCACHED_IPC_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="is not a number of seconds"):
        config.ipc_timeout_s()
    monkeypatch.setenv("KVCACHED_IPC_SPIN_US", "-1")
    with pytest.raises(ValueError, match="must be >= 0"):
        config.ipc_spin_us()
    monkeypatch.setenv("KVCACHED_IPC_SPIN_US", "0")
    assert config.ipc_spin_us() == 0.0


def test_upstream_spellings(monkeypatch):
    for v in config.VARIABLES:
        monkeypatch.delenv(v.name, raising=False)
    assert (config.sanity_check(), config.max_cached_blocks(), config.log_level()) == (False, 1000, None)
    assert config.log_color() is True and config.log_color_code() == "\033[36m"
    monkeypatch.setenv("KVCACHED_PAGE_SIZE_MB", "4")
    assert config.page_size() == 4 << 20
    monkeypatch.setenv("KVCACHED_PAGE_SIZE", str(4 << 20))  # both, agreeing
    assert config.page_size() == 4 << 20
    monkeypatch.setenv("KVCACHED_PAGE_SIZE", str(2 << 20))
    with pytest.raises(ValueError, match="disagree; unset one"):
        config.page_size()
    monkeypatch.delenv("KVCACHED_PAGE_SIZE")
    for bad in ("0", "-2", "2.5"):
        monkeypatch.setenv("KVCACHED_PAGE_SIZE_MB", bad)
        with pytest.raises(ValueError, match="KVCACHED_PAGE_SIZE_MB"):
            config.page_size()
    monkeypatch.setenv("KVCACHED_NIXL_CONTIGUOUS_LAYOUT", "true")
    assert config.contiguous_layout() is True
    monkeypatch.setenv("KVCACHED_CONTIGUOUS_LAYOUT", "false")  # ours wins
    assert config.contiguous_layout() is False
    monkeypatch.setenv("KVCACHED_SANITY_CHECK", "true")
    monkeypatch.setenv("KVCACHED_LOG_LEVEL", "debug")
    assert config.sanity_check() is True and config.log_level() == "DEBUG"
    monkeypatch.setenv("KVCACHED_LOG_LEVEL", "LOUD")
    with pytest.raises(ValueError, match="KVCACHED_LOG_LEVEL='LOUD' is not a level"):
        config.log_level()


def test_ipc_settings_read_the_table(monkeypatch):
    from kvcached.ipc import settings

    monkeypatch.setenv("KVCACHED_IPC_TIMEOUT", "2.5")
    monkeypatch.setenv("KVCACHED_PP_SIZE", "3")
    monkeypatch.setenv("KVCACHED_IPC_SPIN_US", "100")
    assert (settings.ipc_timeout(), settings.pp_size()) == (2.5, 3)
    assert settings.ipc_spin_s() == pytest.approx(100e-6)


# ---------------------------------------------------------------- devices


class _Dev:
    def __init__(self, type, index=None):
        self.type, self.index = type, index


@pytest.mark.parametrize(
    "given, expect",
    [
        ("cpu", "cpu"),
        ("cpu:0", "cpu"),
        ("cuda:0", "cuda:0"),
        ("cuda:3", "cuda:3"),
        (2, "cuda:2"),
        (0, "cuda:0"),
        (_Dev("cpu"), "cpu"),
        (_Dev("cuda", 1), "cuda:1"),
        ("hip:1", "cuda:1"),
        (" cuda:4 ", "cuda:4"),
    ],
)
def test_normalize_device(given, expect):
    assert devices.normalize_device(given) == expect


def test_bare_cuda_is_the_current_device():
    dev = devices.normalize_device("cuda")
    assert re.fullmatch(r"cuda:\d+", dev)
    assert devices.normalize_device(_Dev("cuda")) == dev


def test_none_is_the_default_device():
    assert devices.normalize_device(None) == devices.default_device()
    assert devices.default_device() == "cpu" or devices.default_device().startswith("cuda:")


@pytest.mark.parametrize(
    "bad", ["tpu", "cuda:x", "cuda:-1", "cpu:1", "", -1, True, 1.0, _Dev("xla", 0), _Dev("cuda", -2), object()]
)
def test_normalize_device_refuses(bad):
    with pytest.raises(InvalidArgumentError) as e:
        devices.normalize_device(bad)
    msg = str(e.value)
    assert "\n" not in msg and "'cpu'" in msg and "'cuda:N'" in msg


def test_torch_device_if_available():
    torch = pytest.importorskip("torch")
    assert devices.normalize_device(torch.device("cpu")) == "cpu"
    assert devices.normalize_device(torch.device("cuda", 5)) == "cuda:5"
    assert devices.same_device("cuda:0", torch.device("cuda:0"))
