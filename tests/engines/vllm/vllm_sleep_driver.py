"""vLLM's sleep and wake on a real engine with kvcached (a subprocess, as every driver).

    python vllm_sleep_driver.py MODEL_DIR OUT_JSON --name NAME

Greedy tokens, then ``LLM.sleep(level=1)`` (the EngineCore pauses, resets the prefix
cache and calls its executor's sleep: the CPU worker's own sleep does nothing, kvcached
gives every KV page back), a ``kvctl limit`` written while asleep, ``wake_up(["weights"])``
(the KV cache stays asleep), ``wake_up(["kv_cache"])``, the same tokens again; then a
level-2 sleep and a plain ``wake_up()``. The record of the instance is read at each
step; everything goes to OUT_JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import vllm_engine_helpers as h  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--name", required=True)
    a = ap.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvcached.control import set_instance_memory_limit

    llm = LLM(model=a.model, dtype="float32", max_model_len=256, max_num_seqs=8, enforce_eager=True, seed=0)
    sp = SamplingParams(temperature=0, max_tokens=h.MAX_TOKENS, ignore_eos=True)
    workload = [TokensPrompt(prompt_token_ids=p) for p in h.prompts(8)]

    def tokens() -> list:
        return [list(o.outputs[0].token_ids) for o in llm.generate(workload, sp, use_tqdm=False)]

    def record() -> dict:
        time.sleep(0.2)  # the owner's watcher publishes usage after each change
        return h.read_record(a.name) or {}

    res: dict = {"tokens_before": tokens()}
    res["awake"] = record()  # the prefix cache holds the workload's blocks

    t0 = time.monotonic()
    llm.sleep(level=1)
    res["sleep_s"] = time.monotonic() - t0
    res["is_sleeping"] = bool(llm.llm_engine.is_sleeping())
    res["asleep"] = record()
    limit = res["awake"]["limit"]
    r = set_instance_memory_limit(limit // 2, name=a.name, wait_s=5.0)  # kvctl limit while asleep
    res["limit_while_asleep"] = {"status": r["status"], "record": record()}

    llm.wake_up(tags=["weights"])
    res["weights_awake"] = {"is_sleeping": bool(llm.llm_engine.is_sleeping()), "record": record()}
    t0 = time.monotonic()
    llm.wake_up(tags=["kv_cache"])
    res["wake_s"] = time.monotonic() - t0
    res["kv_awake"] = {"is_sleeping": bool(llm.llm_engine.is_sleeping()), "record": record()}
    res["tokens_after"] = tokens()
    res["after_wake"] = record()

    llm.sleep(level=2)
    res["asleep2"] = record()
    llm.wake_up()
    res["tokens_after2"] = tokens()
    with open(a.out, "w") as f:
        json.dump(res, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
