"""What the engine did during one benchmark run, from vLLM's own /metrics read
before and after it: how many steps, how many tokens each, how long each took,
how long requests took to reach it and queued, how often they were preempted.

It splits a throughput or latency difference between two servers into the two
causes that look alike from the client: a slower step (same tokens per step,
more ms per step: a cost on the step's path, e.g. page mapping) or a different
schedule (more or fewer tokens per step, other queueing: prefill and decode
split differently). vLLM observes ``vllm:iteration_tokens_total`` once per
engine step that returned tokens (prompt tokens computed + tokens generated;
a step of prefill chunks only, none of whose prompts finished, is not seen).
"""

from __future__ import annotations

import urllib.request
from typing import Dict, Optional

# The counters and histogram parts read, summed over their labels.
SERIES = (
    "vllm:iteration_tokens_total_count",
    "vllm:iteration_tokens_total_sum",
    "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_queue_time_seconds_count",
    "vllm:request_prefill_time_seconds_sum",
    "vllm:request_decode_time_seconds_sum",
    "vllm:request_success_total",
)

# (key, header, format) of what view() derives, in table order.
COLUMNS = (
    ("steps", "steps", "{:.0f}"),
    ("tokens_per_step", "tok/step", "{:.1f}"),
    ("ms_per_step", "ms/step", "{:.2f}"),
    ("preemptions", "preempt", "{:.0f}"),
    ("front_ms", "front ms", "{:.1f}"),
    ("queue_ms", "queue ms", "{:.1f}"),
    ("prefill_ms", "prefill ms", "{:.1f}"),
    ("decode_ms", "decode ms", "{:.1f}"),
)


def scrape(port: int) -> Dict[str, float]:
    """The SERIES of the server on ``port``, each summed over its labels."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    out = dict.fromkeys(SERIES, 0.0)
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in out:
                out[s.name] += s.value
    return out


def view(
    before: Dict[str, float], after: Dict[str, float], duration_s: float, mean_ttft_s: Optional[float] = None
) -> Dict[str, float]:
    """The run between two scrapes, ``duration_s`` long (the benchmark's own duration).
    With the client's mean time to first token, ``front_ms`` is the part of it before the
    engine queued the request (API server, tokenization, transport): the mean TTFT less
    the engine's mean queue and prefill time of the same requests."""
    d = {k: after[k] - before[k] for k in SERIES}
    steps = d["vllm:iteration_tokens_total_count"]
    done = d["vllm:request_success_total"] or float("nan")
    queue_ms = 1e3 * d["vllm:request_queue_time_seconds_sum"] / (d["vllm:request_queue_time_seconds_count"] or 1)
    prefill_ms = 1e3 * d["vllm:request_prefill_time_seconds_sum"] / done
    return {
        "steps": steps,
        "tokens_per_step": d["vllm:iteration_tokens_total_sum"] / steps if steps else float("nan"),
        # The engine is busy for the whole run at saturation; below it, idle gaps count too.
        "ms_per_step": 1e3 * duration_s / steps if steps else float("nan"),
        "preemptions": d["vllm:num_preemptions_total"],
        "front_ms": float("nan") if mean_ttft_s is None else 1e3 * mean_ttft_s - queue_ms - prefill_ms,
        "queue_ms": queue_ms,
        "prefill_ms": prefill_ms,
        "decode_ms": 1e3 * d["vllm:request_decode_time_seconds_sum"] / done,
        "prompt_tokens": d["vllm:prompt_tokens_total"],
        "generation_tokens": d["vllm:generation_tokens_total"],
    }
