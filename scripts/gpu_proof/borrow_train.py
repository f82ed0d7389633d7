"""Borrowing (issue 35, items 4 and 6): a PyTorch training job borrows memory from a vLLM
server between its bursts; against a static split of the same memory.

    python scripts/gpu_proof/borrow_train.py --model DIR --out DIR [--total 64G] [--borrow 40G]
        [--bursts 3] [--burst 160] [--gap 8] [--plot PNG] [--cpu]

``--total`` (M) is the memory of KV and job together, ``--borrow`` (J) what the job trains in.
Two arms, one after the other, each a vLLM server serving bursts of streamed requests (the same
prompts in both) with a training window of the job between two bursts:

- kvcached: the server's KV is virtual and M large, the device budget M (it counts every
  kvcached record of this user on the device, so nothing else may run there: checked at every
  burst). In each window the job borrows J (``kvcached.reserve``: the idle server gives its
  cached pages back), trains, empties PyTorch's cache and gives J back; the next burst grows
  the server back. On a GPU the first window reserves nothing: its steps run through
  ``torch_alloc_retry`` (item 4), which meets PyTorch's own out-of-memory error and borrows what
  it lacks, J/8 at a time; later windows reserve J up front and keep the wrapper for anything
  beyond it.
- static: native vLLM with a KV pool of M - J; the job's J is its own the whole time.

The job is a child process (``--job``): a Llama-shaped model (Llama-3.2-1B: hidden 2048, 16
layers, tied 128k vocabulary; bf16, AdamW) on random tokens, its batch sized at start so that
a step's peak is 85% of J. It trains only between bursts in both arms, so the two never compete
for compute and the comparison is about memory. On a GPU its PyTorch allocator is capped
(``set_per_process_memory_fraction``) at its base (weights and AdamW states, held outside the
budget) plus what it holds in the budget: the job never uses memory the budget gave the engine,
and an allocation past what it borrowed raises ``torch.cuda.OutOfMemoryError`` as a full device
would (the H200 itself has room beyond M).

PyTorch's caching allocator keeps what a step freed: released without ``empty_cache()`` the
budget would count J free while the job's process still holds it, so the engine growing back
would take the device past M (on a device with nothing beyond M its map calls fail: it could not
grow back). The job empties the cache before every release and reports what the cache held and
what was left.

Reports per burst TTFT p50/p99 (and, kvcached, peak mapped KV and how long after the burst's
start the server mapped more than the static pool), per window the time from the borrow call to
having the memory, retries and bytes the wrapper borrowed, the job's step time and steps, mapped
KV before and while the job held its borrow; JSON in OUT, a plot of memory over time.
Exits 1 when a request failed, another kvcached instance shared the budget, the server did not
shrink or grow back, or the job kept memory after emptying its cache.

``--cpu``: vLLM-CPU and the host budget with the tiny model (``python -m
kvcached.testing.tiny_model DIR``), sizes in MiB, the job a tiny model of the same kind on the
CPU; PyTorch has no capped CPU allocator, so no out-of-memory error is met there and every
window reserves up front.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Set, Tuple

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import GIB, budget_env, kv_token_bytes, log, percentile, start_server, wait_all, write_json  # noqa: E402
from three_models import burst  # noqa: E402

from kvcached.borrowing import reserve, torch_alloc_retry  # noqa: E402
from kvcached.limits.budget import DeviceBudget  # noqa: E402
from kvcached.testing.record_sampler import RecordSampler, Sample  # noqa: E402
from kvcached.units import format_size, parse_size  # noqa: E402

JOB_MARK = "@@borrow-job "  # the job's protocol lines on its stdout
FILL = 0.85  # a step's peak as a share of J: the rest absorbs the allocator's rounding
# Beyond M on the GPU: both engines' weights, activations and CUDA graphs, the job's weights
# and AdamW states, CUDA contexts.
GPU_OVERHEAD = 18 * GIB


# ---- the training job (a child process) ---------------------------------------------------


@dataclass
class Shape:
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    inter: int
    seq: int


LLAMA_1B = Shape(vocab=128256, hidden=2048, layers=16, heads=32, kv_heads=8, inter=8192, seq=2048)
TINY = Shape(vocab=512, hidden=64, layers=2, heads=4, kv_heads=2, inter=128, seq=128)
CPU_BATCH = 8


class Block(nn.Module):
    """One Llama decoder layer (GQA attention, SwiGLU MLP, RMSNorm; no rotary: it changes neither
    memory nor compute much). K and V are repeated for the query heads: every SDPA kernel takes
    that, so the GPU runs flash attention, never the math kernel's t x t matrices."""

    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = s.heads, s.kv_heads, s.hidden // s.heads
        self.norm1, self.norm2 = nn.RMSNorm(s.hidden), nn.RMSNorm(s.hidden)
        self.qkv = nn.Linear(s.hidden, (s.heads + 2 * s.kv_heads) * self.head_dim, bias=False)
        self.o = nn.Linear(s.hidden, s.hidden, bias=False)
        self.gate_up = nn.Linear(s.hidden, 2 * s.inter, bias=False)
        self.down = nn.Linear(s.inter, s.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        kv = self.kv_heads * self.head_dim
        q, k, v = self.qkv(self.norm1(x)).split([self.heads * self.head_dim, kv, kv], -1)
        q = q.view(b, t, self.heads, self.head_dim).transpose(1, 2)
        group = self.heads // self.kv_heads
        k = k.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2).repeat_interleave(group, 1)
        v = v.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2).repeat_interleave(group, 1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, -1))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, -1)
        return x + self.down(F.silu(gate) * up)


