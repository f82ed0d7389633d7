"""Model families other than a plain Llama on a real SGLang (CPU, torch_native
attention), with kvcached against the same workload without it: identical greedy
tokens with the radix (prefix) cache on, a ``--max-total-tokens`` pool far smaller
than the workload (SGLang evicts cached prefixes: pass 2 misses some of pass 1's) and
running requests retracted (their KV freed, recomputed later). Whether SGLang's
admission over-commits the pool depends on how the 8 requests reach the scheduler
(seen both ways in otherwise identical runs), so retraction is made certain with
SGLang's own switch (``SGLANG_TEST_RETRACT``: retract every
``SGLANG_TEST_RETRACT_INTERVAL`` decode steps); retractions because the pool is full
come on top when they come (``sglang_family_driver.py``; one process per run).

* ``gemma3``: Gemma 3, local (sliding-window) + global layers. SGLang disables its
  hybrid SWA memory for Gemma 2/3 (``_gemma2_gemma3_overrides``: "Disable hybrid SWA
  memory ... not yet supported", 0.5.15 and 0.5.23): one MHA pool keeps every token of
  every layer and the window is a mask in the attention backend. One request also
  decodes 2,000 tokens (many kvcached pages; the window moves past 30 times).
* ``llama-fp8``: the tiny Llama with ``--kv-cache-dtype fp8_e4m3`` (1-byte KV cells;
  SGLang stores them as uint8).

* ``lfm2``: LFM2, short-convolution layers beside attention layers: a request's conv
  state lives in SGLang's ``MambaPool`` (kvcached's elastic state pool, its own record);
  pass 2 continues each request (a second turn) from the state the radix cache kept. Its
  conv kernel (Triton in SGLang) runs in torch here (``cpu_torch``), native and kvcached alike.
* ``qwen3-next`` (start-up only): a Mamba / gated-delta-net hybrid. The real engine
  builds its pools with kvcached (the state pool and the attention pool elastic, each
  with its record) and a state slot larger than the kvcached page stops start-up in one
  line. It cannot generate here: SGLang runs GDN layers on a CPU only in its CPU engine
  mode (``SGLANG_USE_CPU_ENGINE=1``), which takes every layer to ``sgl_kernel``'s CPU
  kernels (not installed; built from source for Intel CPUs), and otherwise runs them with
  Triton. The state pool's data path is proven from SGLang's classes
  (``test_mamba_state.py``).

What SGLang cannot run on a CPU (torch_native), so not here: Gemma 4 (hybrid SWA
pools, global layers of a different head size: "Gemma4 only supports trtllm_mha,
triton, fa4, ascend, intel_xpu, intel_amx, or aiter attention backend"), DeepSeek-V2
MLA (torch_native's SDPA fails on the latent K/V). Their pools are proven from
SGLang's real classes in ``test_pools_allocators.py`` (MLA pool layout, SWA composite).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from typing import Any, Dict

import pytest

from kvcached.integration import families

HERE = os.path.dirname(os.path.abspath(__file__))
DRIVER = os.path.join(HERE, "sglang_family_driver.py")
STUBS = os.path.join(os.path.dirname(HERE), "sglang_stubs")
CPU_TORCH = os.path.join(HERE, "cpu_torch")  # hybrid-state models on a CPU (see its sitecustomize)
KV_PAGE = 4096  # small kvcached pages: a request spans many of them
# The tiny Qwen3-Next's state slot (2 GDN layers, ~137 KiB) fits a 256 KiB page; SGLang's
# no_buffer radix strategy (the one without per-chunk state snapshots) runs without overlap.
HYBRID_PAGE = 256 * 1024

# The cases (and each one's model) come from the family table; here, each case's driver
# config. Pools (--max-total-tokens, the same in both runs) far below what workload A's 8
# requests (40-47 prompt tokens + up to a_new) need together.
# Hybrid-state models: SGLang's radix strategy without per-chunk state snapshots (none on a
# CPU) runs without overlap scheduling; a bounded state pool (SGLang sizes it from the budget
# otherwise: millions of 1 KiB LFM2 slots, too many mappings for the host backend's 4 KiB
# pages); the 8 requests reach the scheduler in one message (tokenized as a batch). Arriving
# one by one, they are admitted in timing-dependent groups, the retractions fall on other
# steps, and a retracted request recomputed by a prefill rounds differently from the
# decode: one of 8 LFM2 requests then differed after 235 tokens (docs/notes/sglang_seams.md).
HYBRID_ENGINE = dict(
    mamba_radix_cache_strategy="no_buffer",
    disable_overlap_schedule=True,
    max_mamba_cache_size=48,
    enable_tokenizer_batch_encode=True,
)
CASES = families.cases("sglang")
WORKLOADS: Dict[str, Any] = {
    "gemma3": dict(max_total_tokens=2100, a_new=300, long=2000, long_prompts=1),
    "llama-fp8": dict(max_total_tokens=700, a_new=120, kv_cache_dtype="fp8_e4m3"),
    "lfm2": dict(max_total_tokens=2100, a_new=300, long=2000, long_prompts=1, multi_turn=True, engine=HYBRID_ENGINE),
}
HYBRID_PATH = CPU_TORCH + os.pathsep + STUBS  # engine processes of the hybrid-state families
QWEN3_NEXT = dict(page_size=1, max_total_tokens=2000, start_only=True, engine=HYBRID_ENGINE)
RETRACTED = ("KV cache pool is full. Retract requests.", "Testing retraction.")
RETRACT_EVERY = 64  # decode steps


def _model(root, builder: str, **kwargs: Any) -> str:
    from kvcached.testing.tiny_families import build_tiny

    suffix = "_sglang" if kwargs.get("sglang") else ""
    return build_tiny(os.path.join(str(root), f"tiny_{builder}{suffix}"), builder, **kwargs)


def _env(kv: bool, name: str, kv_page: int = KV_PAGE, path: str = STUBS) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVCACHED_", "SGLANG_")) and k != "ENABLE_KVCACHED"}
    # SGLang imports vllm._custom_ops on the CPU path: the test stub provides it.
    env["PYTHONPATH"] = path + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.update(SGLANG_TEST_RETRACT="1", SGLANG_TEST_RETRACT_INTERVAL=str(RETRACT_EVERY))
    if kv:
        env.update(ENABLE_KVCACHED="true", KVCACHED_PAGE_SIZE=str(kv_page), KVCACHED_IPC_NAME=name)
    return env


def _run(work, key: str, cfg: Dict[str, Any], kv: bool, **env: Any) -> Dict[str, Any]:
    name = f"kvt_sgfam_{key.replace('-', '_')}_{os.getpid()}"
    if kv:
        cfg = dict(cfg, record_name=name, report=str(work / f"{key}.report.json"))
    cfg_path, out_path, log_path = (str(work / f"{key}.{x}") for x in ("cfg.json", "out.json", "log"))
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    with open(log_path, "w") as log:
        rc = subprocess.run(
            [sys.executable, DRIVER, cfg_path, out_path],
            env=_env(kv, name, **env),
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=900,
            cwd=str(work),
        ).returncode
    text = open(log_path, errors="replace").read()
    if cfg.get("expect_failure"):
        assert rc != 0, f"{key} started"
        return {"log": text, "record_name": name}
    if rc != 0 or not os.path.exists(out_path):
        pytest.fail(f"{key} failed (rc={rc}); log tail:\n{text[-6000:]}")
    res = json.load(open(out_path))
    res["log"] = text
    res["record_name"] = name
    return res


@pytest.fixture(scope="module", params=sorted(CASES))
def runs(request, tmp_path_factory):
    family = request.param
    spec = WORKLOADS[family]
    work = tmp_path_factory.mktemp(f"family_{family}")
    cfg = dict(spec, model=_model(tmp_path_factory.getbasetemp(), CASES[family].builder), page_size=1)
    env = dict(path=HYBRID_PATH) if "engine" in spec else {}
    native = _run(work, f"{family}-native", cfg, False, **env)
    kv = _run(work, f"{family}-kvcached", cfg, True, **env)
    return family, native, kv


def test_greedy_tokens_identical_with_prefix_caching_and_retraction(runs) -> None:
    family, native, kv = runs
    a_new = WORKLOADS[family]["a_new"]
    assert len(kv["tokens1"]) == 8 and max(len(t) for t in kv["tokens1"]) == a_new, family
    assert kv["tokens1"] == native["tokens1"], family
    assert kv["tokens2"] == native["tokens2"], family
    if not WORKLOADS[family].get("multi_turn"):  # pass 2 repeated pass 1's prompts
        assert native["tokens2"] == [t[:16] for t in native["tokens1"]], family
    assert kv.get("tokensL") == native.get("tokensL"), family
    assert kv["max_total_num_tokens"] == native["max_total_num_tokens"] == WORKLOADS[family]["max_total_tokens"]
    for run in (native, kv):
        # Running requests were retracted (their KV freed and recomputed later) ...
        assert any(r in run["log"] for r in RETRACTED), family
        # ... prefixes cached in pass 1 were found again in pass 2 (beyond the shared BOS),
        # and others were evicted from the small pool meanwhile.
        assert max(run["cached2"]) >= 40 and min(run["cached2"]) < 40, (family, run["cached2"])


def test_kvcached_backs_the_pool_and_pages_follow_the_load(runs) -> None:
    family, _, kv = runs
    rep = kv["report"]
    assert rep["allocator_class"] == "ElasticTokenToKVPoolAllocator", rep["allocator_class"]
    pool, *state = sorted(rep["pools"], key=lambda p: p["group_id"])
    assert pool["pool_class"] == "ElasticMHATokenToKVPool", pool["pool_class"]
    if "engine" in WORKLOADS[family]:  # a hybrid: the state pool is elastic too, with its own record
        assert rep["pool_class"] == "HybridLinearKVPool", rep["pool_class"]
        ((state,),) = (state,)
        assert state["pool_class"] == "ElasticMambaPool" and state["record"]["name"] == f"{kv['record_name']}_g1"
        # Each running request held a slot, and slots were mapped as they were taken
        # (4 slots of 1 KiB a 4 KiB page; 48 slots at most: 12 pages).
        assert kv["peak_state_mapped"] >= 3 * state["bytes_per_page"], kv["peak_state_mapped"]
        assert state["record"]["used"] <= state["record"]["limit"]
    else:
        assert rep["pool_class"] == "ElasticMHATokenToKVPool" and not state, rep
    if family == "llama-fp8":
        assert pool["row_bytes"] == 2 * 32  # 2 KV heads x head_dim 32 x 1 byte: fp8 cells
    # Pages mapped as the load grew (seen from outside, in the instance's record),
    # never beyond what the record allows.
    assert kv["peak_mapped"] > kv["record_start"]["used"] + 4 * pool["bytes_per_page"], family
    assert kv["record_end"]["used"] <= kv["record_end"]["limit"]


def test_long_decode_crosses_many_pages(runs) -> None:
    family, native, kv = runs
    if not WORKLOADS[family].get("long"):
        pytest.skip(f"{family}: no long workload")
    assert [len(t) for t in kv["tokensL"]] == [2000]
    pool = min(kv["report"]["pools"], key=lambda p: p["group_id"])  # the attention KV
    tokens_per_page = pool["kv_page_bytes"] // pool["row_bytes"]
    assert 2030 // tokens_per_page >= 20, tokens_per_page  # the request alone spans 20+ kvcached pages
    assert len(set(kv["tokensL"][0][-500:])) > 1  # not one token repeated: the late tokens carry signal


def test_a_mamba_hybrid_engine_builds_its_state_and_kv_pools_elastic(tmp_path_factory) -> None:
    """Qwen3-Next on the real engine (start-up only, see the module doc): SGLang's
    ``HybridReqToTokenPool`` builds kvcached's state pool and slot allocator, the
    configurator kvcached's attention pool inside ``HybridLinearKVPool`` and kvcached's
    token allocator over it; SGLang sized the state pool (``max_mamba_cache_size``) and
    the attention pool from kvcached's budget. Group 0 (the record named
    ``KVCACHED_IPC_NAME``) is the attention KV, the state's record is ``<name>_g1``."""
    work = tmp_path_factory.mktemp("family_qwen3_next")
    cfg = dict(QWEN3_NEXT, model=_model(tmp_path_factory.getbasetemp(), "qwen3_next", sglang=True))
    kv = _run(work, "qwen3-next-kvcached", cfg, True, kv_page=HYBRID_PAGE, path=HYBRID_PATH)
    rep, name = kv["report"], kv["record_name"]
    assert (rep["pool_class"], rep["allocator_class"]) == ("HybridLinearKVPool", "ElasticTokenToKVPoolAllocator")
    attn, state = sorted(rep["pools"], key=lambda p: p["group_id"])
    assert (attn["pool_class"], attn["record"]["name"]) == ("ElasticMHATokenToKVPool", name)
    assert (state["pool_class"], state["record"]["name"]) == ("ElasticMambaPool", f"{name}_g1")
    assert attn["num_blocks"] == 2001 and rep["max_total_num_tokens"] == 2000
    # 48 state slots and SGLang's dummy slot 0, one 256 KiB page each (a slot: both GDN
    # layers' conv and temporal state, ~137 KiB); only the dummy slot's page is live.
    assert state["num_blocks"] == 49 and state["row_bytes"] == HYBRID_PAGE == state["kv_page_bytes"]
    assert state["logical_free_blocks"] == 48 and state["stats"]["inuse_pages"] == 1


def test_a_mamba_state_slot_larger_than_the_page_stops_start_up_with_one_line(tmp_path_factory) -> None:
    work = tmp_path_factory.mktemp("family_qwen3_next_small_page")
    cfg = dict(QWEN3_NEXT, model=_model(tmp_path_factory.getbasetemp(), "qwen3_next", sglang=True), expect_failure=True)
    kv = _run(work, "qwen3-next-small-page", cfg, True, kv_page=KV_PAGE, path=HYBRID_PATH)
    line = next((ln for ln in kv["log"].splitlines() if "one Mamba slot holds" in ln), None)
    assert line is not None, kv["log"][-4000:]
    need = re.search(r"raise KVCACHED_PAGE_SIZE to at least (\d+)", line)
    assert need and int(need.group(1)) > KV_PAGE and "more than the kvcached page (4096 bytes)" in line, line
