"""More models than the GPU holds: ``kvcached serve`` with ``sleep: engine`` and ``max_awake``.

    python scripts/gpu_proof/sleep_engine.py --model DIR --out DIR [--models N] [--max-awake K]
        [--sleep engine|stop] [--engine vllm|sglang] [--kv 16G] [--compare OTHER.json] [--dry-run] [--cpu]

N copies of one model (in ``scripts/gpu_engines.sh`` the 8B shape of its ``model`` step: 15 GiB
of bf16 weights; by default N is the fewest copies whose weights exceed the device: 10 on an
H200) behind one router; at most ``--max-awake`` hold their weights (by default as many as
fit beside the KV budget: 5 on an H200), the others sleep (``sleep: engine``: vLLM's sleep mode /
SGLang's memory saver move the weights to host memory while kvcached gives their KV back;
``sleep: stop``: the engine is stopped, the comparison). Phases:

1. warm-up: each model's reference prompts, greedy and one at a time (the held-back models
   start on them, each evicting the least recently used one): each model's reference tokens;
   taken twice, the second time the check's control (an engine that differs from itself
   without a sleep cannot show what a sleep changes);
2. rotating stream: ``--rounds`` rounds over the models (most visits find their model
   asleep: a wake, after an eviction); a visit sends the reference prompts first, whose greedy
   tokens must equal the reference (CUDA graphs on: vLLM's and SGLang's defaults), then
   ``--burst`` streamed requests at once;
3. Zipf stream: Poisson arrivals at ``--rate`` req/s for ``--zipf-seconds``, models drawn
   with Zipf(``--zipf-s``) popularity.

Reports wake p50/p99 (the router's ``awake after`` lines), the sleeps that made room,
TTFT p50/p99 of requests that found their model awake vs asleep, and with ``--compare``
the other mode's run beside this one. Exits 1 when a request failed, a token differed, no
model was checked after a wake, or the router did not stop cleanly; 2 when the machine
cannot hold the plan (host memory for the sleeping weights).

``--dry-run`` writes the router config and prints the plan and checks, starting nothing.
``--cpu`` runs the tiny model on the CPU engines with ``sleep: stop`` (neither engine can
sleep on a CPU): everything but the engine's own sleep, before device time is spent.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    GIB,
    PINNED_KERNELS,
    first_differing_token,
    log,
    percentile,
    router_budget,
    router_config,
    router_model,
    router_states,
    start_router,
    write_json,
)

from kvcached.router.config import ENGINE_SLEEP_FLAGS  # noqa: E402
from kvcached.router.supervisor import free_port  # noqa: E402
from kvcached.testing import vllm_server as vs  # noqa: E402
from kvcached.units import format_size, parse_size  # noqa: E402

PROCESS_HOST_BYTES = 3 * GIB  # what one engine process holds in host memory besides offloaded weights
REF_PROMPTS = 8


def weight_bytes(model: str) -> int:
    return sum(
        os.path.getsize(os.path.join(model, f))
        for f in os.listdir(model)
        if f.endswith((".safetensors", ".bin", ".pt"))
    )


def host_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def device_bytes(cpu: bool, gib: Optional[float] = None) -> int:
    if gib:
        return int(gib * GIB)
    if cpu:
        return host_available()
    import torch

    return int(torch.cuda.get_device_properties(0).total_memory)


def fit(dev: int, w: int, kv: int) -> Tuple[int, int]:
    """(models, max_awake) for a device of ``dev`` bytes and weights of ``w``: the fewest
    models whose weights exceed the device, and as many awake as fit beside the KV budget
    (each awake engine: its weights, ~10% more for graphs and activations, 2.5 GiB of
    context and workspace; the sleeping ones keep their context)."""
    models = dev // w + 1
    awake = int((dev * 0.92 - kv) // (w * 1.1 + 2.5 * GIB))
    return models, max(1, min(awake, models - 2))


def names(n: int) -> List[str]:
    return [f"m{i}" for i in range(n)]


def config(a: argparse.Namespace, port: int, dev: int) -> Dict:
    models = [
        router_model(
            m,
            a.engine,
            a.model,
            cpu=a.cpu,
            kv=a.kv,
            max_model_len=512 if a.cpu else 2048,
            sleep=a.sleep,
            idle=a.idle,
            python=a.engine_python,
            path=a.engine_path,
            # Explicit KV bytes: vLLM reads the utilization only in its start-up check of free memory.
            vllm_gpu_args=["--gpu-memory-utilization", str(a.gpu_utilization), "--max-num-seqs", "64"],
            extra_args=list(ENGINE_SLEEP_FLAGS[a.engine]) if a.sleep == "engine" else [],
            # The references are checked across processes in the stop arm (a restart) and after
            # every start: kernel configs picked by timing would differ between them.
            env={**(PINNED_KERNELS if a.engine == "vllm" else {}), **a.engine_env} or None,
        )
        for m in names(a.models)
    ]
    return router_config(a.out, port, router_budget(a.kv, a.cpu, dev), models, max_awake=a.max_awake)


def keeps_host_copies(a: argparse.Namespace) -> bool:
    """Whether every engine keeps its weights' host copy while awake too (torch_memory_saver's
    ``TMS_RETAIN_CPU_BACKUP``), not only while asleep."""
    return a.engine == "sglang" and a.engine_env.get("TMS_RETAIN_CPU_BACKUP", "").lower() not in ("", "0", "false")


def plan_checks(a: argparse.Namespace, dev: int) -> Tuple[List[str], Optional[str]]:
    """Lines describing the plan, and why the machine cannot hold it (None when it can)."""
    w = int(a.weights_gib * GIB) if a.weights_gib else weight_bytes(a.model)
    asleep = a.models - a.max_awake
    lines = [
        f"{a.models} {a.engine} models of {format_size(w)} weights each ({format_size(a.models * w)} in all) on a "
        f"{format_size(dev)} {'host' if a.cpu else 'GPU'}; at most {a.max_awake} awake ({format_size(a.max_awake * w)} "
        f"of weights) beside a shared KV budget of {format_size(a.kv)}; sleep: {a.sleep}",
    ]
    if a.models * w <= dev:
        lines.append(f"note: the weights fit the device ({format_size(a.models * w)} <= {format_size(dev)})")
    backups = a.models if keeps_host_copies(a) else asleep
    need = (backups * w if a.sleep == "engine" else 0) + a.models * PROCESS_HOST_BYTES
    have = host_available()
    lines.append(
        f"host memory: ~{format_size(need)} needed ({backups} models' host weights + processes), "
        f"{format_size(have)} available"
    )
    why = None
    if not a.cpu and need > have * 0.95:
        why = (
            f"the host cannot hold {backups} models' weights and {a.models} engine processes "
            f"(~{format_size(need)} > {format_size(have)} available): lower --models or raise --max-awake"
        )
    if not a.cpu and a.max_awake * w + a.kv > dev * 0.95:
        why = f"{a.max_awake} awake models' weights and the KV budget exceed the GPU: lower --max-awake or --kv"
    return lines, why


class Router:
    """``python -m kvcached.router serve`` in a child process, and what the tests read of it."""

    def __init__(self, a: argparse.Namespace, cfg: Dict) -> None:
        self.port = cfg["port"]
        self.log_path = os.path.join(a.out, "router.log")
        env = dict(os.environ)
        # vLLM's sleep mode (the CuMem allocator) refuses expandable segments.
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        self.proc = start_router(cfg, a.out, env)

    def states(self) -> Dict[str, str]:
        return router_states(self.port)

    def wait_listening(self, timeout: float) -> None:
        t0 = time.monotonic()
        while True:
            try:
                self.states()
                return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() - t0 > timeout:
                raise RuntimeError(f"the router did not come up; see {self.log_path}")
            time.sleep(0.5)

    def transitions(self) -> Dict[str, List[Tuple[str, float, str]]]:
        """From the router's log: every wake and sleep as (model, seconds, mode), and evictions."""
        out: Dict[str, list] = {"wakes": [], "sleeps": [], "evictions": []}
        with open(self.log_path, errors="replace") as f:
            for line in f:
                m = re.search(r"kvcached\.router: (\S+): (awake|asleep) after ([\d.]+) s \((\w+)\)", line)
                if m:
                    out["wakes" if m.group(2) == "awake" else "sleeps"].append(
                        (m.group(1), float(m.group(3)), m.group(4))
                    )
                m = re.search(r"kvcached\.router: (\S+): put to sleep to make room", line)
                if m:
                    out["evictions"].append((m.group(1), 0.0, ""))
        return out

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(180)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = -9
        return rc


