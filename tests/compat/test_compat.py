"""Upstream kvcached's public API, called the way upstream's callers call it
(positional and keyword), against our implementation: names, positions and
defaults, return shapes, environment spellings, and that none of the
upstream-compatible entry points lets bad input through (docs/COMPAT.md)."""

from __future__ import annotations

import inspect
import json
import logging
import os
import socket
import subprocess
import sys
import uuid

import pytest
import torch

from kvcached import config, control, observability, pool_registry, tp_ipc_util, utils
from kvcached.errors import InvalidArgumentError, OutOfMemoryError
from kvcached.integration.sglang import interfaces as si
from kvcached.integration.vllm import interfaces as vi
from kvcached.ipc.paths import socket_root
from kvcached.kv_cache_manager import KVCacheManager
from kvcached.limits.records import list_records, read_record
from kvcached.locks import NoOpCondition, NoOpLock
from kvcached.mem_info_tracker import MemInfoTracker
from manager_helpers import check_invariants, snapshot

EMPTY = inspect.Parameter.empty
LAYERS = 2


# ------------------------------------------------------------- signatures

# Upstream's positional parameters (name, default; EMPTY: required), from its
# sources at commit e8e6406. Ours may add keyword-only parameters after them.
# "*" marks a default we deliberately differ on (docs/COMPAT.md says why).
UPSTREAM = {
    vi.init_kvcached: [("tp_rank", 0), ("world_size", 1), ("pp_rank", 0), ("is_worker", False), ("device", None),
                       ("async_sched", False)],
    vi.alloc_kv_cache: [("kvcache_shape", EMPTY), ("block_size", EMPTY), ("dtype", EMPTY), ("device", EMPTY),
                        ("num_layers", EMPTY), ("attention_type", "MHA"), ("kv_layout", "NHD"), ("group_id", 0),
                        ("kernel_block_size", None), ("return_meta", False)],
    vi.get_kv_cache_manager: [("num_blocks", EMPTY), ("block_size", EMPTY), ("cell_size", EMPTY),
                              ("num_layers", EMPTY), ("num_kv_buffers", "*"), ("group_id", 0), ("pool_name", None)],
    vi.build_kv_views: [("raw_kv_tensors", EMPTY), ("kvcache_shape", EMPTY), ("block_size", EMPTY), ("dtype", EMPTY),
                        ("attention_type", EMPTY), ("num_blocks_per_layer", EMPTY),
                        ("gpu_mem_bytes_per_layer_k_or_v", EMPTY), ("num_layers", EMPTY), ("kernel_block_size", None)],
    si.init_kvcached: [("tp_rank", 0), ("world_size", 1), ("pp_rank", 0), ("device", None), ("async_sched", False)],
    si.alloc_kv_cache: [("kvcache_shape", EMPTY), ("dtype", EMPTY), ("device", "*"), ("num_layers", "*"),
                        ("page_size", 1), ("attention_type", "MHA"), ("kv_layout", "NHD"), ("group_id", 0)],
    si.get_kv_cache_manager: [("num_blocks", EMPTY), ("block_size", EMPTY), ("cell_size", EMPTY),
                              ("num_layers", EMPTY), ("reserve_null_block", True), ("num_kv_buffers", "*"),
                              ("group_id", 0), ("pool_name", None)],
    KVCacheManager.__init__: [("self", EMPTY), ("num_blocks", EMPTY), ("block_size", EMPTY), ("cell_size", EMPTY),
                              ("num_layers", EMPTY), ("world_size", 1), ("pp_rank", 0), ("async_sched", False),
                              ("reserve_null_block", False), ("num_kv_buffers", 2), ("group_id", 0),
                              ("pool_name", None)],
    KVCacheManager.free: [("self", EMPTY), ("indices", EMPTY)],
    KVCacheManager.get_mapped_memory_size: [("self", EMPTY), ("unit", "bytes")],
    tp_ipc_util.get_worker_socket_path: [("rank", EMPTY), ("pp_rank", 0)],
    tp_ipc_util.start_worker_listener_thread: [("rank", EMPTY), ("pp_rank", 0)],
    tp_ipc_util.broadcast_map_to_kv_tensors: [("tp_size", EMPTY), ("offsets", EMPTY), ("pp_rank", 0), ("group_id", 0)],
    tp_ipc_util.broadcast_unmap_from_kv_tensors: [("tp_size", EMPTY), ("offsets", EMPTY), ("pp_rank", 0),
                                                  ("group_id", 0)],
    tp_ipc_util.broadcast_kv_tensors_created: [("tp_size", EMPTY), ("pp_rank", 0), ("group_id", 0)],
    tp_ipc_util.send_msg: [("sock", EMPTY), ("msg", EMPTY)],
    tp_ipc_util.recv_msg: [("sock", EMPTY)],
    MemInfoTracker.__init__: [("self", EMPTY), ("total_mem_size", EMPTY), ("group_id", 0)],
    MemInfoTracker.check_and_get_resize_target: [("self", EMPTY), ("current_mem_size", EMPTY), ("num_layers", EMPTY),
                                                 ("num_kv_buffers", 2)],
    MemInfoTracker.update_memory_usage: [("self", EMPTY), ("used_size", EMPTY), ("prealloc_size", EMPTY)],
    control.set_instance_memory_limit: [("limit_bytes", EMPTY)],
    pool_registry.register_kv_cache_pool: [("manager", EMPTY)],
    observability.build_kv_cache_pool_snapshot: [("manager", EMPTY)],
    utils.get_kvcached_logger: [("name", "kvcached")],
    utils.align_up_to_page: [("n_cells", EMPTY), ("cell_size", EMPTY)],
}  # fmt: skip

