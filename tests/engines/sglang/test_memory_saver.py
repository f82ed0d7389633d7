"""SGLang's memory saver with kvcached: ``--enable-memory-saver`` is served, and
``release_memory_occupation`` / ``resume_memory_occupation`` move the KV memory
through kvcached (``kvcached.integration.sglang.memory_saver``).

* the updater's real methods (SGLang's ``SchedulerWeightUpdaterManager``) on elastic
  pools built in this process: kvcached follows ``offload_tags``, failures included;
* one real engine (``sleep_driver.py``): tokens after a resume equal those before the
  release, nothing mapped while released (the padding slot's page neither).
"""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

HERE = os.path.dirname(os.path.abspath(__file__))
STUBS = os.path.join(os.path.dirname(HERE), "sglang_stubs")
KV_PAGE = 4096
BYTES_PER_PAGE = KV_PAGE * 2 * 2  # 2 layers x K/V of the tiny model


def test_enable_memory_saver_is_not_refused() -> None:
    from sglang.srt.server_args import ServerArgs

    from kvcached.integration.sglang.conflicts import check_pool, server_args_conflicts

    assert server_args_conflicts(SimpleNamespace(enable_memory_saver=True)) == []
    check_pool(SimpleNamespace(memory_saver_adapter=SimpleNamespace(enabled=True)))  # no error
    del ServerArgs


class _Saver:
    """SGLang's memory-saver adapter as the updater calls it (pause/resume by tag)."""

    def __init__(self, fail: str = "") -> None:
        self.calls, self.fail = [], fail

    def pause(self, tag: str) -> None:
        self.calls.append(("pause", tag))
        if ("pause", tag) == tuple(self.fail.split(":")):
            raise RuntimeError(f"pause {tag} failed")

    def resume(self, tag: str) -> None:
        self.calls.append(("resume", tag))
        if ("resume", tag) == tuple(self.fail.split(":")):
            raise RuntimeError(f"resume {tag} failed")


def cpu_sync(monkeypatch) -> None:
    """SGLang's release synchronises ``torch.get_device_module()``: with a CUDA build of torch
    on a machine without a GPU that is torch.cuda, which raises; nothing runs to wait for here."""
    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.distributed, "barrier", lambda *a, **k: None)  # no process group here


@pytest.fixture
def elastic(unit_kvcached_env, monkeypatch):
    """An elastic MHA pool and allocator in this process, and SGLang's weight updater over them."""
    import dataclasses

    from sglang.srt.managers.scheduler_components import weight_updater as wu

    from kvcached.integration.sglang.allocator import ElasticPagedTokenToKVPoolAllocator
    from kvcached.integration.sglang.pool import ElasticMHATokenToKVPool, instance

    pool = ElasticMHATokenToKVPool(
        1024, page_size=16, dtype=torch.float16, head_num=2, head_dim=32, layer_num=2, device="cpu",
        enable_memory_saver=False,
    )  # fmt: skip
    alloc = ElasticPagedTokenToKVPoolAllocator(1024, 16, torch.float16, "cpu", pool, need_sort=False)
    saver = _Saver()
    fields = {f.name for f in dataclasses.fields(wu.SchedulerWeightUpdaterManager) if f.init}
    # 0.5.2x reads the engine's published runtime context (TP group, weight-cache mode).
    if hasattr(wu, "get_parallel"):
        monkeypatch.setattr(wu, "get_parallel", lambda: SimpleNamespace(tp_group=SimpleNamespace(cpu_group=None)))
    if hasattr(wu, "get_model"):
        monkeypatch.setattr(wu, "get_model", lambda: SimpleNamespace(weight_cache_mode="off"))
    cpu_sync(monkeypatch)
    kw = dict(
        tp_worker=SimpleNamespace(model_runner=SimpleNamespace(model=torch.nn.Linear(2, 2))),
        draft_worker=None,
        tp_cpu_group=None,
        memory_saver_adapter=saver,
        flush_cache=lambda *a, **k: alloc.clear() or True,  # the scheduler's flush, as far as the pool goes
        is_fully_idle=lambda *a, **k: True,
    )
    if "scheduler" in fields:
        kw["scheduler"] = None
    updater = wu.SchedulerWeightUpdaterManager(**{k: v for k, v in kw.items() if k in fields})
    return SimpleNamespace(pool=pool, alloc=alloc, saver=saver, updater=updater, inst=instance(), wu=wu)


def _req(wu, name: str, tags=None):
    from sglang.srt.managers import io_struct

    return getattr(io_struct, name)(tags=tags)


def _mapped(e) -> int:
    return e.pool.kvcached_group.mapped_pages()


def _patched(e) -> None:
    from kvcached.integration.patch_base import WRAPPED

    for m in ("release_memory_occupation", "resume_memory_occupation"):
        assert hasattr(getattr(e.wu.SchedulerWeightUpdaterManager, m), WRAPPED), f"{m} is not patched"