class StateWatch(threading.Thread):
    """The router's model states, polled every ``period`` s (what a request found when it was sent)."""

    def __init__(self, router: Router, period: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.router, self.period, self.latest = router, period, {}
        self._stop = threading.Event()

    def run(self) -> None:
        while not self._stop.is_set():
            try:
                self.latest = self.router.states()
            except OSError:
                pass
            self._stop.wait(self.period)

    def stop(self) -> None:
        self._stop.set()


def one(port: int, model: str, prompt: List[int], gen: int) -> Tuple[Optional[float], bool]:
    """One streamed request through the router: (TTFT or None, ok)."""
    try:
        ttft, _total, got = vs.stream(SimpleNamespace(port=port, model=model), prompt, gen, timeout=900)
        return ttft, got >= gen
    except Exception:  # noqa: BLE001 - counted as a failure
        return None, False


_salts = itertools.count()


def reference(port: int, model: str, gen: int) -> List[List[int]]:
    """The model's greedy tokens for its reference prompts, one request at a time: a prompt
    alone in every step gets the same numbers from every start of the engine, while a batch
    of them is split over steps as they arrive, which changes the numbers (12-06, H100: with
    one batch, 24 of 32 sequences differed after plain restarts, ``sleep: stop``). A fresh
    ``cache_salt`` each time (vLLM's prefix cache and SGLang's radix cache, 0.5.15+, key on it):
    every prefill is cold, as the first one after a wake is; a warm repeat would run other
    kernels (an extend over a cached prefix) than the cold reference."""
    srv = SimpleNamespace(port=port, model=model)
    prompts = vs.token_prompts(REF_PROMPTS, 64, seed=7)
    out = []
    for p in prompts:
        extra = {"cache_salt": f"reference-{next(_salts)}"}
        out.append(vs.stream_batch(srv, [p], gen, lambda i, done: None, timeout=900, extra=extra)[0])
    return out


def first_differences(got: List[List[int]], want: List[List[int]]) -> List[int]:
    """For each sequence that differs, the index of its first token that does."""
    return [first_differing_token(x, y) for x, y in zip(got, want) if x != y]


def where(firsts: List[int]) -> str:
    return f" (first at token {', '.join(map(str, firsts))})" if firsts else ""


def summary(xs: List[float]) -> Dict[str, Optional[float]]:
    return {"n": len(xs), "p50": percentile(xs, 50), "p99": percentile(xs, 99), "max": max(xs, default=None)}


def fmt(s: Dict[str, Optional[float]]) -> str:
    if not s["n"]:
        return "-"
    return f"n={s['n']} p50 {s['p50']:.2f}s p99 {s['p99']:.2f}s max {s['max']:.2f}s"


def run(a: argparse.Namespace, cfg: Dict) -> Dict:
    router = Router(a, cfg)
    port, models = cfg["port"], names(a.models)
    res: Dict[str, object] = {"config": {k: v for k, v in vars(a).items() if k != "compare"}}
    watch = StateWatch(router)
    try:
        router.wait_listening(300)
        watch.start()
        # 1. warm-up and references (held-back models start here, evicting the least recently used)
        t0 = time.monotonic()
        refs: Dict[str, List[List[int]]] = {}
        control: Dict[str, List[int]] = {}  # the check's own control: the references twice, no sleep between
        for m in models:
            t1 = time.monotonic()
            refs[m] = reference(port, m, a.ref_tokens)
            control[m] = first_differences(reference(port, m, a.ref_tokens), refs[m])
            log(f"warm-up {m}: references in {time.monotonic() - t1:.1f} s, again {len(control[m])} differ")
        res["warmup_s"] = time.monotonic() - t0
        res["control"] = control
        # 2. rotating stream
        rot: List[Dict[str, object]] = []
        for r in range(a.rounds):
            for i, m in enumerate(models):
                before = watch.latest.get(m, "?")
                t1 = time.monotonic()
                again = reference(port, m, a.ref_tokens)  # the wake's request: the tokens are checked
                first_s = time.monotonic() - t1
                firsts = first_differences(again, refs[m])
                diff = len(firsts)
                prompts = vs.token_prompts(a.burst, a.prompt_len, seed=100 + r * len(models) + i)
                with ThreadPoolExecutor(a.burst) as ex:
                    got = list(ex.map(lambda p, m=m: one(port, m, p, a.gen), prompts))
                ttfts = [t for t, _ in got if t is not None]
                rot.append(
                    {"model": m, "state_before": before, "first_batch_s": first_s, "token_diffs": diff,
                     "first_diff_at": firsts, "ttft": summary(ttfts), "failed": sum(not ok for _, ok in got),
                     "seconds": time.monotonic() - t1}
                )  # fmt: skip
                log(
                    f"visit {m} ({before}): references {first_s:.1f} s, {diff} of {REF_PROMPTS} differ{where(firsts)}; "
                    f"burst TTFT {fmt(summary(ttfts))}, {rot[-1]['failed']} failed"
                )
        res["rotating"] = rot
        # 3. Zipf stream
        rng = random.Random(0)
        weights = [1.0 / (k + 1) ** a.zipf_s for k in range(len(models))]
        zipf: List[Tuple[str, str, Optional[float], bool]] = []
        lock = threading.Lock()

        def send(m: str, p: List[int]) -> None:
            before = watch.latest.get(m, "?")
            ttft, ok = one(port, m, p, a.gen)
            with lock:
                zipf.append((m, before, ttft, ok))

        t1 = time.monotonic()
        with ThreadPoolExecutor(256) as ex:
            k = 0
            while time.monotonic() - t1 < a.zipf_seconds:
                m = rng.choices(models, weights)[0]
                ex.submit(send, m, vs.token_prompts(1, a.prompt_len, seed=10_000 + k)[0])
                k += 1
                time.sleep(rng.expovariate(a.rate))
        res["zipf"] = zipf
        res["transitions"] = router.transitions()
    finally:
        watch.stop()
        res["router_rc"] = router.stop()
    return res


def report(res: Dict, other: Optional[Dict]) -> int:
    a = SimpleNamespace(**res["config"])  # type: ignore[arg-type]
    tr = res["transitions"]
    wakes = [s for _, s, mode in tr["wakes"] if mode == a.sleep]
    starts = [s for _, s, mode in tr["wakes"] if mode != a.sleep]
    sleeps = [s for _, s, _ in tr["sleeps"]]
    rot = res["rotating"]
    cold = [r["ttft"] for r in rot if r["state_before"] != "ready"]
    zipf = res["zipf"]
    z_cold = [t for _, st, t, ok in zipf if t is not None and st != "ready"]
    z_warm = [t for _, st, t, ok in zipf if t is not None and st == "ready"]
    failed = sum(r["failed"] for r in rot) + sum(not ok for *_, ok in zipf)
    print(f"\nsleep_engine: {a.models} {a.engine} models, max_awake {a.max_awake}, sleep: {a.sleep}, KV budget {a.kv}")
    print(f"warm-up (references; held-back models started): {res['warmup_s']:.0f} s")
    print(f"wakes by {a.sleep}: {fmt(summary(wakes))}")
    print(f"first starts: {fmt(summary(starts))}; sleeps: {fmt(summary(sleeps))}; evictions {len(tr['evictions'])}")
    print(f"rotating: {len(rot)} visits (references, then {a.burst} at once), {len(cold)} found their model asleep")
    for r in rot:
        print(
            f"  {r['model']:<4} {r['state_before']:<9} references {r['first_batch_s']:6.1f} s "
            f"({r['token_diffs']} differ)  burst TTFT {fmt(r['ttft'])}  failed {r['failed']}"
        )
    print(f"zipf {a.zipf_seconds:.0f} s at {a.rate}/s: {len(zipf)} requests; TTFT model awake {fmt(summary(z_warm))}")
    print(f"                                   TTFT model asleep {fmt(summary(z_cold))}")
    woken = [r for r in rot if r["state_before"] != "ready"]
    bad = sum(r["token_diffs"] for r in rot)
    unsound = sum(len(v) for v in res.get("control", {}).values())
    if "control" in res:
        print(
            f"the check's control (each model's references twice before any sleep): "
            f"{REF_PROMPTS * len(res['control'])} sequences, {unsound} differ"
        )
    print(
        f"greedy tokens vs each model's reference: {REF_PROMPTS * len(rot)} sequences, {bad} differ; "
        f"{REF_PROMPTS * len(woken)} of them right after a wake ({len({r['model'] for r in woken})} models)"
    )
    if other is not None:
        o = SimpleNamespace(**other["config"])
        ow = [s for _, s, mode in other["transitions"]["wakes"] if mode == o.sleep]
        oz = [t for _, st, t, ok in other["zipf"] if t is not None and st != "ready"]
        mine, theirs = arm_name(res["config"]), arm_name(other["config"])
        print(f"compare: wake p50/p99 {mine} {fmt(summary(wakes))} | {theirs} {fmt(summary(ow))}")
        print(f"         cold-request TTFT {mine} {fmt(summary(z_cold))} | {theirs} {fmt(summary(oz))}")
        osleeps = [s for _, s, _ in other["transitions"]["sleeps"]]
        print(f"         sleeps {mine} {fmt(summary(sleeps))} | {theirs} {fmt(summary(osleeps))}")
    print(f"{failed} requests failed; router exit status {res['router_rc']} after SIGTERM")
    ok = not failed and not bad and not unsound and res["router_rc"] == 0 and bool(woken)
    return 0 if ok else 1


def arm_name(c: Dict) -> str:
    """A run's name in the comparison: engine, sleep mode and the engines' extra variables."""
    env = "".join(f", {k}={v}" for k, v in (c.get("engine_env") or {}).items())
    return f"{c.get('engine', 'vllm')} sleep: {c['sleep']}{env}"


def plot(res: Dict, other: Optional[Dict], path: str) -> None:
    """Wake times of each arm (left) and the Zipf stream's TTFT, requests that found their model
    asleep and awake (right, as a CDF): what a wake by ``sleep: engine`` costs against a restart."""
    try:
        import matplotlib
    except ImportError:
        log("matplotlib is not installed: no plot (the series are in the JSON beside it)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    arms = [r for r in (res, other) if r is not None]
    for i, r in enumerate(arms):
        c = r["config"]
        mode, color = c["sleep"], f"C{i}"
        wakes = [s for _, s, m in r["transitions"]["wakes"] if m == mode]
        rng = random.Random(i)
        left.scatter([i + rng.uniform(-0.15, 0.15) for _ in wakes], wakes, s=14, color=color, alpha=0.7)
        if wakes:
            left.annotate(f"p50 {percentile(wakes, 50):.2f} s", (i + 0.2, percentile(wakes, 50)), fontsize=9)
        for state, style in (("asleep", "-"), ("awake", "--")):
            ts = sorted(t for _, st, t, _ in r["zipf"] if t is not None and (st == "ready") == (state == "awake"))
            if ts:
                ys = [(k + 1) / len(ts) for k in range(len(ts))]
                label = f"{arm_name(c)}, model {state} (n={len(ts)})"
                right.step(ts, ys, where="post", ls=style, color=color, label=label)
    left.set_xticks(range(len(arms)), [f"{arm_name(r['config'])}\n{r['config']['models']} models, "
                                       f"{r['config']['max_awake']} awake" for r in arms])  # fmt: skip
    left.set_yscale("log")
    left.set_ylabel("wake, s (router: asked -> serving)")
    left.set_xlim(-0.6, len(arms) - 0.4)
    right.set_xscale("log")
    right.set_xlabel("TTFT, s (Zipf stream)")
    right.set_ylabel("fraction of requests")
    right.legend(fontsize=8, loc="lower right")
    c = res["config"]
    fig.suptitle(f"{c['engine']}: more models than the GPU holds behind kvcached serve (KV budget {c['kv']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    log(f"plot: {path}")


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--models",
        type=int,
        default=None,
        help="copies behind the router (default: the fewest whose weights exceed the device; --cpu 3)",
    )
    ap.add_argument(
        "--max-awake",
        type=int,
        default=None,
        help="engines holding weights at once (default: as many as fit beside the KV budget; --cpu 2)",
    )
    ap.add_argument("--sleep", choices=("engine", "stop"), default=None, help="default engine (--cpu: stop)")
    ap.add_argument("--engine", choices=("vllm", "sglang"), default="vllm")
    ap.add_argument("--engine-python", default=sys.executable, help="the interpreter that has the engine")
    ap.add_argument(
        "--engine-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an environment variable of every engine (repeatable; e.g. TMS_RETAIN_CPU_BACKUP=1)",
    )
    ap.add_argument("--engine-path", default=None, help="the engines' PYTHONPATH (default: ours)")
    ap.add_argument(
        "--kv", default=None, help="shared KV budget, also each engine's virtual KV (default 16G; --cpu 32M)"
    )
    ap.add_argument(
        "--gpu-utilization", type=float, default=0.2, help="vLLM's start-up check only (KV bytes are explicit)"
    )
    ap.add_argument("--idle", type=float, default=600.0, help="idle_seconds: only max_awake puts models to sleep")
    ap.add_argument("--rounds", type=int, default=1, help="rotating rounds over the models")
    ap.add_argument("--burst", type=int, default=None, help="requests per visit (default 8; --cpu 2)")
    ap.add_argument("--rate", type=float, default=None, help="Zipf stream requests per second (default 4; --cpu 0.5)")
    ap.add_argument("--zipf-seconds", type=float, default=None, help="default 45; --cpu 20")
    ap.add_argument("--zipf-s", type=float, default=1.1)
    ap.add_argument("--prompt-len", type=int, default=None, help="default 512; --cpu 32")
    ap.add_argument("--gen", type=int, default=None, help="tokens per request (default 64; --cpu 8)")
    ap.add_argument("--ref-tokens", type=int, default=None, help="tokens per reference (default 64; --cpu 8)")
    ap.add_argument("--compare", default=None, help="another run's sleep_engine.json to print beside this one")
    ap.add_argument("--plot", default=None, help="PNG of wake times and TTFT (with --compare: both arms)")
    ap.add_argument(
        "--report", action="store_true", help="print the report (and --plot) of the run in --out, starting nothing"
    )
    ap.add_argument("--dry-run", action="store_true", help="write the config, print the plan and checks, start nothing")
    ap.add_argument("--device-gib", type=float, default=None, help="plan for a device this large (default: probed)")
    ap.add_argument(
        "--weights-gib", type=float, default=None, help="plan for weights this large (default: the model's)"
    )
    ap.add_argument("--cpu", action="store_true")
    a = ap.parse_args(argv)
    if a.report:
        with open(os.path.join(a.out, "sleep_engine.json")) as f:
            return finish(json.load(f), a)
    cpu = a.cpu
    if not all("=" in kv and kv.split("=", 1)[0] for kv in a.engine_env):
        raise SystemExit(f"--engine-env takes KEY=VALUE, got {a.engine_env}")
    a.engine_env = dict(kv.split("=", 1) for kv in a.engine_env)
    a.sleep = a.sleep or ("stop" if cpu else "engine")
    if cpu and a.sleep == "engine":
        raise SystemExit(
            "--cpu: neither engine can sleep on a CPU (vLLM refuses --enable-sleep-mode); use --sleep stop"
        )
    a.kv = parse_size(a.kv or ("32M" if cpu else "16G"))
    dev = device_bytes(cpu, a.device_gib)
    w = int(a.weights_gib * GIB) if a.weights_gib else weight_bytes(a.model)
    auto_n, auto_k = (3, 2) if cpu else fit(dev, w, a.kv)
    a.models, a.max_awake = a.models or auto_n, a.max_awake or auto_k
    a.burst = a.burst or (2 if cpu else 8)
    a.rate = a.rate or (0.5 if cpu else 4.0)
    a.zipf_seconds = a.zipf_seconds if a.zipf_seconds is not None else (20.0 if cpu else 45.0)
    a.prompt_len = a.prompt_len or (32 if cpu else 512)
    a.gen = a.gen or (8 if cpu else 64)
    a.ref_tokens = a.ref_tokens or (8 if cpu else 64)
    if not 1 <= a.max_awake < a.models:
        raise SystemExit(f"--max-awake must be >= 1 and below --models ({a.models}), got {a.max_awake}")
    os.makedirs(a.out, exist_ok=True)
    lines, why = plan_checks(a, dev)
    for ln in lines:
        log(ln)
    cfg = config(a, free_port(), dev)
    write_json(os.path.join(a.out, "router.json"), cfg)
    if why and not a.dry_run:
        log(f"cannot run: {why}")
        return 2
    if a.dry_run:
        if why:
            log(f"this machine could not run it: {why}")
        from kvcached.router.config import parse_config

        parse_config(cfg, source=os.path.join(a.out, "router.json"))  # the router's own checks
        log(f"dry run: config {os.path.join(a.out, 'router.json')} passes the router's checks; nothing started")
        return 0
    res = run(a, cfg)
    res["config"]["kv"] = format_size(a.kv)
    write_json(os.path.join(a.out, "sleep_engine.json"), res)
    return finish(res, a)


def finish(res: Dict, a: argparse.Namespace) -> int:
    """The report of ``res``, beside ``--compare``'s run where it is another, and its plot."""
    other = None
    if (
        a.compare
        and os.path.exists(a.compare)
        and os.path.abspath(a.compare) != os.path.abspath(os.path.join(a.out, "sleep_engine.json"))
    ):
        with open(a.compare) as f:
            other = json.load(f)
    rc = report(res, other)
    if a.plot:
        plot(res, other, a.plot)
    return rc


if __name__ == "__main__":
    sys.exit(main())