# Upstream's keyword-only parameters that callers pass by name.
UPSTREAM_KEYWORDS = {
    KVCacheManager.set_memory_limit: ["revision"],
    KVCacheManager.observability_snapshot: ["integration"],
    control.set_instance_memory_limit: ["revision"],
    pool_registry.register_kv_cache_pool: ["integration"],
    pool_registry.get_registered_kv_cache_pools: ["integration"],
    observability.get_registered_kv_cache_pool_snapshot_dicts: ["integration"],
    si.alloc_mamba_states: ["num_slots", "num_mamba_layers", "cache_params", "device", "group_id"],
}


@pytest.mark.parametrize("fn", list(UPSTREAM), ids=lambda f: f.__qualname__)
def test_positional_parameters_are_upstreams(fn):
    params = [p for p in inspect.signature(fn).parameters.values() if p.kind is not p.KEYWORD_ONLY]
    want = UPSTREAM[fn]
    assert [p.name for p in params[: len(want)]] == [n for n, _ in want], fn
    for p, (name, default) in zip(params, want):
        if default != "*":
            assert p.default == default, f"{fn.__qualname__}({name}=...) default {p.default!r} != upstream {default!r}"
    for p in params[len(want) :]:  # anything of ours after them has a default: old callers never reach it
        assert p.default is not EMPTY or p.kind is p.VAR_KEYWORD, (fn, p.name)


@pytest.mark.parametrize("fn", list(UPSTREAM_KEYWORDS), ids=lambda f: f.__qualname__)
def test_upstream_keywords_are_accepted(fn):
    params = inspect.signature(fn).parameters
    for name in UPSTREAM_KEYWORDS[fn]:
        assert name in params and params[name].kind in (params[name].KEYWORD_ONLY, params[name].POSITIONAL_OR_KEYWORD)


