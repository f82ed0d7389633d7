"""One SGLang engine run of a model family for the family tests (a separate process
per run: ENABLE_KVCACHED is read at interpreter start).

    python sglang_family_driver.py CONFIG.json OUT.json

CONFIG: {"model": path, "page_size": int, "max_total_tokens": int,
         "kv_cache_dtype": "auto"|"fp8_e4m3", "a_new": tokens, "long": tokens (0: none),
         "long_prompts": int, "record_name": str and "report": path (kvcached runs),
         "engine": extra sglang.Engine kwargs, "start_only": start, report, stop,
         "multi_turn": pass 2 continues pass 1's requests instead of repeating their prompts}

Prefix caching (SGLang's radix cache) is on and ``--max-total-tokens`` is the same in
both runs, small enough that workload A (8 requests decoding past what the pool
holds together) makes SGLang retract running requests: A's requests may stop at EOS
(``ignore_eos`` off), so SGLang admits by its decaying estimate of the tokens still to
come and over-commits (with ``ignore_eos`` it reserves every request's whole budget
and never has to retract). Workload A runs twice
(pass 2, ``PASS2_NEW`` tokens each: prefix-cache hits); workload L (``long``) decodes that many tokens per
request. Greedy tokens, cached tokens and (kvcached runs) the instance's record,
sampled while generating, go to OUT.json; the engine's warnings (retractions) go
to stdout, which the caller keeps.

Spawned SGLang processes re-import this file: everything runs under __main__.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

A_PROMPTS = 8
PASS2_NEW = 16


def a_prompts(tag: str) -> List[str]:
    # 40-49 words: every prompt spans whole 16-token pages (prefix-cache entries at any page size).
    return [" ".join(f"w{(7 * i + 3 * j) % 400}" for j in range(40 + i)) + f" {tag}" for i in range(A_PROMPTS)]


def long_prompts(n: int) -> List[str]:
    return [" ".join(f"w{(11 * i + 5 * j + 1) % 400}" for j in range(30)) for i in range(n)]


def next_turn(model: str, prompts: List[str], outputs: List[List[int]]) -> List[List[int]]:
    """Token ids of each prompt, its output, then one more word."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    more = tok("w7", add_special_tokens=False)["input_ids"]
    return [tok(p)["input_ids"] + list(o) + more for p, o in zip(prompts, outputs)]


def main() -> int:
    from engine_driver import Sampler  # noqa: E402  (the tests' folder is on sys.path)

    cfg = json.load(open(sys.argv[1]))
    out_path = sys.argv[2]
    kw: Dict[str, Any] = dict(
        device="cpu",
        attention_backend="torch_native",
        sampling_backend="pytorch",
        disable_cuda_graph=True,
        page_size=cfg["page_size"],
        max_total_tokens=cfg["max_total_tokens"],
        kv_cache_dtype=cfg.get("kv_cache_dtype", "auto"),
        # The checkpoints' own float32 ("auto" would run float16): a retracted request's
        # KV is recomputed by a prefill, and in half precision that differs from the
        # decode's enough to flip a near-tie of the tiny models, when the two runs
        # retract at different steps (arrival order): not a KV cache difference.
        dtype="float32",
        log_level="warning",
        random_seed=0,
        **cfg.get("engine", {}),
    )
    import sglang

    res: Dict[str, Any] = {"config": cfg}
    t0 = time.monotonic()
    engine = sglang.Engine(model_path=cfg["model"], **kw)
    res["start_s"] = round(time.monotonic() - t0, 1)
    name = cfg.get("record_name")

    from kvcached.limits import read_record

    def record():
        return read_record(name)

    def mapped() -> int:
        return record().mapped

    try:
        info = engine.get_server_info()
        state = (info.get("internal_states") or [{}])[0]
        res["max_total_num_tokens"] = info.get("max_total_num_tokens") or state.get("max_total_num_tokens")
        if name:
            res["record_start"] = dataclasses.asdict(record())
        sampler = Sampler(mapped if name else (lambda: 0))
        # A hybrid's state pool (group 1, when there is one) has its own record.
        state = Sampler((lambda: read_record(f"{name}_g1").mapped) if name else (lambda: 0))
        if not cfg.get("start_only"):
            with sampler, state:
                run_workloads(engine, cfg, res)
        if name:
            res["peak_mapped"] = sampler.peak
            res["peak_state_mapped"] = state.peak
            res["record_end"] = dataclasses.asdict(record())
            engine.collective_rpc("kvcached_report", path=cfg["report"])
            with open(cfg["report"]) as f:
                res["report"] = json.load(f)
    finally:
        engine.shutdown()
    with open(out_path, "w") as f:
        json.dump(res, f)
    return 0


def run_workloads(engine: Any, cfg: Dict[str, Any], res: Dict[str, Any]) -> None:
    """Workload A twice (prefix-cache hits in pass 2), then workload L."""
    sp = {"temperature": 0.0, "max_new_tokens": cfg["a_new"], "ignore_eos": False}
    prompts = a_prompts("a")
    outs = engine.generate(prompt=prompts, sampling_params=sp)
    res["tokens1"] = [o["output_ids"] for o in outs]
    res["cached1"] = [o["meta_info"].get("cached_tokens") for o in outs]
    # Pass 2 only has to find the prefixes again: a few tokens each are enough.
    sp2 = dict(sp, max_new_tokens=PASS2_NEW)
    if cfg.get("multi_turn"):
        # A hybrid's radix cache keeps a request's recurrent state only where the
        # request ended (no per-chunk snapshots on a CPU): the next turn continues it.
        outs = engine.generate(input_ids=next_turn(cfg["model"], prompts, res["tokens1"]), sampling_params=sp2)
    else:
        outs = engine.generate(prompt=prompts, sampling_params=sp2)
    res["tokens2"] = [o["output_ids"] for o in outs]
    res["cached2"] = [o["meta_info"].get("cached_tokens") for o in outs]
    if cfg.get("long"):
        spl = {"temperature": 0.0, "max_new_tokens": cfg["long"], "ignore_eos": True}
        t1 = time.monotonic()
        outs = engine.generate(prompt=long_prompts(cfg.get("long_prompts", 2)), sampling_params=spl)
        res["long_s"] = round(time.monotonic() - t1, 1)
        res["tokensL"] = [o["output_ids"] for o in outs]


if __name__ == "__main__":
    sys.exit(main())
