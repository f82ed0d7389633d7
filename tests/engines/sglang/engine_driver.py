"""One SGLang engine run for the integration tests (a separate process per run).

    python engine_driver.py CONFIG.json OUT.json

CONFIG: {"model": path, "page_size": 1|16, "kvcached": bool, "max_total_tokens": int|null,
         "limit_bytes": int|null, "report": path|null,
         "peer_want_bpp": bytes per kvcached page of the record, or absent: no W5}

The same workloads run with and without kvcached (``workloads``); with kvcached
the run also gathers evidence from the scheduler process: its kvcached report
(``Engine.collective_rpc("kvcached_report")``), its shared-memory record and
its /proc/<pid>/maps (distinct memfd pages mapped), sampled while generating
and after; and ``kvctl limit`` is lowered (the real CLI) while a batch runs.
The run's environment (ENABLE_KVCACHED, KVCACHED_*) is set by the caller.

Spawned SGLang processes re-import this file: everything runs under __main__.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional

# Word-level tokenizer: "w1 w2 w3" is BOS + 3 tokens.
PROMPTS = [
    "hello world the quick brown fox",
    "tell me a story about the lazy dog",
    "one two three four five six seven eight nine ten",
]
LONG_PROMPT = " ".join(f"w{i}" for i in range(40))  # 41 tokens: two whole 16-token pages
SHORT = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}
BATCH_NEW = 96


def batch_prompts(tag: str, n: int = 8) -> List[str]:
    return [" ".join(f"{tag}{i}x{j}" for j in range(6 + 3 * i)) for i in range(n)]


BATCH = {"temperature": 0.0, "max_new_tokens": BATCH_NEW, "ignore_eos": True}


def memfd_pages(pid: int) -> int:
    """Distinct kvcached host pages mapped in ``pid`` (one memfd each; the shared zero page excluded)."""
    inodes = set()
    zero = None
    counts: Dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                if "memfd:kvcached" not in line:
                    continue
                ino = line.split()[4]
                counts[ino] = counts.get(ino, 0) + 1
                inodes.add(ino)
    except FileNotFoundError:
        return -1
    if counts:
        zero = max(counts, key=counts.get)  # the zero page backs every unmapped page: most mappings
        if counts[zero] > 1:
            inodes.discard(zero)
    return len(inodes)


def flush_when_idle(client: Any, bound_s: float = 30.0) -> bool:
    """SGLang flushes only when nothing is queued or running; right after a generate
    returns, the overlap scheduler may still be finishing the batch: try again, bounded."""
    deadline = time.monotonic() + bound_s
    while True:
        if client.flush():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


def maps_mentioning(pid: int, path: Optional[str]) -> int:
    """Lines of /proc/<pid>/maps naming a file below ``path`` (0 when path is None)."""
    if not path:
        return 0
    try:
        with open(f"/proc/{pid}/maps") as f:
            return sum(1 for line in f if path in line)
    except FileNotFoundError:
        return -1


class Sampler:
    """Samples a number in a background thread (peak and last)."""

    def __init__(self, fn: Callable[[], int], period: float = 0.005) -> None:
        self.fn, self.period = fn, period
        self.peak, self.samples = -1, 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                v = self.fn()
                self.peak = max(self.peak, v)
                self.samples += 1
            except Exception:
                pass
            time.sleep(self.period)

    def __enter__(self) -> Sampler:
        self._t.start()
        return self

    def __exit__(self, *a: Any) -> None:
        self._stop.set()
        self._t.join()


class EngineClient:
    """sglang.Engine in this process."""

    def __init__(self, cfg: Dict[str, Any], kw: Dict[str, Any]) -> None:
        import sglang

        self.engine = sglang.Engine(model_path=cfg["model"], **kw)
        self.report_path = cfg.get("report")

    def generate(self, prompts, params):
        return self.engine.generate(prompt=prompts, sampling_params=params)

    def flush(self) -> bool:
        return bool(getattr(self.engine.flush_cache(), "success", True))

    def max_total_num_tokens(self) -> int:
        info = self.engine.get_server_info()
        return info.get("max_total_num_tokens") or (info.get("internal_states") or [{}])[0].get("max_total_num_tokens")

    def scheduler_pid(self) -> int:
        return self.engine.get_all_child_pids()[0]

    def report(self) -> Optional[Dict[str, Any]]:
        self.engine.collective_rpc("kvcached_report", path=self.report_path)
        with open(self.report_path) as f:
            return json.load(f)

    def close(self) -> None:
        self.engine.shutdown()


class ServerClient:
    """``python -m sglang.launch_server`` (the user's unchanged command) over HTTP."""

    def __init__(self, cfg: Dict[str, Any], kw: Dict[str, Any], env: Optional[Dict[str, str]] = None) -> None:
        from kvcached.router.engines import HIGHEST_PORT
        from kvcached.router.supervisor import free_port

        self.port = free_port(highest=HIGHEST_PORT["sglang"])  # 0.5.15: port + 10000 must be a port too
        flags = [
            "--model-path",
            cfg["model"],
            "--device",
            "cpu",
            "--attention-backend",
            "torch_native",
            "--sampling-backend",
            "pytorch",
            "--disable-cuda-graph",
            "--page-size",
            str(kw["page_size"]),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--log-level",
            kw["log_level"],
        ]
        if kw.get("max_total_tokens"):
            flags += ["--max-total-tokens", str(kw["max_total_tokens"])]
        if kw.get("enable_metrics"):
            flags.append("--enable-metrics")
        flags += list(kw.get("extra_flags", ()))
        self.log_path = cfg["server_log"]
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sglang.launch_server", *flags],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )
        self.base = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 600  # a bound for a busy 2-core machine
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"launch_server exited rc={self.proc.returncode}; {self._log_tail()}")
            try:
                if self._req("/health_generate", None, timeout=30)[0] == 200:
                    break
            except Exception:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"launch_server not ready after 600 s; {self._log_tail()}")
            time.sleep(0.5)

    def _log_tail(self, n: int = 40) -> str:
        """The server log's last lines, for the error (pytest removes old tmp folders)."""
        try:
            with open(self.log_path, errors="replace") as f:
                tail = "".join(f.readlines()[-n:])
        except OSError as e:
            tail = repr(e)
        return f"{self.log_path} ends:\n{tail}"

    def _req(self, path: str, body: Any, timeout: float = 600):
        import urllib.request

        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, method="POST" if data is not None else "GET")
        req.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read().decode()
        try:
            return r.status, json.loads(raw)
        except json.JSONDecodeError:
            return r.status, raw

    def generate(self, prompts, params):
        _, out = self._req("/generate", {"text": prompts, "sampling_params": params})
        return out

    def flush(self) -> bool:
        import urllib.error

        try:
            return self._req("/flush_cache", {})[0] == 200
        except urllib.error.HTTPError:  # 400: requests still in flight
            return False

    def max_total_num_tokens(self) -> int:
        _, info = self._req("/server_info", None)
        return info.get("max_total_num_tokens") or (info.get("internal_states") or [{}])[0].get("max_total_num_tokens")

    def scheduler_pid(self) -> int:
        import psutil

        for c in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                if "sglang::scheduler" in " ".join(c.cmdline()) or c.name().startswith("sglang::schedul"):
                    return c.pid
            except psutil.Error:
                pass
        raise RuntimeError("no sglang::scheduler child found")

    def report(self) -> Optional[Dict[str, Any]]:
        return None  # no RPC over HTTP: the record and /proc are the evidence

    def close(self) -> None:
        import signal

        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=60)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()