def test_upstream_modules_and_names_exist():
    import kvcached
    import kvcached.cli.kvctl
    import kvcached.cli.kvtop
    import kvcached.cli.utils
    import kvcached.locks
    import kvcached.vmm_ops

    assert isinstance(kvcached.__version__, str)
    for name in ("init_kvcached", "shutdown_kvcached", "create_kv_tensors", "kv_tensors_created",
                 "map_to_kv_tensors", "unmap_from_kv_tensors", "PageAllocator"):  # fmt: skip
        assert hasattr(kvcached.vmm_ops, name), name
    for name in ("PAGE_SIZE", "GPU_UTILIZATION", "PAGE_PREALLOC_ENABLED", "MIN_RESERVED_PAGES", "MAX_RESERVED_PAGES",
                 "MAX_CACHED_BLOCKS", "SANITY_CHECK", "MAX_CACHED_TOKENS", "CONTIGUOUS_LAYOUT", "DEFAULT_IPC_NAME",
                 "SHM_DIR", "LOG_USE_COLOR", "KVCachedConfigError", "KVCachePoolExhausted", "ColorFormatter",
                 "get_log_level", "get_kvcached_logger", "normalize_gpu_device", "align_to", "align_up_to_page",
                 "_sanitize_segment", "_detect_engine_tag", "_ipc_segment_exists", "_obtain_default_ipc_name",
                 "_get_page_size"):  # fmt: skip
        assert hasattr(utils, name), name
    for name in ("should_use_worker_ipc", "get_world_size", "observability_snapshot", "observability_snapshot_dict",
                 "kv_cache_pool_snapshots", "kv_cache_pool_snapshot_dicts", "shutdown_kvcached"):  # fmt: skip
        assert callable(getattr(vi, name)) and (
            name in ("should_use_worker_ipc", "get_world_size") or hasattr(si, name)
        )
    for name in ("IPC_TIMEOUT_S", "SOCKET_DIR", "Message", "_get_socket_dir_name"):
        assert hasattr(tp_ipc_util, name), name
    from kvcached.observability import SCHEMA_VERSION, KVCachePoolSnapshot, RuntimeSnapshot, get_capabilities

    caps = get_capabilities()
    assert caps["schema_version"] == SCHEMA_VERSION == "kvcached.observability.v1"
    assert caps["pool_snapshot_fields"] == list(KVCachePoolSnapshot.__dataclass_fields__)
    assert caps["runtime_snapshot_fields"] == list(RuntimeSnapshot.__dataclass_fields__)
    json.dumps(caps)


# -------------------------------------------------- kvcached.utils and env


def test_error_types_are_upstreams_and_ours():
    assert issubclass(utils.KVCachePoolExhausted, ValueError) and issubclass(
        utils.KVCachePoolExhausted, OutOfMemoryError
    )
    assert issubclass(utils.KVCachedConfigError, RuntimeError) and issubclass(
        utils.KVCachedConfigError, InvalidArgumentError
    )
    with pytest.raises(ValueError):  # how upstream's callers catch a pool shortage
        raise utils.KVCachePoolExhausted("short")


def test_constants_read_the_environment_when_read(monkeypatch):
    for v in config.VARIABLES:
        monkeypatch.delenv(v.name, raising=False)
    assert (utils.PAGE_SIZE, utils.MAX_CACHED_BLOCKS, utils.MAX_CACHED_TOKENS) == (2 << 20, 1000, -1)
    assert (utils.SANITY_CHECK, utils.CONTIGUOUS_LAYOUT, utils.PAGE_PREALLOC_ENABLED) == (False, False, True)
    monkeypatch.setenv("KVCACHED_PAGE_SIZE_MB", "4")
    monkeypatch.setenv("KVCACHED_MAX_CACHED_TOKENS", "16000")
    monkeypatch.setenv("KVCACHED_SANITY_CHECK", "true")
    assert (utils.PAGE_SIZE, utils.MAX_CACHED_TOKENS, utils.SANITY_CHECK) == (4 << 20, 16000, True)
    assert utils._get_page_size() == 4 << 20 and utils.align_up_to_page(1, 4 << 10) == 1024
    monkeypatch.setenv("KVCACHED_PAGE_SIZE_MB", "three")
    with pytest.raises(ValueError, match="KVCACHED_PAGE_SIZE_MB='three' is not an integer"):
        utils.PAGE_SIZE  # noqa: B018  (a typo stops start-up, as upstream's ValueError)
    with pytest.raises(AttributeError):
        utils.NOT_A_CONSTANT  # noqa: B018
    assert utils.normalize_gpu_device("hip:1") == "cuda:1" and utils.normalize_gpu_device("cpu") == "cpu"
    assert utils._sanitize_segment("a/b c") == "a-b-c"