def test_release_gives_back_every_page_and_resume_maps_on_demand(elastic) -> None:
    e = elastic
    _patched(e)
    got = e.alloc.alloc(160)  # ten SGLang pages of 16 tokens
    assert got is not None and _mapped(e) > 1
    e.alloc.free(got)  # the request finished; the radix cache would keep it until the flush
    e.updater.release_memory_occupation(_req(e.wu, "ReleaseMemoryOccupationReqInput"))
    assert ("pause", "kv_cache") in e.saver.calls and ("pause", "weights") in e.saver.calls
    assert e.inst.asleep and _mapped(e) == 0  # the padding slot's page too
    assert e.alloc.alloc(160) is None  # nothing is mapped while released
    e.updater.resume_memory_occupation(_req(e.wu, "ResumeMemoryOccupationReqInput"))
    assert not e.inst.asleep
    again = e.alloc.alloc(160)
    assert again is not None and _mapped(e) > 1
    e.alloc.free(again)


def test_weights_alone_leave_the_kv_cache_and_a_failed_resume_keeps_it_released(elastic) -> None:
    e = elastic
    e.updater.release_memory_occupation(_req(e.wu, "ReleaseMemoryOccupationReqInput", ["weights"]))
    assert not e.inst.asleep
    e.updater.resume_memory_occupation(_req(e.wu, "ResumeMemoryOccupationReqInput", ["weights"]))
    e.updater.release_memory_occupation(_req(e.wu, "ReleaseMemoryOccupationReqInput", ["kv_cache"]))
    assert e.inst.asleep and e.updater.offload_tags == {"kv_cache"}
    e.saver.fail = "resume:kv_cache"
    with pytest.raises(RuntimeError, match="resume kv_cache failed"):
        e.updater.resume_memory_occupation(_req(e.wu, "ResumeMemoryOccupationReqInput", ["kv_cache"]))
    # SGLang took the tag out before its resume failed: kvcached follows SGLang's view.
    assert not e.updater.offload_tags and not e.inst.asleep


def test_a_release_refused_as_not_idle_changes_nothing(elastic) -> None:
    e = elastic
    e.updater.is_fully_idle = lambda *a, **k: False
    with pytest.raises(AssertionError, match="idle"):
        e.updater.release_memory_occupation(_req(e.wu, "ReleaseMemoryOccupationReqInput"))
    assert not e.inst.asleep and not e.updater.offload_tags and e.saver.calls == []


# ------------------------------------------------------------------ a real engine
@pytest.fixture(scope="module")
def sleep_run(tiny_model, tmp_path_factory):
    import json

    work = tmp_path_factory.mktemp("sleep_run")
    name = f"kvcached_sglang_sleep_{os.getpid()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVCACHED_", "SGLANG_")) and k != "ENABLE_KVCACHED"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (STUBS, HERE, env.get("PYTHONPATH", "")) if p)
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        ENABLE_KVCACHED="true",
        KVCACHED_PAGE_SIZE=str(KV_PAGE),
        KVCACHED_IPC_NAME=name,
        KVCACHED_HOST_MEMORY_BUDGET="64M",
    )
    out, log = str(work / "sleep.json"), str(work / "sleep.log")
    with open(log, "w") as f:
        rc = subprocess.run(
            [sys.executable, os.path.join(HERE, "sleep_driver.py"), tiny_model, out, name],
            env=env, stdout=f, stderr=subprocess.STDOUT, timeout=900, cwd=str(work),
        ).returncode  # fmt: skip
    text = open(log, errors="replace").read()
    if rc != 0:
        pytest.fail(f"the sleep run failed (rc={rc}):\n{text[-6000:]}")
    res = json.load(open(out))
    res["log"] = text
    return res


def _mapped_bytes(rec) -> int:
    return rec["used"] + rec["prealloc"]


def test_tokens_after_a_resume_equal_those_before_the_release(sleep_run) -> None:
    before = sleep_run["tokens_before"]
    assert len(before) == 4 and all(len(t) == 16 for t in before)
    assert sleep_run["tokens_after"] == before and sleep_run["tokens_after2"] == before


def test_released_nothing_is_mapped_not_even_the_padding_slots_page(sleep_run) -> None:
    assert _mapped_bytes(sleep_run["before_release"]) > BYTES_PER_PAGE  # the radix cache's pages
    assert _mapped_bytes(sleep_run["released"]) == 0, sleep_run["released"]
    assert _mapped_bytes(sleep_run["kv_released"]) == 0
    assert sleep_run["released"]["limit"] == sleep_run["awake"]["limit"]  # the operator's limit is kept
    assert "KV cache released (asleep)" in sleep_run["log"]


def test_releasing_the_weights_alone_keeps_the_kv_cache(sleep_run) -> None:
    assert _mapped_bytes(sleep_run["weights_released"]) == _mapped_bytes(sleep_run["awake"])


def test_a_limit_written_while_released_maps_nothing_until_the_resume(sleep_run) -> None:
    w = sleep_run["limit_while_released"]
    assert w["status"] in ("applied", "deferred"), w
    assert w["record"]["limit"] == sleep_run["awake"]["limit"] // 2
    assert _mapped_bytes(w["record"]) == 0
    assert sleep_run["resumed"]["limit"] == sleep_run["awake"]["limit"] // 2
