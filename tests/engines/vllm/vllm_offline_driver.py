"""One offline vLLM run for the engine tests (a subprocess: ENABLE_KVCACHED is
read at interpreter start, so kvcached and native runs are separate processes).

    python vllm_offline_driver.py MODEL_DIR OUT_JSON [--name NAME] [--native]

Pass 1 generates the workload (greedy, fixed length) while the instance's
record and the worker's kvcached memfds are sampled; pass 2 repeats it (prefix
hits); then the prefix cache is reset. Everything measured goes to OUT_JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import vllm_engine_helpers as h  # noqa: E402

N_PROMPTS = 12


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--name", default="")
    ap.add_argument("--native", action="store_true", help="no kvcached: explicit 64 MiB KV cache")
    a = ap.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = {"kv_cache_memory_bytes": 64 << 20} if a.native else {}  # kvcached: capacity from the budget
    t0 = time.monotonic()
    llm = LLM(
        model=a.model,
        dtype="float32",
        max_model_len=256,
        max_num_seqs=8,
        enforce_eager=True,
        seed=0,
        disable_log_stats=False,
        **kwargs,
    )
    start_s = time.monotonic() - t0
    sp = SamplingParams(temperature=0, max_tokens=h.MAX_TOKENS, ignore_eos=True)
    workload = [TokensPrompt(prompt_token_ids=p) for p in h.prompts(N_PROMPTS)]
    res: dict = {"engine_start_s": start_s}

    sampler = h.Sampler([a.name]) if a.name else None
    if sampler:
        time.sleep(0.3)
        res["before"] = sampler.sample()
        sampler.__enter__()
    outs = llm.generate(workload, sp, use_tqdm=False)
    if sampler:
        sampler.__exit__()
        res["during"] = sampler.samples
        time.sleep(0.3)
        res["after_pass1"] = sampler.sample()
    res["tokens1"] = [list(o.outputs[0].token_ids) for o in outs]
    res["cached1"] = [o.num_cached_tokens for o in outs]

    outs = llm.generate(workload, sp, use_tqdm=False)
    res["tokens2"] = [list(o.outputs[0].token_ids) for o in outs]
    res["cached2"] = [o.num_cached_tokens for o in outs]
    res["metrics"] = h.engine_counters(llm)

    # Workload B: short prompts that grow a second block while decoding (the
    # capped-server test compares its preempted runs with these tokens).
    spb = SamplingParams(temperature=0, max_tokens=h.LONG_DECODE, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in h.decode_prompts()], spb, use_tqdm=False)
    res["tokensB"] = [list(o.outputs[0].token_ids) for o in outs]

    # Workload C: groups sharing a prefix block (prefix eviction under a small limit)
    # and D: long decodes of short prompts (a limit lowered while decoding).
    spc = SamplingParams(temperature=0, max_tokens=h.PREFIX_DECODE, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in h.shared_prefix_prompts()], spc, use_tqdm=False)
    res["tokensC"] = [list(o.outputs[0].token_ids) for o in outs]
    spd = SamplingParams(temperature=0, max_tokens=h.GROW_DECODE, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in h.grow_prompts()], spd, use_tqdm=False)
    res["tokensD"] = [list(o.outputs[0].token_ids) for o in outs]

    res["reset"] = bool(llm.reset_prefix_cache())
    if sampler:
        time.sleep(0.3)
        res["after_reset"] = sampler.sample()
    with open(a.out, "w") as f:
        json.dump(res, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