def test_default_ipc_name_is_explicit_and_exact(monkeypatch):
    # Upstream's own test: an explicit name is used as given, /dev/shm is not probed.
    monkeypatch.setenv("KVCACHED_IPC_NAME", "shared-instance-ipc")
    monkeypatch.setattr(utils, "_ipc_segment_exists", lambda n: pytest.fail(f"probed {n}"))
    assert utils._obtain_default_ipc_name() == "shared-instance-ipc" == utils.DEFAULT_IPC_NAME
    monkeypatch.setenv("KVCACHED_IPC_NAME", "has space")
    with pytest.raises(ValueError, match="invalid"):  # upstream rewrote it silently
        utils._obtain_default_ipc_name()
    monkeypatch.delenv("KVCACHED_IPC_NAME")
    assert utils.DEFAULT_IPC_NAME == f"kvcached_kvcached_{os.getpid()}"


def test_logger_is_upstreams():
    name = f"kvcached.test_{uuid.uuid4().hex[:6]}"
    log = utils.get_kvcached_logger(name)
    assert utils.get_kvcached_logger(name) is log and len(log.handlers) == 1 and not log.propagate
    rec = logging.LogRecord(name, logging.WARNING, "f.py", 7, "hello", None, None)
    out = log.handlers[0].format(rec)
    assert out.startswith(f"[{name}][WARNING][") and out.endswith("[f.py:7] hello")
    colored = utils.ColorFormatter("[x] %(message)s").format(rec)
    assert colored.startswith("\033[33m[x] \033[0m") and colored.endswith("hello")


def test_log_level_variable_takes_over_the_kvcached_logger(tmp_path):
    code = (
        "import logging; from kvcached import utils; utils.configure_logging();"
        "l = logging.getLogger('kvcached'); print(l.level, len(l.handlers), l.propagate)"
    )
    env = dict(os.environ, KVCACHED_LOG_LEVEL="debug")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == [str(logging.DEBUG), "1", "False"], out.stderr
    env.pop("KVCACHED_LOG_LEVEL")  # unset: records go to the engine's logging untouched
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["0", "0", "True"], out.stderr
    env["KVCACHED_LOG_LEVEL"] = "chatty"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "KVCACHED_LOG_LEVEL='chatty' is not a level" in out.stderr


def test_no_op_locks():
    lock = NoOpLock()
    with lock as got:
        assert got is True
    assert lock.acquire(timeout=0) is True
    cond = NoOpCondition(lock)
    assert cond.wait(5) is True and cond.wait_for(lambda: 42) == 42
    cond.notify()
    cond.notify_all()


def test_version_names_the_build():
    out = subprocess.run(
        [sys.executable, "-m", "kvcached", "--version"], capture_output=True, text=True, timeout=60, check=True
    )
    import kvcached

    line = out.stdout.strip()
    assert line.startswith(f"kvcached {kvcached.__version__} commit ") and kvcached.build_info()["location"] in line
    assert "commit unknown" not in line  # a source tree (this checkout) knows its commit


# ------------------------------------------------------- KVCacheManager


@pytest.fixture
def plane(monkeypatch):
    """The host data plane with 2-layer tensors of 64 blocks (16 per 64 KiB page)."""
    from kvcached import vmm_ops

    monkeypatch.setenv("KVCACHED_MIN_RESERVED_PAGES", "0")
    monkeypatch.setenv("KVCACHED_MAX_RESERVED_PAGES", "1")
    monkeypatch.delenv("KVCACHED_IPC_NAME", raising=False)
    vmm_ops.init_kvcached("cpu", page_size=64 << 10, contiguous_layout=False)
    vmm_ops.create_kv_tensors(64 * 4096, 2, "cpu", num_layers=LAYERS)
    made = []
    yield made
    for m in made:
        m.shutdown()
    vmm_ops.shutdown_kvcached()


