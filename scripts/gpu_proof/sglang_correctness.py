"""Greedy tokens of SGLang with kvcached equal SGLang's own (issue 28, step 1).

    python scripts/gpu_proof/sglang_correctness.py --model DIR --out DIR [--prompts 200]
        [--page-size 1] [--kv 22G] [--limit 6G] [--only LABELS] [--cpu]

Servers run side by side on one device, each ``python -m sglang.launch_server`` unchanged
(SGLang's defaults: CUDA graphs, the overlap scheduler, the radix cache, the default
attention backend), with the same KV capacity (``--max-total-tokens``):

* ``native``, ``kvcached`` and ``native-2`` (the control: how far two native runs differ);
* ``native-det``, ``kvcached-limit`` and ``native-small``: SGLang's deterministic inference
  (batch-invariant kernels: a sequence's numbers do not depend on what else is in the
  batch) and a ``kvctl limit`` of ``--limit`` on the kvcached server, so that retraction
  and radix eviction run all the time: the release-fence test. ``native-small`` is native
  with a pool of the limit's size: how far native differs from itself under that pressure.

Every server gets all prompts in one ``/generate`` request (SGLang queues a pre-tokenized
batch as one message, so the first step sees all of them on every server). Prompts: groups
sharing prefixes, outputs up to past 2,000 tokens (``correctness.make_prompts``). Prints one
row per pair and exits 1 when a pair that decides differs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import GIB, kv_token_bytes, kvctl, log, start_sglang_server, write_json  # noqa: E402
from correctness import compare, make_prompts  # noqa: E402

from kvcached.testing import sglang_server as ss  # noqa: E402
from kvcached.units import parse_size  # noqa: E402

#          label            kvcached  deterministic  limited  small pool
ENGINES = [
    ("native", False, False, False, False),
    ("kvcached", True, False, False, False),
    ("native-2", False, False, False, False),
    ("native-det", False, True, False, False),
    ("kvcached-limit", True, True, True, False),
    ("native-small", False, True, False, True),
]
# (reference, run): the pairs that decide; under a limit the kvcached run is held against
# deterministic native, and native-small says how far native moves under the same pressure.
PAIRS = (
    ("native", "kvcached"),
    ("native", "native-2"),
    ("native-det", "kvcached-limit"),
    ("native-det", "native-small"),
)
DECIDING = {("native", "kvcached"), ("native-det", "kvcached-limit")}


def kv_dtype_bytes(extra: List[str], cpu: bool) -> int:
    """Bytes of one KV element with ``extra``'s ``--kv-cache-dtype`` (FP8: 1), else the model's dtype."""
    for i, arg in enumerate(extra):
        value = arg.split("=", 1)[1] if arg.startswith("--kv-cache-dtype=") else None
        if arg == "--kv-cache-dtype" and i + 1 < len(extra):
            value = extra[i + 1]
        if value and value.startswith("fp8"):
            return 1
    return 4 if cpu else 2


def start_all(a: argparse.Namespace, engines: List[tuple], kv: int, limit: str, tag: int) -> Dict[str, ss.Server]:
    """Every server of ``engines``, side by side; returns them by label (started, not yet healthy)."""
    model_bytes = 4 if a.cpu else 2
    per_token = kv_token_bytes(a.model, model_bytes)
    # --kv counts model-dtype bytes, the limit KV bytes as kvcached maps them: with an FP8 KV
    # cache native-small gets as many tokens as the limit holds, not half (or a quarter) of them.
    small_bytes = parse_size(limit) * model_bytes // kv_dtype_bytes(a.extra, a.cpu)
    servers: Dict[str, ss.Server] = {}
    for label, kvc, det, limited, small in engines:
        size = small_bytes if small else kv
        extra = {"KVCACHED_ALLOW_UNSUPPORTED": "1"} if kvc and a.allow_unsupported else {}
        # SGLang's CPU backend has no deterministic mode; float32 there is batch-stable enough for the dry run.
        det = det and not a.cpu
        args = ["--page-size", str(a.page_size), *(["--enable-deterministic-inference"] if det else []), *a.extra]
        servers[label] = start_sglang_server(
            a.model, f"proof_{label}_{tag}", kvc, a.out, cpu=a.cpu, kv_bytes=size,
            max_model_len=a.max_model_len, extra_args=args, **extra,
        )  # fmt: skip
        log(f"started {label} (kvcached={kvc}, deterministic={det}, {size // per_token} tokens, limited={limited})")
    return servers


def generate_all(
    servers: Dict[str, ss.Server], prompts: List[List[int]], outs: List[int], timeout: float
) -> Tuple[Dict[str, Dict[str, Any]], Dict[str, str]]:
    """Every server generates every prompt at once (one thread each): results and errors by label."""
    res: Dict[str, Dict[str, Any]] = {}
    errors: Dict[str, str] = {}

    def run(label: str) -> None:
        srv, t = servers[label], time.monotonic()
        try:
            tokens, cached = ss.generate(srv, prompts, outs, timeout=timeout)
            retracted = ss.metrics(srv).get("sglang:num_retracted_requests_total", 0.0)
            res[label] = {"tokens": tokens, "cached": cached, "seconds": time.monotonic() - t, "retracted": retracted}
        except Exception as e:  # reported with the server's log
            errors[label] = f"{type(e).__name__}: {e}"

    threads = [threading.Thread(target=run, args=(label,)) for label in servers]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return res, errors


def print_pairs(res: Dict[str, Dict[str, Any]], prompts: List[List[int]]) -> int:
    """One row per pair that ran; 1 when a deciding pair differs."""
    print(f"{'pair':<30} {'differ':>7} {'retract':>8} {'prefix hit':>11} {'gen s':>7}  detail")
    rc = 0
    prompt_tokens = sum(len(p) for p in prompts)
    for x, y in PAIRS:
        if x not in res or y not in res:
            continue
        n, where = compare(res[x]["tokens"], res[y]["tokens"])
        rx, ry = res[x], res[y]
        mapped = ""
        if "peak_mapped" in ry:
            mapped = f"; kvcached peak mapped {ry['peak_mapped'] >> 20} MiB, limit {ry['limit'] >> 20} MiB"
        print(
            f"{x + ' vs ' + y:<30} {n:>7} {ry['retracted']:>8.0f} {sum(ry['cached']) / prompt_tokens:>10.1%} "
            f"{ry['seconds']:>7.1f}  {where or 'identical'} ({x}: {rx['seconds']:.1f} s, retracted "
            f"{rx['retracted']:.0f}, prefix hit {sum(rx['cached']) / prompt_tokens:.1%}{mapped})"
        )
        if (x, y) in DECIDING:
            rc |= n != 0
    return rc


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True, help="folder for tokens, counters and server logs")
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--page-size", type=int, default=1)
    ap.add_argument("--kv", default=None, help="KV capacity of every server (default 22G; --cpu 16M)")
    ap.add_argument("--limit", default=None, help="kvctl limit of kvcached-limit (default 6G; --cpu 2M)")
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--only", default="native,kvcached,native-2", help="comma list of servers to run")
    ap.add_argument("--cpu", action="store_true", help="dry run on SGLang's CPU path with the tiny model")
    ap.add_argument(
        "--allow-unsupported", action="store_true", help="KVCACHED_ALLOW_UNSUPPORTED=1 for kvcached servers"
    )
    ap.add_argument("--timeout", type=float, default=1800, help="seconds for a server's whole batch")
    ap.add_argument("extra", nargs="*", help="more launch_server arguments for every server (after --)")
    a = ap.parse_args(argv)
    a.max_model_len = a.max_model_len or (512 if a.cpu else 4096)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    prompts, outs = make_prompts(a.prompts, vocab, a.cpu)
    kv = parse_size(a.kv or ("16M" if a.cpu else "22G"))
    limit = a.limit or ("2M" if a.cpu else "6G")
    engines = [e for e in ENGINES if e[0] in set(a.only.split(","))]
    tag = os.getpid()
    t0 = time.monotonic()
    servers = start_all(a, engines, kv, limit, tag)
    errors: Dict[str, str] = {}
    try:
        for srv in servers.values():
            ss.wait_healthy(srv, timeout=900 - (time.monotonic() - t0))
        log(f"all healthy after {time.monotonic() - t0:.0f} s")
        for label, *_, limited, _small in engines:
            if limited:
                kvctl("limit", f"proof_{label}_{tag}", limit)
                log(f"kvctl limit proof_{label}_{tag} {limit}")
        names = {e[0]: f"proof_{e[0]}_{tag}" for e in engines if e[1]}
        from kvcached.testing.record_sampler import RecordSampler

        sampler = RecordSampler(list(names.values()), period=0.05)
        sampler.start()
        try:
            res, errors = generate_all(servers, prompts, outs, a.timeout)
        finally:
            sampler.stop()
        for label, name in names.items():
            if label in res:
                pts = sampler.series[name]
                res[label]["peak_mapped"] = sampler.peak(name)
                res[label]["limit"] = pts[-1].limit if pts else 0
        for label, err in errors.items():
            log(f"{label} failed: {err}\n{servers[label].log_tail(40)}")
        write_json(os.path.join(a.out, "results.json"), res)
    finally:
        for srv in servers.values():
            srv.stop(timeout=30)
    if errors:
        return 1
    limited = any(e[3] for e in engines)
    print(
        f"\n{len(prompts)} prompts ({len(prompts) // 8 or 1} shared prefixes), {sum(outs)} output tokens, longest "
        f"{max(outs)}; page size {a.page_size}; KV {kv / GIB:.2f} GiB each" + (f", limit {limit}" if limited else "")
    )
    return print_pairs(res, prompts)


if __name__ == "__main__":
    sys.exit(main())
