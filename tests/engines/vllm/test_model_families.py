"""Model families other than a plain Llama on a real vLLM (CPU), with kvcached
against the same workload without it: identical greedy tokens with prefix caching
on and a pool small enough that vLLM must preempt (``vllm_family_driver.py``).

* ``llama-fp8``: the tiny Llama with ``kv_cache_dtype="fp8"`` (1-byte KV cells).
* ``gemma3``: local (sliding-window) + global layers, several KV cache groups in
  one block pool; four requests decode 2,000 tokens each, so sliding-window blocks
  leave the window (and return to the pool) many times, and the pool only fits
  both requests because they do.
* ``gemma4``: global layers of twice the local head size besides sliding-window
  layers; vLLM evens the two groups' pages out (the local group's blocks hold
  twice the tokens).
* ``gemma4-one-group``: the same model with the hybrid KV cache manager off: one
  group of full-attention layers whose blocks differ in size (64 and 128 KiB),
  one KV tensor per size.
* ``qwen3-next``: gated-delta-net (linear attention) layers beside full-attention
  layers (bfloat16: vLLM's CPU kernel takes no other; a float32 SSM state, which
  0.26's CPU kernel needs). Each request's recurrent state is a block of the
  ``MambaSpec`` group, evened out with the attention pages and drawn from the same
  pool ("align" mode under prefix caching: a state block per cached prefix block
  too). Patches ``mamba_state_shared_by_0_28`` (+ ``mamba_state_views_as_strided_0_26``)
  and ``mamba_state_0_29``.
"""

from __future__ import annotations

import os
import re

import pytest
import vllm_engine_helpers as h

from kvcached.integration import families

# The cases (and each one's model) come from the family table; here, each case's workload:
# driver args, blocks chosen so that workload A (8 requests) cannot run at once: preemption
# in both runs.
CASES = families.cases("vllm")
WORKLOADS = {
    "llama-fp8": ("--blocks", "12", "--kv-cache-dtype", "fp8"),
    "gemma3": ("--blocks", "80", "--long", "2000", "--long-prompts", "4"),
    "gemma4": ("--blocks", "40"),
    "gemma4-one-group": ("--blocks", "24", "--no-hybrid"),
    "qwen3-next": ("--blocks", "16", "--dtype", "bfloat16", "--mamba-ssm-cache-dtype", "float32"),
}

# A request recomputed after a preemption or resumed from a cached prefix rounds
# differently from one decoded token by token, and a tiny random model's top logits are
# close: its tokens depend on the schedule, in float32 too (CI saw Gemma 4's first
# sequence differ at token 82). So both runs keep the engine core in process, where
# the schedule is a function of the block count alone (out of process, when requests
# reach the scheduler is timing: CI saw 14 vs 15 preemptions); kvcached must then give
# native's schedule and native's tokens pass for pass. The worker is in the engine
# core's process either way, so kvcached's side of the run is the same.
SAME_SCHEDULE = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}

# bfloat16: a request resumed from a cached prefix (its recurrent state as of the cached
# block, then the rest) rounds differently enough that pass 2 may differ from pass 1.
PASS_2_MAY_DIFFER = {"qwen3-next"}

# A hit needs a full block of every group: hybrid Gemma 4's local group has 256-token
# blocks (pages evened out with the global group), longer than workload A's 131-token
# prompts, so neither run can hit (prefix caching stays on; tokens are still compared).
NO_FULL_BLOCK_OF_EVERY_GROUP = {"gemma4"}


def _model(workdir: str, builder: str) -> str:
    from kvcached.testing.tiny_families import build_tiny

    return build_tiny(os.path.join(workdir, f"tiny_{builder}"), builder)