def _manager(made, *args, **kw):
    kw.setdefault("empty_page_grace_s", 0)
    m = KVCacheManager(*args, **kw)
    made.append(m)
    return m


def test_manager_positional_call_and_record_by_default(plane):
    # Upstream: (num_blocks, block_size, cell_size, num_layers, world_size, pp_rank, async_sched,
    #            reserve_null_block, num_kv_buffers, group_id, pool_name)
    m = _manager(plane, 64, 16, 256, LAYERS, 1, 0, False, True, 2, 0, "full_attention")
    assert (m.world_size, m.pp_rank, m.reserve_null_block, m.num_kv_buffers, m.group_id) == (1, 0, True, 2, 0)
    assert m.pool_name == "full_attention" and m.null_block == [0]
    own = f"kvcached_kvcached_{os.getpid()}"
    assert m.limits.name == own and read_record(own).alive  # kvctl list shows it, as upstream's
    m2 = _manager(plane, 64, 16, 256, LAYERS)  # the same name is held: upstream's suffix
    assert m2.limits.name == own + "_1" and m2.pool_name == own + "_1"
    bare = _manager(plane, 64, 16, 256, LAYERS, own_segment=False)
    assert bare.limits is None
    ids = m.alloc(5)
    m.free(indices=ids)  # upstream's keyword
    m2.shutdown()
    assert own + "_1" not in {r.name for r in list_records()}
    assert utils.DEFAULT_IPC_NAME == own


def test_manager_bad_input_is_refused_with_nothing_changed(plane):
    m = _manager(plane, 64, 16, 256, LAYERS, reserve_null_block=True)
    ids = m.alloc(3)
    before = snapshot(m)
    for bad in ([ids[0], ids[0]], [63], [0], ["1"]):  # twice, never allocated, the null block, not an int
        with pytest.raises(ValueError):  # InvalidArgumentError: upstream's SANITY_CHECK type, always on here
            m.free(indices=bad)
        assert snapshot(m) == before
    with pytest.raises(utils.KVCachedConfigError, match="page"):  # a block larger than the page
        KVCacheManager(4, 16, 8192, LAYERS, own_segment=False)
    for bad in (-1, True, 1.5, "8M"):
        with pytest.raises(ValueError):
            m.set_memory_limit(bad, revision=1)
        with pytest.raises(ValueError):
            m.set_memory_limit(1 << 20, revision=bad)
    assert m.memory_limit_state()["revision"] == -1 and snapshot(m) == before
    m.free(ids)
    check_invariants(m)


def test_set_memory_limit_is_upstreams(plane):
    m = _manager(plane, 64, 16, 256, LAYERS)
    bundle = m.bytes_per_page  # one page in every layer and buffer
    st = m.memory_limit_state()
    assert (st["status"], st["limit_bytes"], st["revision"]) == ("applied", None, -1)
    st = m.set_memory_limit(3 * bundle + 123, revision=7)
    assert (st["status"], st["limit_bytes"], st["effective_limit_bytes"], st["revision"]) == (
        "applied", 3 * bundle + 123, 3 * bundle, 7,
    )  # fmt: skip
    assert read_record(m.limits.name).limit == 3 * bundle  # where kvctl sees it
    assert m.set_memory_limit(3 * bundle + 123, revision=7) == st  # repeat: no-op
    assert m.set_memory_limit(bundle, revision=7)["status"] == "conflict"
    assert m.set_memory_limit(bundle, revision=6)["status"] == "stale"
    assert m.set_memory_limit(100 * bundle, revision=8)["effective_limit_bytes"] == 4 * bundle  # clamped
    ids = m.alloc(40)  # three pages
    st = m.set_memory_limit(bundle, revision=9)
    assert st["status"] == "deferred" and st["reason"] == "inuse_capacity_above_limit"
    assert st["mapped_bytes"] == 3 * bundle and st["overage_bytes"] == 2 * bundle
    assert m.alloc(16) is None  # nothing new is mapped past the limit
    m.free(ids)
    st = m.memory_limit_state()
    assert st["status"] == "applied" and st["mapped_bytes"] <= bundle
    assert m.set_memory_limit(0, revision=10)["effective_limit_bytes"] == 0  # upstream: drains an idle pool
    assert m.alloc(1) is None and m.memory_limit_state()["mapped_bytes"] == 0
    check_invariants(m)


