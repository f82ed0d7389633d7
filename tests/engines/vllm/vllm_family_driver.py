"""One offline vLLM run of a model family for the engine tests (a subprocess:
ENABLE_KVCACHED is read at interpreter start, so kvcached and native runs are
separate processes).

    python vllm_family_driver.py MODEL_DIR OUT_JSON --blocks N [--kv-cache-dtype fp8] [--dtype bfloat16]
                                 [--long TOKENS] [--no-hybrid] [--name NAME]

Prefix caching is on and the pool has ``--blocks`` blocks (``num_gpu_blocks_override``,
the same in both runs), few enough that the workload must preempt. Workload A (8
distinct prompts) runs twice (pass 2: prefix hits); workload L (``--long``: ``--long-prompts``
prompts decoding that many tokens each) crosses many blocks. Tokens, preemptions, prefix
hits and (with ``--name``) the kvcached record sampled during the run go to OUT_JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import vllm_engine_helpers as h  # noqa: E402

A_PROMPTS = 8
# 131-token prompts (one full block of 128: a prefix-cache entry) that decode past
# token 256: every running request needs a third block while decoding, so a small
# pool makes vLLM preempt running requests (a short pool alone only delays admission).
A_PROMPT_LEN = 130
A_TOKENS = 140


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--name", default="")
    ap.add_argument("--blocks", type=int, required=True)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--dtype", default="float32", help="bfloat16 for models whose CPU kernels take no other")
    ap.add_argument("--long", type=int, default=0)
    ap.add_argument("--long-prompts", type=int, default=2)
    ap.add_argument(
        "--mamba-ssm-cache-dtype", default="auto", help="float32: vLLM 0.26-0.28's CPU gated-delta rule wants it"
    )
    ap.add_argument("--no-hybrid", action="store_true", help="disable_hybrid_kv_cache_manager: one group")
    a = ap.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.monotonic()
    llm = LLM(
        model=a.model,
        dtype=a.dtype,
        max_model_len=max(512, a.long + 256),
        max_num_seqs=8,
        enforce_eager=True,
        seed=0,
        enable_prefix_caching=True,
        num_gpu_blocks_override=a.blocks,
        # The pool is num_gpu_blocks_override blocks either way; vLLM's CPU worker only
        # checks at start-up that this share of the machine's memory is free (0.92 by
        # default: a start-up error whenever anything else holds 1.5 GiB).
        gpu_memory_utilization=0.5,
        kv_cache_dtype=a.kv_cache_dtype,
        mamba_ssm_cache_dtype=a.mamba_ssm_cache_dtype,
        disable_log_stats=False,
        **({"disable_hybrid_kv_cache_manager": True} if a.no_hybrid else {}),
    )
    res: dict = {"engine_start_s": time.monotonic() - t0}
    if a.name:
        res["idle_before"] = _settled(a.name)
    sampler = h.Sampler([a.name], workers=False) if a.name else None
    if sampler:
        sampler.__enter__()

    sp = SamplingParams(temperature=0, max_tokens=A_TOKENS, ignore_eos=True)
    workload = [TokensPrompt(prompt_token_ids=p) for p in h.prompts(A_PROMPTS, length=A_PROMPT_LEN, seed=11)]
    outs = llm.generate(workload, sp, use_tqdm=False)
    res["tokens1"] = [list(o.outputs[0].token_ids) for o in outs]
    res["cached1"] = [o.num_cached_tokens for o in outs]
    # Pass 2 newest first: the small pool keeps only the last requests' blocks cached.
    outs = llm.generate(workload[::-1], sp, use_tqdm=False)[::-1]
    res["tokens2"] = [list(o.outputs[0].token_ids) for o in outs]
    res["cached2"] = [o.num_cached_tokens for o in outs]
    res["metrics_a"] = h.engine_counters(llm)

    if a.long:
        spl = SamplingParams(temperature=0, max_tokens=a.long, ignore_eos=True)
        t1 = time.monotonic()
        long_prompts = [TokensPrompt(prompt_token_ids=p) for p in h.prompts(a.long_prompts, length=100, seed=12)]
        outs = llm.generate(long_prompts, spl, use_tqdm=False)
        res["long_s"] = time.monotonic() - t1
        res["tokensL"] = [list(o.outputs[0].token_ids) for o in outs]
    res["metrics"] = h.engine_counters(llm)
    if sampler:
        sampler.__exit__()
        res["samples"] = [s[a.name] for s in sampler.samples if s.get(a.name)]
        res["idle_after"] = _settled(a.name)
    with open(a.out, "w") as f:
        json.dump(res, f)
    return 0


def _settled(name: str) -> dict:
    """The record's mapped bytes and the memfd bytes this engine's processes hold,
    once two looks 0.1 s apart agree (no map or unmap in between)."""
    probe = h.Sampler([name])
    last = None
    for _ in range(50):
        s = probe.sample()
        now = {"mapped": h.mapped(s[name]), "physical": s.get(name + ":worker", 0)}
        if now == last:
            break
        last = now
        time.sleep(0.1)
    return now


if __name__ == "__main__":
    sys.exit(main())