def _driver(model: str, out: str, env: dict, args) -> dict:
    try:
        return h.run_driver(model, out, env, *args, script="vllm_family_driver.py")
    except AssertionError:
        with open(out + ".log", errors="replace") as f:
            if "AmbiguousGlobalPerLayerAttributeError" in f.read():
                # vLLM 0.26's Gemma 4 reads config.head_dim, which the installed transformers
                # (5.24) refuses for per-layer head sizes: the engine cannot load the model at all.
                pytest.skip("this vLLM cannot load Gemma 4 with the installed transformers (per-layer head_dim)")
        raise


@pytest.fixture(scope="module", params=sorted(CASES))
def runs(request, workdir):
    args = WORKLOADS[request.param]
    model = _model(workdir, CASES[request.param].builder)
    base = os.path.join(workdir, request.param)
    env = h.engine_env(False, **SAME_SCHEDULE)
    native = _driver(model, base + "_native.json", env, args)
    name = f"kvt_family_{request.param.replace('-', '_')}_{os.getpid()}"
    env = h.engine_env(True, name, KVCACHED_HOST_MEMORY_BUDGET="256M", **SAME_SCHEDULE)
    kv = _driver(model, base + "_kvcached.json", env, (*args, "--name", name))
    with open(base + "_kvcached.json.log", errors="replace") as f:
        kv["log"] = f.read()
    return request.param, native, kv


def test_greedy_tokens_identical_with_prefix_caching_and_preemption(runs):
    family, native, kv = runs
    assert "kvcached: instance" in kv["log"], f"{family}: kvcached did not back the pool"
    assert len(kv["tokens1"]) == 8 and all(len(t) == 140 for t in kv["tokens1"])
    # One schedule (SAME_SCHEDULE): a token that differs is then kvcached's, not timing's.
    preempted = [run["metrics"].get("vllm:num_preemptions", 0) for run in (native, kv)]
    assert preempted[0] == preempted[1], (family, "preemptions native, kvcached", preempted)
    assert kv["tokens1"] == native["tokens1"], family
    assert kv["tokens2"] == native["tokens2"], family
    if family not in PASS_2_MAY_DIFFER:
        assert native["tokens2"] == native["tokens1"], family
    assert kv.get("tokensL") == native.get("tokensL"), family
    for run in (native, kv):
        assert run["metrics"].get("vllm:num_preemptions", 0) > 0, (family, run["metrics"])
        if family not in NO_FULL_BLOCK_OF_EVERY_GROUP:
            # Prefix-cache hits (pass 2, and preempted requests finding their own blocks again).
            assert run["metrics"].get("vllm:prefix_cache_hits", 0) > 0, (family, run["metrics"])


def test_the_kv_pages_follow_the_load_within_the_limit(runs):
    family, _, kv = runs
    samples = kv["samples"]
    assert len(samples) >= 5, family
    peak = max(h.mapped(r) for r in samples)
    assert peak > samples[0]["used"], f"{family}: mapped KV never rose"
    assert all(h.mapped(r) <= r["limit"] for r in samples), family


def test_the_record_charges_what_the_worker_maps(runs):
    """At rest before and after the load, the instance's record (what the device budget
    is charged) equals the memfd bytes its worker holds, less the shared zero page.
    Gemma 4 with one group (64 and 128 KiB blocks) too: pages are cut by the smaller
    block, so no physical page is shared by two logical pages."""
    family, _, kv = runs
    before, after = kv["idle_before"], kv["idle_after"]
    zero = before["physical"] - before["mapped"]
    assert 0 <= zero <= h.PAGE, (family, before)
    assert after["mapped"] > before["mapped"], (family, after)  # cached blocks keep pages mapped
    assert after["physical"] - zero == after["mapped"], (family, before, after)