def test_instance_limit_is_split_over_this_process_pools(plane):
    pool_registry.clear_registered_kv_cache_pools()
    a = _manager(plane, 64, 16, 256, LAYERS, pool_name="a")  # 4 pages
    b = _manager(plane, 32, 16, 256, LAYERS, pool_name="b", group_id=1)  # 2 pages
    bundle = a.bytes_per_page
    r = control.set_instance_memory_limit(3 * bundle, revision=4)  # upstream's call
    assert r["status"] == "applied" and r == "applied" and r.status == "applied"
    assert [p["pool_name"] for p in r["pools"]] == ["a", "b"]
    assert [p["effective_limit_bytes"] for p in r["pools"]] == [2 * bundle, bundle]  # by capacity, 2:1
    assert r["effective_limit_bytes"] == 3 * bundle and r["revision"] == 4
    assert control.set_instance_memory_limit(bundle, revision=3)["status"] == "stale"
    r = control.set_instance_memory_limit(0, revision=5)  # 0 is a limit (upstream's drain)
    assert r["status"] == "applied" and r["effective_limit_bytes"] == 0
    assert control.set_instance_memory_limit(-1, revision=6) == "rejected"  # never raises; nothing written
    assert a.memory_limit_state()["revision"] == 5
    # By name: one record, as kvctl writes it (ours).
    r = control.set_instance_memory_limit(2 * bundle, name=a.limits.name, wait_s=2.0)
    assert r == "applied" and r.name == a.limits.name and r["pools"] == [] and str(r) == "applied"
    for m in (a, b):
        m.shutdown()
    assert pool_registry.get_registered_kv_cache_pools() == []
    r = control.set_instance_memory_limit(1024, revision=1)
    assert r["status"] == "unavailable" and r["reason"] == "no_registered_kv_cache_pool" and r["pools"] == []


def test_pool_snapshots(plane):
    pool_registry.clear_registered_kv_cache_pools()
    m = _manager(plane, 64, 16, 256, LAYERS, reserve_null_block=True, pool_name="mha")
    ids = m.alloc(20)
    assert m.try_to_reserve(2)
    d = m.observability_snapshot_dict(integration="sglang")
    per_block = 16 * 256 * LAYERS * 2
    assert (d["pool_name"], d["integration"], d["total_blocks"], d["num_kv_buffers"]) == ("mha", "sglang", 64, 2)
    assert d["allocated_blocks"] == 23 and d["reserved_blocks"] == 2  # with the null block and the reserved
    assert d["available_blocks"] == m.available_size() and d["allocated_bytes"] == 23 * per_block
    assert d["inuse_pages"] == 2 and d["mapped_bytes"] == 2 * m.bytes_per_page
    assert d["virtual_total_bytes"] == 64 * 16 * 256 * 2 * LAYERS and d["null_block_reserved"] is True
    # The device's free memory is read live (on a GPU it moves between two calls): compared apart.
    again = observability.build_kv_cache_pool_snapshot(m).to_dict()
    live = "available_physical_pages"
    assert again[live] > 0 and d[live] > 0
    assert dict(again, **{live: None}) == dict(d, integration=None, **{live: None})
    assert [s["pool_name"] for s in observability.get_registered_kv_cache_pool_snapshot_dicts()] == ["mha"]
    assert observability.get_registered_kv_cache_pool_snapshot_dicts(integration="vllm") == []
    assert not m.resize(m.page_size)  # one page: the second page drains (not yet applied)
    assert m.in_shrink and m.target_num_blocks == 16 and m.observability_snapshot().in_shrink
    m.free_reserved()
    m.free(ids)
    assert not m.in_shrink and m.target_num_blocks is None and m.reserved_blocks == []
    json.dumps(d)