def openai_stream(client: ServerClient, model: str) -> Dict[str, Any]:
    """The GPU proof's OpenAI client (``kvcached.testing.vllm_server``) against this server:
    the tokens ``stream`` counts, and ``stream_batch``'s token ids (or why it refused: SGLang
    before 0.5.17 streams text only), beside ``/generate``'s for the same ids."""
    from types import SimpleNamespace

    from kvcached.testing import vllm_server as vs

    srv, ids, n = SimpleNamespace(port=client.port, model=model), [1, 17, 29, 43, 58, 71], 12
    out: Dict[str, Any] = {"max_tokens": n, "counted": vs.stream(srv, ids, n)[2]}
    try:
        out["ids"] = vs.stream_batch(srv, [ids], n, lambda i, done: None)[0]
    except RuntimeError as e:
        out["refused"] = str(e)
    params = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
    out["generate_ids"] = client._req("/generate", {"input_ids": ids, "sampling_params": params})[1]["output_ids"]
    return out


LIMITS_WORKER = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "helpers", "limits_worker.py"
)


def peer_wants_memory(client: Any, record: Callable[[], Any], bpp: int) -> Dict[str, Any]:
    """W5: the engine idles with its prefix cache full; a peer instance (a real
    kvcached instance in another process, tests/helpers/limits_worker.py) whose device
    budget is what is mapped now (so the engine's pages fill it) wants as much
    as the engine maps: it publishes its want until the idle engine gives its
    pages back (giving back only unused budget and the reserve is not enough)."""
    from kvcached.limits import DeviceBudget

    client.generate(batch_prompts("c"), SHORT)  # distinct prompts: the cache fills up to its bound
    time.sleep(1.0)
    before = record().mapped
    out: Dict[str, Any] = {"mapped_before": before}
    mapped = sum(r.mapped for r in DeviceBudget("cpu", 1).members())  # every live instance of this user here
    cfg = {"name": record().name + "_peer", "pages": 256, "page": 4096, "budget_bytes": mapped + 1, "max_reserved": 0}
    peer = subprocess.Popen(
        [sys.executable, LIMITS_WORKER, json.dumps(cfg)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )

    def call(op: str, **kw: Any) -> Dict[str, Any]:
        peer.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        peer.stdin.flush()
        return json.loads(peer.stdout.readline())

    try:
        assert "ready" in json.loads(peer.stdout.readline())
        t0 = time.monotonic()
        out["published"] = call("short", need=before)["published"]
        # Until only the padding page (and at most one more) is left.
        while record().mapped > 2 * bpp and time.monotonic() - t0 < 15:
            call("short", need=before)  # renewed, as a scheduler's missing steps would
            time.sleep(0.2)
        out["given_back_s"] = round(time.monotonic() - t0, 2)
        time.sleep(0.5)
        out["mapped_after"] = record().mapped
        call("exit")
    finally:
        if peer.poll() is None:
            peer.kill()
        peer.wait(10)
    return out


def main() -> int:
    cfg = json.load(open(sys.argv[1]))
    out_path = sys.argv[2]
    kv = bool(cfg["kvcached"])
    kw: Dict[str, Any] = dict(
        device="cpu",
        attention_backend="torch_native",
        sampling_backend="pytorch",
        disable_cuda_graph=True,
        page_size=cfg["page_size"],
        log_level=cfg.get("log_level", "warning"),
    )
    if cfg.get("max_total_tokens"):
        kw["max_total_tokens"] = cfg["max_total_tokens"]
    res: Dict[str, Any] = {"config": cfg}
    t0 = time.monotonic()
    client = ServerClient(cfg, kw) if cfg.get("server") else EngineClient(cfg, kw)
    res["start_s"] = round(time.monotonic() - t0, 1)
    try:
        res["max_total_num_tokens"] = client.max_total_num_tokens()

        def report(tag: str) -> None:
            r = client.report()
            if r is not None:
                res.setdefault("reports", {})[tag] = r

        def record():
            from kvcached.limits import read_record

            return read_record(res["record_name"])

        if kv:
            sched_pid = client.scheduler_pid()
            res["scheduler_pid"] = sched_pid
            res["record_name"] = cfg["record_name"]
            res["record_start"] = dataclasses.asdict(record())
            res["memfd_pages_start"] = memfd_pages(sched_pid)
            # A real vLLM given instead of the stub: its files mapped in the scheduler (it was imported).
            res["vllm_in_scheduler"] = maps_mentioning(sched_pid, cfg.get("vllm_dir"))
            report("start")

        # W1: three short prompts.
        outs = client.generate(PROMPTS, SHORT)
        res["w1"] = [o["output_ids"] for o in outs]
        if cfg.get("server"):
            res["openai_stream"] = openai_stream(client, cfg["model"])
        # W2: prefix cache: a 41-token prompt, again (hit), flush, again (miss).
        first = client.generate(LONG_PROMPT, SHORT)
        again = client.generate(LONG_PROMPT, SHORT)
        res["flush"] = flush_when_idle(client)
        after = client.generate(LONG_PROMPT, SHORT)
        res["w2"] = [first["output_ids"], again["output_ids"], after["output_ids"]]
        res["w2_cached"] = [x["meta_info"].get("cached_tokens") for x in (first, again, after)]

        # W3: a batch of 8 x (up to 25 + 96) tokens; with kvcached, sample the
        # mapped memory from the record and the scheduler's /proc maps meanwhile.
        if kv:
            rec_s = Sampler(lambda: record().mapped)
            # A maps read takes ~10 ms and the batch a fraction of a second on a fast machine:
            # the memfd count may miss the peak, so each reading is framed by the record's
            # mapped bytes read just before and after it (it must lie between them).
            pairs: List[List[int]] = []

            def memfd_and_mapped() -> int:
                before = record().mapped
                n = memfd_pages(sched_pid)
                pairs.append([before, n, record().mapped])
                return n

            maps_s = Sampler(memfd_and_mapped, period=0.01)
            with rec_s, maps_s:
                outs = client.generate(batch_prompts("a"), BATCH)
            res["w3_peak_mapped_bytes"] = rec_s.peak
            res["w3_peak_memfd_pages"] = maps_s.peak
            res["w3_memfd_mapped_pairs"] = pairs
            res["w3_samples"] = [rec_s.samples, maps_s.samples]
            report("after_w3")
            res["w3_flush"] = flush_when_idle(client)
            time.sleep(1.5)  # idle turns: the strict leak check runs, retired pages are released
            report("idle_after_flush")
            res["idle_mapped_bytes"] = record().mapped
            res["idle_memfd_pages"] = memfd_pages(sched_pid)
        else:
            outs = client.generate(batch_prompts("a"), BATCH)
        res["w3"] = [o["output_ids"] for o in outs]

        # W4: a batch during which `kvctl limit` lowers the instance's limit.
        if kv and cfg.get("limit_bytes"):
            kvctl = os.path.join(os.path.dirname(sys.executable), "kvctl")
            box: Dict[str, Any] = {}

            def run_batch() -> None:
                try:
                    box["outs"] = client.generate(batch_prompts("b"), BATCH)
                except BaseException as e:  # reported below
                    box["error"] = repr(e)

            # A daemon: should the engine die, the driver reports it instead of waiting on the request.
            th = threading.Thread(target=run_batch, daemon=True)
            th.start()
            deadline = time.monotonic() + 60
            while record().used < cfg["limit_bytes"] and time.monotonic() < deadline and th.is_alive():
                time.sleep(0.002)
            res["w4_used_when_limited"] = record().used
            cp = subprocess.run(
                [kvctl, "limit", res["record_name"], str(cfg["limit_bytes"])],
                capture_output=True,
                text=True,
                timeout=60,
            )
            res["kvctl_limit"] = [cp.returncode, cp.stdout.strip(), cp.stderr.strip()]
            # The batch kept allocating while kvctl started: what was mapped when the limit landed.
            res["w4_mapped_when_limited"] = record().mapped
            with Sampler(lambda: record().mapped) as lim_s:
                th.join(timeout=600)
            res["w4_alive"] = th.is_alive()
            res["w4_error"] = box.get("error")
            res["w4"] = [o["output_ids"] for o in box.get("outs", [])]
            res["w4_peak_mapped_after_limit"] = lim_s.peak
            # Still serving under the lower limit, then with it raised again.
            res["w4_more"] = [o["output_ids"] for o in client.generate(PROMPTS, SHORT)]
            # The pool shrinks to the limit (cached prefixes give their pages back).
            t1 = time.monotonic()
            while record().mapped > cfg["limit_bytes"] and time.monotonic() - t1 < 20:
                time.sleep(0.01)
            res["w4_shrink_s"] = round(time.monotonic() - t1, 3)
            res["w4_record_limited"] = dataclasses.asdict(record())
            report("limited")
            rec = record()
            back = min(rec.total, rec.device_bytes) if rec.device_bytes else rec.total  # the limit it started with
            cp = subprocess.run(
                [kvctl, "limit", res["record_name"], str(back)], capture_output=True, text=True, timeout=60
            )
            res["kvctl_raise"] = [cp.returncode, cp.stdout.strip(), cp.stderr.strip()]
            res["w4_raised"] = [o["output_ids"] for o in client.generate(PROMPTS, SHORT)]
            report("after_w4")
        else:
            outs = client.generate(batch_prompts("b"), BATCH)
            res["w4"] = [o["output_ids"] for o in outs]
        if kv:
            cp = subprocess.run(
                [os.path.join(os.path.dirname(sys.executable), "kvctl"), "list", "--json"],
                capture_output=True,
                text=True,
                timeout=60,
            )
            res["kvctl_list"] = [cp.returncode, cp.stdout, cp.stderr.strip()]
            time.sleep(1.0)
            report("end")
            res["alive_at_end"] = client.generate(PROMPTS[:1], SHORT)[0]["output_ids"]
        if kv and cfg.get("peer_want_bpp"):
            res["w5"] = peer_wants_memory(client, record, int(cfg["peer_want_bpp"]))
            report("after_peer_want")
            res["w5"]["alive_after"] = client.generate(PROMPTS[:1], SHORT)[0]["output_ids"]
    finally:
        client.close()
    from kvcached.integration.patch_base import summary_of

    res["driver_patches"] = summary_of("vLLM")  # kvcached's vLLM patches in this (Engine) process
    with open(out_path, "w") as f:
        json.dump(res, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