class LlamaShaped(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.embed = nn.Embedding(s.vocab, s.hidden)
        self.blocks = nn.ModuleList(Block(s) for _ in range(s.layers))
        self.norm = nn.RMSNorm(s.hidden)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.norm(x) @ self.embed.weight.T  # tied output head, as Llama-3.2-1B


class TrainingJob:
    """The model, its optimizer and the windows it trains in (driven by ``job_main``)."""

    def __init__(self, cfg: Dict[str, Any]) -> None:
        self.cpu: bool = cfg["cpu"]
        self.device = torch.device("cpu" if self.cpu else "cuda:0")
        self.kv_device = "cpu" if self.cpu else "cuda:0"  # the budget the job borrows from
        self.shape = Shape(**cfg["shape"])
        self.borrow: int = cfg["borrow"]
        self.name: str = cfg["name"]
        self.timeout_s: float = cfg["timeout_s"]
        # The wrapper borrows at least J/8 per error: a step needs dozens of allocations past
        # an empty cap, and each error re-runs the step from its start.
        self.granule = max(2 << 20, -(-self.borrow // 8 // (2 << 20)) * (2 << 20))
        torch.manual_seed(0)
        with self.device:
            self.model = LlamaShaped(self.shape).to(torch.float32 if self.cpu else torch.bfloat16)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=not self.cpu)
        self.step(1)  # AdamW makes its states at its first step: part of the job's base
        self.calibration: Dict[str, int] = {}
        if self.cpu:
            self.batch, self.base = CPU_BATCH, 0
        else:
            self.batch = self._calibrate()
            torch.cuda.empty_cache()
            self.base = torch.cuda.memory_reserved(self.device)
            self._cap(self.base)

    def step(self, batch: int) -> float:
        self.opt.zero_grad(set_to_none=True)  # a retried attempt starts without the failed one's gradients
        ids = torch.randint(self.shape.vocab, (batch, self.shape.seq + 1), device=self.device)
        logits = self.model(ids[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)  # between steps: weights and AdamW states only
        return loss.item()  # waits for the step

    def _calibrate(self) -> int:
        """The batch whose step peaks at FILL x J: peaks of batches 1 and 2, linear in between."""
        peaks = []
        for b in (1, 2):
            torch.cuda.reset_peak_memory_stats(self.device)
            before = torch.cuda.memory_allocated(self.device)
            self.step(b)
            peaks.append(torch.cuda.max_memory_allocated(self.device) - before)
        per_seq, fixed = peaks[1] - peaks[0], 2 * peaks[0] - peaks[1]
        self.calibration = {"per_sequence": per_seq, "fixed": fixed}
        batch = int((FILL * self.borrow - fixed) // per_seq)
        if batch < 1:
            raise ValueError(
                f"--borrow {format_size(self.borrow)} holds no step of one sequence "
                f"({format_size(fixed + per_seq)} at its peak): borrow more"
            )
        return batch

    def _cap(self, nbytes: int) -> None:
        """PyTorch's allocator may hold at most ``nbytes`` (GPU only)."""
        total = torch.cuda.get_device_properties(self.device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, nbytes / total), self.device)

    def _above_base(self) -> Optional[int]:
        return None if self.cpu else torch.cuda.memory_reserved(self.device) - self.base

    def window(self, mode: str, seconds: float) -> Dict[str, Any]:
        """Trains for ``seconds`` (at least one step). ``mode``: "learn" borrows only through the
        wrapper, "reserve" reserves J first, "static" holds J as its own (no kvcached)."""
        t_start = time.monotonic()
        events: List[Tuple[float, int, Optional[int]]] = [
            (t_start, self.borrow if mode == "static" else 0, self._above_base())
        ]
        retry = None
        if mode != "static":
            retry = torch_alloc_retry(
                self.kv_device, timeout_s=self.timeout_s, max_retries=16, granule=self.granule, name=self.name
            )
            if mode == "reserve":
                # The wrapper grows this reservation when a step needs more: one record per job.
                retry.reservation = reserve(self.borrow, self.kv_device, timeout_s=self.timeout_s, name=self.name)
        attempts = 0
        attempt_at = t_start

        def held() -> int:
            return self.borrow if retry is None else retry.nbytes

        def attempt() -> float:
            nonlocal attempts, attempt_at
            attempts += 1
            attempt_at = time.monotonic()
            if not self.cpu:
                self._cap(self.base + held())
            events.append((attempt_at, held(), self._above_base()))
            return self.step(self.batch)

        step_s: List[float] = []
        t_have = None
        try:
            while not step_s or time.monotonic() < t_start + seconds:
                t0 = time.monotonic()
                if retry is None:
                    attempt()
                else:
                    retry(attempt)
                step_s.append(time.monotonic() - t0)
                if t_have is None:
                    t_have = attempt_at  # the first attempt that ran through: the memory was there
                    step_s[-1] = time.monotonic() - attempt_at
                events.append((time.monotonic(), held(), self._above_base()))
            cached = self._above_base()
            borrowed = held()
            if retry is not None and not self.cpu:
                torch.cuda.empty_cache()  # else PyTorch keeps J while the budget counts it free
                self._cap(self.base)
            left = self._above_base()
        finally:
            if retry is not None:
                retry.release()
        t_release = time.monotonic()
        events.append((t_release, 0 if retry is not None else self.borrow, left))
        return {
            "mode": mode,
            "t_start": t_start,
            "t_have": t_have,
            "t_release": t_release,
            "borrow_s": t_have - t_start,
            "retries": attempts - len(step_s),
            "borrowed": borrowed,
            "step_s": step_s,
            "cached": cached,
            "left": left,
            "events": events,
        }


def emit(msg: Dict[str, Any]) -> None:
    print(JOB_MARK + json.dumps(msg), flush=True)


def job_main(cfg: Dict[str, Any]) -> int:
    """The job's process: builds the model, says "ready", then one window per "train" line."""
    try:
        job = TrainingJob(cfg)
        params = sum(p.numel() for p in job.model.parameters())
        emit({"event": "ready", "batch": job.batch, "seq": job.shape.seq, "base": job.base, "params": params,
              **job.calibration})  # fmt: skip
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["cmd"] == "exit":
                break
            emit({"event": "window", **job.window(cmd["mode"], cmd["seconds"])})
    except Exception as e:  # noqa: BLE001 - the parent reports it with the log
        traceback.print_exc()
        emit({"event": "error", "error": f"{type(e).__name__}: {e}"})
        return 1
    return 0


class JobProcess:
    """The parent's side of the job: one JSON line each way."""

    def __init__(self, cfg: Dict[str, Any], env: Dict[str, str], log_path: str) -> None:
        self.name: str = cfg["name"]  # its record while it borrows
        self.log_path = log_path
        self._log = open(log_path, "w")
        cmd = [sys.executable, os.path.abspath(__file__), "--job", json.dumps(cfg)]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, env=env
        )
        self._answers: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            if line.startswith(JOB_MARK):
                self._answers.put(json.loads(line[len(JOB_MARK) :]))
        self._answers.put(None)

    def answer(self, timeout: float, send: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        if send is not None:
            self.proc.stdin.write(json.dumps(send) + "\n")  # type: ignore[union-attr]
            self.proc.stdin.flush()  # type: ignore[union-attr]
        try:
            got = self._answers.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"the training job did not answer within {timeout:.0f} s ({self.log_path})") from None
        if got is None or got.get("event") == "error":
            with open(self.log_path, errors="replace") as f:
                tail = "".join(f.readlines()[-30:])
            raise RuntimeError(f"the training job failed ({self.log_path}):\n{tail}")
        return got

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "exit"}) + "\n")  # type: ignore[union-attr]
                self.proc.stdin.close()  # type: ignore[union-attr]
                self.proc.wait(60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(30)
        self._log.close()


# ---- the two arms ---------------------------------------------------------------------------


@dataclass
class Setup:
    total: int  # M: KV + job
    borrow: int  # J
    bursts: int
    n: int  # requests per burst
    plen: int
    gen: int
    gap: float  # seconds of each training window
    need: int  # KV bytes of one burst's requests, all at once
    cpu: bool
    device: str  # of the budget: cpu or cuda:0


def mapped_at(series: List[Sample], t: float) -> int:
    """Mapped bytes of the last sample at or before ``t`` (the first one if none is)."""
    before = [s.mapped for s in series if s.t <= t]
    return before[-1] if before else (series[0].mapped if series else 0)


def run_arm(kvcached: bool, srv: Any, job: JobProcess, st: Setup) -> Dict[str, Any]:
    """Bursts on ``srv`` with a training window of the job between two; times in seconds since
    the arm's sampler started."""
    rec = RecordSampler([srv.name] if kvcached else [], period=0.02)
    rec.start()
    time.sleep(0.5)
    bursts: List[Dict[str, Any]] = []
    windows: List[Dict[str, Any]] = []
    others: Set[str] = set()  # other instances seen in the budget: they take from M

    def look() -> None:
        if kvcached:
            others.update({r.name for r in DeviceBudget(st.device, st.total).members()} - {srv.name, job.name})

    try:
        for i in range(st.bursts):
            look()
            t0 = rec.now()
            ttfts, failed = burst(srv, st.n, st.plen, st.gen, seed=10 + i)
            look()
            bursts.append(
                {
                    "t0": t0,
                    "t1": rec.now(),
                    "p50_ttft_s": percentile(ttfts, 50),
                    "p99_ttft_s": percentile(ttfts, 99),
                    "failed": failed,
                }
            )
            log(
                f"{srv.name} burst {i + 1}: {st.n} requests, p50 TTFT {percentile(ttfts, 50):.2f} s, "
                f"p99 {percentile(ttfts, 99):.2f} s, {failed} failed, {rec.now() - t0:.1f} s"
            )
            if i == st.bursts - 1:
                break
            mode = "static" if not kvcached else ("learn" if i == 0 and not st.cpu else "reserve")
            w = job.answer(st.gap + 600, {"cmd": "train", "mode": mode, "seconds": st.gap})
            for k in ("t_start", "t_have", "t_release"):
                w[k] -= rec.t0
            w["events"] = [(t - rec.t0, h, a) for t, h, a in w["events"]]
            windows.append(w)
            log(
                f"job window {i + 1} ({mode}): memory after {w['borrow_s']:.2f} s, {w['retries']} retries, "
                f"{len(w['step_s'])} steps, p50 {percentile(w['step_s'], 50):.3f} s"
            )
    finally:
        rec.stop()
    series = rec.series.get(srv.name, [])
    if kvcached:
        static_pool = st.total - st.borrow
        for b in bursts:
            during = [s for s in series if b["t0"] <= s.t <= b["t1"]]
            b["peak_mapped"] = max((s.mapped for s in during), default=0)
            past = next((s.t for s in during if s.mapped > static_pool), None)
            b["past_static_pool_s"] = None if past is None else past - b["t0"]
        for w in windows:
            w["engine_before"] = mapped_at(series, w["t_start"])
            held = [s.mapped for s in series if w["t_have"] <= s.t <= w["t_release"]]
            w["engine_while_held"] = max(held, default=mapped_at(series, w["t_have"]))
    return {"bursts": bursts, "windows": windows, "series": [tuple(s) for s in series], "others": sorted(others)}


def checks(arms: Dict[str, Dict[str, Any]], st: Setup) -> Dict[str, Any]:
    """What the proof must show (None: not shown by this load)."""
    kv = arms["kvcached"]
    within = all(w["engine_while_held"] + w["borrowed"] <= st.total for w in kv["windows"])
    had_to_give = any(w["engine_before"] > st.total - w["borrowed"] for w in kv["windows"])
    shrank = within if had_to_give or not within else None
    needs_more = st.need > (st.total - st.borrow) * 1.05
    after = kv["bursts"][1:]
    grew = all(b["past_static_pool_s"] is not None for b in after) if needs_more else None
    kept = [w["left"] for w in kv["windows"] if w["left"] is not None]
    return {
        "failed": sum(b["failed"] for a in arms.values() for b in a["bursts"]),
        "alone": not kv["others"],
        "shrank": shrank,
        "grew_back": grew,
        "job_kept_nothing": all(k <= 64 << 20 for k in kept) if kept else None,
    }


def plot(arms: Dict[str, Dict[str, Any]], st: Setup, path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        log("matplotlib is not installed: no plot (the series are in the JSON beside it)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    g = float(GIB if not st.cpu else 1 << 20)
    unit = "GiB" if not st.cpu else "MiB"
    fig, axes = plt.subplots(2, 1, figsize=(12, 7), sharey=True)
    for ax, (arm, res) in zip(axes, arms.items()):
        end = max([b["t1"] for b in res["bursts"]] + [0.0])
        if arm == "kvcached":
            pts = res["series"]
            ax.step([p[0] for p in pts], [p[1] / g for p in pts], where="post", lw=2, label="vLLM KV mapped")
            t = [e[0] for w in res["windows"] for e in w["events"]]
            h = [e[1] / g for w in res["windows"] for e in w["events"]]
            ax.step([0.0, *t, end], [0.0, *h, 0.0], where="post", lw=2, label="job: borrowed")
        else:
            ax.hlines((st.total - st.borrow) / g, 0, end, lw=2, color="C0", label="vLLM KV pool (static)")
            ax.hlines(st.borrow / g, 0, end, lw=2, color="C1", label="job's share (static)")
        if not st.cpu:
            pts = [(e[0], e[2]) for w in res["windows"] for e in w["events"] if e[2] is not None]
            ax.plot([p[0] for p in pts], [p[1] / g for p in pts], ".", color="C2", ms=4, label="job: PyTorch memory")
        ax.axhline(st.total / g, color="red", ls="--", lw=1, label=f"M = {format_size(st.total)}")
        for i, b in enumerate(res["bursts"]):
            ax.axvspan(b["t0"], b["t1"], color="green", alpha=0.08, label="burst" if i == 0 else None)
        for i, w in enumerate(res["windows"]):
            ax.axvspan(w["t_start"], w["t_release"], color="orange", alpha=0.08, label="job trains" if i == 0 else None)
        ax.set_title(
            "kvcached: one budget, the job borrows between bursts" if arm == "kvcached"
            else f"static split: a KV pool of {format_size(st.total - st.borrow)}, the job's {format_size(st.borrow)}"
        )  # fmt: skip
        ax.set_ylabel(f"memory ({unit})")
        ax.set_ylim(0, st.total / g * 1.15)
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    axes[-1].set_xlabel("seconds into the arm")
    fig.suptitle("A training job and a vLLM server share M: kvcached borrowing vs a static split", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def fmt_s(x: Optional[float], digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}s"


def report(arms: Dict[str, Dict[str, Any]], st: Setup, ready: Dict[str, Any], ok: Dict[str, Any]) -> None:
    kv, sp = arms["kvcached"], arms["static"]
    print(
        f"\ntraining job beside vLLM bursts: M {format_size(st.total)} for KV + job; the job borrows "
        f"{format_size(st.borrow)} between bursts (kvcached) or holds it (static, KV pool "
        f"{format_size(st.total - st.borrow)}); {st.bursts} bursts of {st.n} requests ({st.plen} in / {st.gen} out, "
        f"{format_size(st.need)} of KV); job {ready['params'] / 1e6:.1f}M params, batch {ready['batch']} x "
        f"{ready['seq']} tokens, {st.gap:g} s windows"
    )
    print(f"{'burst':<6} {'kvcached p50':>12} {'p99':>8} {'peak mapped':>12} {'> static pool':>14} "
          f"{'static p50':>11} {'p99':>8}")  # fmt: skip
    for i, (k, s) in enumerate(zip(kv["bursts"], sp["bursts"])):
        print(
            f"{i + 1:<6} {fmt_s(k['p50_ttft_s']):>12} {fmt_s(k['p99_ttft_s']):>8} {format_size(k['peak_mapped']):>12} "
            f"{'after ' + fmt_s(k['past_static_pool_s']) if k['past_static_pool_s'] is not None else 'never':>14} "
            f"{fmt_s(s['p50_ttft_s']):>11} {fmt_s(s['p99_ttft_s']):>8}"
        )
    print(f"{'window':<7} {'mode':<8} {'memory in':>9} {'retries':>7} {'borrowed':>10} {'steps':>5} {'step p50':>9} "
          f"{'KV before -> while held':>24} {'cache -> emptied':>18} {'static steps':>12} {'p50':>7}")  # fmt: skip
    for i, (w, s) in enumerate(zip(kv["windows"], sp["windows"])):
        moved = f"{format_size(w['engine_before'])} -> {format_size(w['engine_while_held'])}"
        cache = "-" if w["cached"] is None else f"{format_size(w['cached'])} -> {format_size(w['left'])}"
        print(
            f"{i + 1:<7} {w['mode']:<8} {fmt_s(w['borrow_s']):>9} {w['retries']:>7} {format_size(w['borrowed']):>10} "
            f"{len(w['step_s']):>5} {fmt_s(percentile(w['step_s'], 50), 3):>9} {moved:>24} {cache:>18} "
            f"{len(s['step_s']):>12} {fmt_s(percentile(s['step_s'], 50), 3):>7}"
        )
    for arm, res in arms.items():
        steps = [x for w in res["windows"] for x in w["step_s"]]
        mean = sum(steps) / len(steps) if steps else None
        print(f"job step time, {arm}: mean {fmt_s(mean, 3)}, p50 {fmt_s(percentile(steps, 50), 3)}, {len(steps)} steps")
    yes = {True: "yes", False: "NO", None: "not shown by this load"}
    print(
        f"checks: the server gave memory back and kept within M - borrowed while the job held it: "
        f"{yes[ok['shrank']]}; grew past the static pool in the bursts after: {yes[ok['grew_back']]}; "
        f"the job's PyTorch memory back at its base before each release: {yes[ok['job_kept_nothing']]}"
    )
    if st.cpu:
        print("(CPU: PyTorch's CPU allocator has no cap, so torch_alloc_retry met no out-of-memory error)")
    if not ok["alone"]:
        print(
            f"INVALID: other kvcached instances took from the budget meanwhile: {', '.join(arms['kvcached']['others'])}"
        )
    print(f"{ok['failed']} requests failed")


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--job"]:
        return job_main(json.loads(argv[1]))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--total", default=None, help="M, memory of KV and job together (default 64G; --cpu 24M)")
    ap.add_argument("--borrow", default=None, help="J, what the job borrows (default 40G; --cpu 16M)")
    ap.add_argument("--bursts", type=int, default=3, help="bursts per arm, a training window between two")
    ap.add_argument("--burst", type=int, default=None, help="requests per burst (default 160; --cpu 32)")
    ap.add_argument("--gap", type=float, default=None, help="seconds of each training window (default 8; --cpu 3)")
    ap.add_argument("--borrow-timeout", type=float, default=60.0, help="seconds the job waits for its memory")
    ap.add_argument("--plot", default=None, help="PNG of memory over time (default OUT/gpu_borrow_train.png)")
    ap.add_argument("--cpu", action="store_true")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    total = parse_size(a.total or ("24M" if a.cpu else "64G"))
    borrow = parse_size(a.borrow or ("16M" if a.cpu else "40G"))
    if not 0 < borrow < total:
        ap.error(f"--borrow ({format_size(borrow)}) must be less than --total ({format_size(total)})")
    # The GPU prompts fill vLLM's 8192-token context of the 1B shape (its max_position_embeddings).
    plen, gen, max_len = (448, 32, 512) if a.cpu else (7680, 128, 8192)
    n = a.burst or (32 if a.cpu else 160)
    st = Setup(
        total=total,
        borrow=borrow,
        bursts=a.bursts,
        n=n,
        plen=plen,
        gen=gen,
        gap=a.gap or (3.0 if a.cpu else 8.0),
        need=n * (plen + gen) * kv_token_bytes(a.model, 4 if a.cpu else 2),
        cpu=a.cpu,
        device="cpu" if a.cpu else "cuda:0",
    )
    if not a.cpu and torch.cuda.get_device_properties(0).total_memory < total + GPU_OVERHEAD:
        ap.error(
            f"--total {format_size(total)} and the rest need about {format_size(total + GPU_OVERHEAD)} of GPU memory"
        )
    others = DeviceBudget(st.device, total).members()
    if others:
        # Engines join the whole device budget of this user: another instance would take from M.
        sys.exit(f"other kvcached instances share the {st.device} budget: {', '.join(r.name for r in others)}")
    tag = os.getpid()
    budget = budget_env(total, a.cpu)
    cfg = {
        "cpu": a.cpu,
        "shape": asdict(TINY if a.cpu else LLAMA_1B),
        "borrow": borrow,
        "name": f"borrow_job_{tag}",
        "timeout_s": a.borrow_timeout,
    }
    # Started beside the first server: vLLM skips its memory profiling when the KV size is given.
    job = JobProcess(cfg, {**os.environ, **budget}, os.path.join(a.out, f"borrow_job_{tag}.log"))
    arms: Dict[str, Dict[str, Any]] = {}
    ready: Dict[str, Any] = {}
    try:
        for kvcached in (True, False):
            arm = "kvcached" if kvcached else "static"
            extra: Dict[str, str] = {**budget, "KVCACHED_AUTOPATCH": "1"} if kvcached else {}
            srv = start_server(
                a.model, f"borrow_{arm}_{tag}", kvcached, a.out, cpu=a.cpu, max_model_len=max_len,
                kv_bytes=total if kvcached else total - borrow, **extra,
            )  # fmt: skip
            try:
                log(f"{arm} server up after {wait_all([srv], 1200):.0f} s")
                if not ready:
                    ready = job.answer(600)
                    log(f"job ready: batch {ready['batch']}, base {format_size(ready['base'])}")
                burst(srv, 2, plen, 8, seed=99)  # warm-up: the first requests compile and allocate
                arms[arm] = run_arm(kvcached, srv, job, st)
            finally:
                srv.stop()
    finally:
        job.close()
    ok = checks(arms, st)
    write_json(
        os.path.join(a.out, "borrow_train.json"), {"setup": asdict(st), "job": ready, "arms": arms, "checks": ok}
    )
    plot(arms, st, a.plot or os.path.join(a.out, "gpu_borrow_train.png"))
    report(arms, st, ready, ok)
    bad = (
        ok["failed"]
        or not ok["alone"]
        or ok["shrank"] is False
        or ok["grew_back"] is False
        or ok["job_kept_nothing"] is False
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