def test_sanity_check_variable_checks_after_every_change(plane, monkeypatch):
    monkeypatch.setenv("KVCACHED_SANITY_CHECK", "true")
    m = _manager(plane, 64, 16, 256, LAYERS)
    calls = []
    real = m.check_invariants
    m.check_invariants = lambda: calls.append(1) or real()
    m.free(m.alloc(3))
    assert m.try_to_reserve(1)
    m.free_reserved()
    assert len(calls) == 4
    monkeypatch.setenv("KVCACHED_SANITY_CHECK", "off")
    assert "alloc" not in vars(_manager(plane, 64, 16, 256, LAYERS, own_segment=False))  # no wrapper: no cost


def test_mem_info_tracker_is_a_record(plane, monkeypatch):
    monkeypatch.setenv("KVCACHED_IPC_NAME", f"kvt_mit_{uuid.uuid4().hex[:8]}")
    t = MemInfoTracker(8 << 20, group_id=2)
    try:
        assert t.ipc_name == os.environ["KVCACHED_IPC_NAME"] + "_g2"
        assert read_record(t.ipc_name).limit == 8 << 20 and read_record(t.ipc_name).device == "cpu"
        assert t.check_and_get_resize_target(1 << 20, 4, 2) is None
        assert control.set_instance_memory_limit(4 << 20, name=t.ipc_name, wait_s=0).written
        assert t.check_and_get_resize_target(1 << 20, 4, 2) == 512 << 10
        t.update_memory_usage(1 << 20, 2 << 20)
        rec = read_record(t.ipc_name)
        assert (rec.used_size, rec.prealloc_size, rec.total_size) == (1 << 20, 2 << 20, 4 << 20)
        with pytest.raises(InvalidArgumentError, match="live process"):
            MemInfoTracker(8 << 20, group_id=2)  # one owner per name
        with pytest.raises(InvalidArgumentError, match="> 0"):
            MemInfoTracker(0)
    finally:
        t._unlink_segment()
    t._unlink_segment()
    assert t.ipc_name not in {r.name for r in list_records()}


# ----------------------------------------------------------- interfaces


@pytest.fixture
def engines(monkeypatch):
    monkeypatch.setenv("KVCACHED_PAGE_SIZE", str(64 << 10))
    monkeypatch.delenv("KVCACHED_IPC_NAME", raising=False)
    yield
    vi.shutdown_kvcached()
    si.shutdown_kvcached()


def test_vllm_init_positions(engines):
    from kvcached.compat import runtime

    vi.init_kvcached(0, 1, 0, True, "cpu", True)  # upstream: (tp_rank, world_size, pp_rank, is_worker, device, async)
    st = runtime.state()
    assert (st.pp_rank, st.is_worker, st.device, st.async_sched) == (0, True, "cpu", True)
    assert vi.get_world_size() == 1 and not vi.should_use_worker_ipc()
    snap = vi.observability_snapshot_dict()
    assert snap == {
        "schema_version": "kvcached.observability.v1", "engine": "vllm", "initialized": True, "device": "cpu",
        "world_size": 1, "pp_rank": 0, "async_sched": True, "contiguous_layout": False, "is_worker": True,
    }  # fmt: skip
    vi.alloc_kv_cache((2, 64, 16, 2, 32), 16, torch.float16, "cpu", LAYERS)
    m = vi.get_kv_cache_manager(64, 16, 2 * 32 * 2, LAYERS, 2, 0, "unified")  # upstream's positions
    assert (m.num_kv_buffers, m.group_id, m.pool_name, m.integration) == (2, 0, "unified", "vllm")
    assert m.limits.name == f"kvcached_vllm_{os.getpid()}" and m.limits.budget is not None  # in the device budget
    assert [s["pool_name"] for s in vi.kv_cache_pool_snapshot_dicts()] == ["unified"]
    assert si.kv_cache_pool_snapshot_dicts() == []
    vi.shutdown_kvcached()
    assert vi.kv_cache_pool_snapshot_dicts() == [] and vi.observability_snapshot().initialized is False
    with pytest.raises(Exception, match="init_kvcached"):
        vi.get_world_size()