def test_blocks_that_do_not_divide_the_page_are_charged_what_the_worker_maps(workdir):
    """The GPU-shaped tiny Qwen3-Next has 384 KiB blocks: on 2 MiB pages vLLM 0.29+
    starts the second layer region mid-page (40 blocks = 7.5 pages), so a logical page
    would touch 3 physical pages where 2 is the average and be charged 3 (a 48 MiB
    limit for a 30 MiB buffer, 18 MiB charged for 14 mapped). The engine core's configs
    get page-aligned regions instead: 2 pages a logical page, charged what is mapped."""
    import vllm

    from kvcached.integration.patch_base import parse_version
    from kvcached.integration.vllm.versions import V029_034

    if parse_version(vllm.__version__) not in V029_034:
        pytest.skip("0.26-0.28 lay each KV buffer on a page boundary already (kv_tensors_shared_by_0_28)")
    from kvcached.testing.tiny_families import build_tiny

    model = build_tiny(os.path.join(workdir, "tiny_qwen3_next_gpu_shapes"), "qwen3_next", gpu_shapes=True)
    name = f"kvt_family_unaligned_{os.getpid()}"
    page = 2 << 20
    env = h.engine_env(
        True, name, KVCACHED_HOST_MEMORY_BUDGET="256M", KVCACHED_PAGE_SIZE=str(page), VLLM_ENABLE_V1_MULTIPROCESSING="0"
    )
    out = os.path.join(workdir, "qwen3_next_gpu_shapes.json")
    kv = h.run_driver(model, out, env, *WORKLOADS["qwen3-next"][2:], "--blocks", "40", "--name", name,
                      script="vllm_family_driver.py")  # fmt: skip
    with open(out + ".log", errors="replace") as f:
        log = f.read()
    assert "KV layer regions moved to 2048 KiB page boundaries (40 blocks of 393216 B" in log, log[-3000:]
    m = re.search(r"over \d+ pages of 2048 KiB x (\d+); limit ([\d.]+) MiB", log)
    assert m and m.groups() == ("2", "32.0"), m and m.group(0)  # the 32 MiB buffer, not 48
    before, after = kv["idle_before"], kv["idle_after"]
    zero = before["physical"] - before["mapped"]
    assert 0 <= zero <= page, before
    assert after["mapped"] > before["mapped"] and after["physical"] - zero == after["mapped"], (before, after)


def test_long_decodes_cross_many_blocks_with_sliding_window_blocks_returned(runs):
    family, native, kv = runs
    if "tokensL" not in native:
        pytest.skip(f"{family}: no long workload")
    assert all(len(t) == 2000 for t in kv["tokensL"])
    # 4 requests x (2,100 tokens of the global layer = 17 blocks + a 64-token window in
    # 3 local layers = at most 2 blocks each) need 92 blocks: with 80 they run, one
    # preempted meanwhile, only because window-passed blocks come back to the pool
    # (kept, each request alone would need 68).
    for run in (native, kv):
        assert run["metrics"]["vllm:num_preemptions"] > run["metrics_a"].get("vllm:num_preemptions", 0), family


def test_a_state_block_larger_than_the_page_stops_start_up_in_one_line(workdir):
    """A real Qwen3-Next's recurrent state (2 MiB a layer) makes blocks larger than the
    default page; here the tiny model's evened block (> 64 KiB) against a 64 KiB page:
    start-up stops before any request with one line naming the page size to use, never
    an empty or wrong pool."""
    model = _model(workdir, "qwen3_next")
    out = os.path.join(workdir, "qwen3_next_small_page.json")
    name = f"kvt_family_small_page_{os.getpid()}"
    env = h.engine_env(True, name, KVCACHED_HOST_MEMORY_BUDGET="256M", KVCACHED_PAGE_SIZE=str(64 << 10))
    with pytest.raises(AssertionError):
        h.run_driver(model, out, env, *WORKLOADS["qwen3-next"], "--name", name, script="vllm_family_driver.py")
    with open(out + ".log", errors="replace") as f:
        log = f.read()
    lines = [line for line in log.splitlines() if "does not fit in a page" in line]
    assert lines and "KVCACHED_PAGE_SIZE=" in lines[-1], log[-3000:]
    assert not os.path.exists(out)  # no request ran
