"""SGLang's release/resume_memory_occupation on a real engine with kvcached (its own process).

    python sleep_driver.py MODEL_DIR OUT.json RECORD_NAME

Greedy tokens (prefix cache filled); ``release_memory_occupation(["weights"])`` alone
(the KV cache stays); ``release_memory_occupation()`` (every tag: the flush frees every
block, kvcached gives every page back); ``kvctl limit`` written while released;
``resume_memory_occupation()``; the same tokens again; then ``kv_cache`` alone released
and resumed. On CPU SGLang's memory saver is its no-op adapter (torch_memory_saver is a
CUDA allocator hook), so SGLang's whole path runs and only the weights stay where they are.
The instance's record is read at every step.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from typing import Any, Dict

import engine_driver as d
import torch

if not torch.cuda.is_available():
    # SGLang's release synchronises torch.get_device_module(), which is torch.cuda with a CUDA
    # build of torch even without a GPU (it raises: no driver). A test-only stand-in, set at
    # import: SGLang's spawned scheduler re-imports this module, so it holds there too.
    torch.cuda.synchronize = lambda *a, **k: None


def main() -> int:
    model, out_path, name = sys.argv[1:4]
    import sglang

    from kvcached.control import set_instance_memory_limit
    from kvcached.limits import read_record

    engine = sglang.Engine(
        model_path=model,
        device="cpu",
        attention_backend="torch_native",
        sampling_backend="pytorch",
        disable_cuda_graph=True,
        page_size=16,
        max_total_tokens=2048,
        log_level="info",
    )
    client = d.EngineClient.__new__(d.EngineClient)
    client.engine = engine

    def record() -> Dict[str, Any]:
        time.sleep(0.3)
        return dataclasses.asdict(read_record(name))

    def tokens():
        outs = engine.generate(prompt=d.PROMPTS + [d.LONG_PROMPT], sampling_params=d.SHORT)
        return [o["output_ids"] for o in outs]

    def idle() -> None:  # SGLang asserts an idle server before a release
        assert d.flush_when_idle(client), "the engine did not turn idle"

    res: Dict[str, Any] = {"tokens_before": tokens()}
    tokens()  # again: prefix hits keep the cache's pages
    res["awake"] = record()
    engine.release_memory_occupation(tags=["weights"])
    res["weights_released"] = record()
    engine.resume_memory_occupation(tags=["weights"])

    tokens()
    time.sleep(1.0)
    res["before_release"] = record()
    idle()
    t0 = time.monotonic()
    engine.release_memory_occupation()
    res["release_s"] = time.monotonic() - t0
    res["released"] = record()
    r = set_instance_memory_limit(res["awake"]["limit"] // 2, name=name, wait_s=5.0)
    res["limit_while_released"] = {"status": r["status"], "record": record()}
    t0 = time.monotonic()
    engine.resume_memory_occupation()
    res["resume_s"] = time.monotonic() - t0
    res["tokens_after"] = tokens()
    res["resumed"] = record()

    idle()
    engine.release_memory_occupation(tags=["kv_cache"])
    res["kv_released"] = record()
    engine.resume_memory_occupation(tags=["kv_cache"])
    res["tokens_after2"] = tokens()
    engine.shutdown()
    with open(out_path, "w") as f:
        json.dump(res, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