def test_sglang_init_positions(engines):
    from kvcached.compat import runtime

    si.init_kvcached(1, 2, 0, "cpu", False)  # upstream: (tp_rank, world_size, pp_rank, device, async)
    st = runtime.state()
    assert (st.tp_rank, st.world_size, st.pp_rank, st.device) == (1, 2, 0, "cpu")
    si.alloc_kv_cache((1024 + 1, 2, 16), torch.float16, "cpu", LAYERS)
    m = si.get_kv_cache_manager(1024, 1, 2 * 16 * 2, LAYERS, True, 2, 0, "mha")
    assert (m.null_block, m.num_kv_buffers, m.pool_name, m.integration) == ([0], 2, "mha", "sglang")
    assert [s["integration"] for s in si.kv_cache_pool_snapshot_dicts()] == ["sglang"]


# ----------------------------------------------------------- tp_ipc_util


def test_tp_ipc_constants_read_when_read(monkeypatch):
    monkeypatch.setenv("KVCACHED_IPC_NAME", "compat-ipc")
    assert tp_ipc_util.SOCKET_DIR == socket_root("compat-ipc")
    assert tp_ipc_util._get_socket_dir_name() == os.path.basename(socket_root("compat-ipc"))
    assert tp_ipc_util.get_worker_socket_path(3) == os.path.join(tp_ipc_util.SOCKET_DIR, "w3.sock")
    monkeypatch.setenv("KVCACHED_IPC_TIMEOUT", "60")
    assert tp_ipc_util.IPC_TIMEOUT_S == 60.0
    monkeypatch.setenv("KVCACHED_IPC_TIMEOUT", "0")  # upstream: no timeout; ours: the longest bound
    assert tp_ipc_util.IPC_TIMEOUT_S == config.NO_TIMEOUT_CAP_S


def test_messages_are_framed_as_upstream_without_pickle():
    a, b = socket.socketpair()
    with a, b:
        tp_ipc_util.send_msg(a, {"cmd": "map_to_kv_tensors", "offsets": [0, 65536], "group_id": 1})
        assert tp_ipc_util.recv_msg(b) == {"cmd": "map_to_kv_tensors", "offsets": [0, 65536], "group_id": 1}
        import pickle

        evil = pickle.dumps({"cmd": "x"})  # what upstream's peer sends: never unpickled here
        a.sendall(len(evil).to_bytes(4, "big") + evil)
        with pytest.raises(ValueError, match="not JSON"):
            tp_ipc_util.recv_msg(b)
        a.sendall((1 << 30).to_bytes(4, "big"))
        with pytest.raises(ValueError, match="outside"):
            tp_ipc_util.recv_msg(b)
        with pytest.raises(ValueError, match="JSON-serializable"):
            tp_ipc_util.send_msg(a, {"obj": object()})
        a.close()
        with pytest.raises(ConnectionError):
            tp_ipc_util.recv_msg(b)


def test_create_kv_tensors_keeps_upstreams_seventh_position_unified_pool():
    """Upstream's 7th positional is ``unified_pool``; an old caller passing True must
    get the fix named, never have True read as another argument (``chunk_bytes``
    is keyword-only here)."""
    from kvcached import vmm_ops
    from kvcached.errors import InvalidArgumentError

    vmm_ops.init_kvcached("cpu", page_size=64 << 10, contiguous_layout=False)
    try:
        with pytest.raises(InvalidArgumentError, match="num_kv_buffers=1"):
            vmm_ops.create_kv_tensors(64 << 10, 1, "cpu", 2, 2, 0, True)
        layers = vmm_ops.create_kv_tensors(64 << 10, 1, "cpu", 2, 2, 0, False)
        assert len(layers) == 2
        with pytest.raises(TypeError):
            vmm_ops.create_kv_tensors(64 << 10, 1, "cpu", 2, 2, 0, False, 4096)  # chunk_bytes by keyword only
    finally:
        vmm_ops.shutdown_kvcached()
