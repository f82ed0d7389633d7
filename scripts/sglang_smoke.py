#!/usr/bin/env python3
"""Offline smoke test of SGLang on the CPU (no kvcached involved): 0.5.22+, since older
releases place paged slots (``page_size`` 16) with Triton only and cannot run paged on a CPU.

Run with a venv made by ``scripts/setup_sglang_venv.sh``::

    .venvs/sglang/bin/python scripts/sglang_smoke.py [--skip-engine] [--skip-server]

What it proves:
  * ``sglang.Engine`` runs a tiny random Llama (built by ``kvcached/testing/tiny_model.py``)
    on device="cpu" with torch_native attention, greedily, on 3 prompts; two fresh engine
    runs each with page_size 1 and page_size 16 give identical token ids (and the two page
    sizes agree with each other);
  * prefix-cache hits are visible as ``meta_info["cached_tokens"]``, and ``flush_cache``
    empties the radix cache (the same prompt then reports 0 cached tokens);
  * ``python -m sglang.launch_server`` with the same options serves ``/generate`` on
    127.0.0.1 and answers with the same tokens; ``/flush_cache`` works there too.

The test-only stub ``tests/engines/sglang_stubs`` (``vllm._custom_ops.rotary_embedding``)
is put on PYTHONPATH for this process and every process SGLang spawns. Prints one JSON
summary line at the end (``SMOKE_SUMMARY {...}``) and exits non-zero on any mismatch.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STUBS = os.path.join(REPO, "tests", "engines", "sglang_stubs")

PROMPTS = [
    "hello world the quick brown fox",
    "tell me a story about the lazy dog",
    "one two three four five six seven eight nine ten",
]
# 41 tokens (BOS + 40 words): spans two full 16-token pages, so page_size 16 can hit too.
LONG_PROMPT = " ".join(f"w{i}" for i in range(40))
SAMPLING = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}

# Options shared by Engine(...) and launch_server (CLI spelling in SERVER_FLAGS).
ENGINE_KW = dict(
    device="cpu",
    attention_backend="torch_native",
    sampling_backend="pytorch",
    disable_cuda_graph=True,
    max_total_tokens=2048,
)


def _env_setup() -> None:
    """Stub on PYTHONPATH (inherited by spawned scheduler/detokenizer), hub offline."""
    pp = os.environ.get("PYTHONPATH", "")
    if STUBS not in pp.split(os.pathsep):
        os.environ["PYTHONPATH"] = STUBS + (os.pathsep + pp if pp else "")
    if STUBS not in sys.path:
        sys.path.insert(0, STUBS)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _load_tiny_model_builder():
    # Load by file path: importing the `kvcached` package itself could need its C extension.
    p = os.path.join(REPO, "kvcached", "testing", "tiny_model.py")
    spec = importlib.util.spec_from_file_location("_kvcached_tiny_model", p)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.build_tiny_llama


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_engine(model: str, page_size: int) -> dict:
    import sglang

    t0 = time.monotonic()
    engine = sglang.Engine(model_path=model, page_size=page_size, log_level="error", **ENGINE_KW)
    t_start = time.monotonic() - t0
    try:
        t1 = time.monotonic()
        outs = engine.generate(prompt=PROMPTS, sampling_params=SAMPLING)
        t_gen = time.monotonic() - t1
        ids = [o["output_ids"] for o in outs]
        texts = [o["text"] for o in outs]
        cached_first = [o["meta_info"].get("cached_tokens") for o in outs]
        prompt_tokens = [o["meta_info"].get("prompt_tokens") for o in outs]
        # Prefix cache: a 41-token prompt, then the same prompt again (only whole pages of
        # the prompt are matched, and never the last prompt token).
        first = engine.generate(prompt=LONG_PROMPT, sampling_params=SAMPLING)
        cached_long_first = first["meta_info"].get("cached_tokens")
        again = engine.generate(prompt=LONG_PROMPT, sampling_params=SAMPLING)
        cached_again = again["meta_info"].get("cached_tokens")
        same_again = again["output_ids"] == first["output_ids"]
        flushed = engine.flush_cache()
        after = engine.generate(prompt=LONG_PROMPT, sampling_params=SAMPLING)
        cached_after_flush = after["meta_info"].get("cached_tokens")
        same_after_flush = after["output_ids"] == first["output_ids"]
        info = engine.get_server_info()
    finally:
        t2 = time.monotonic()
        engine.shutdown()
        t_shutdown = time.monotonic() - t2
    return dict(
        page_size=page_size,
        output_ids=ids,
        texts=texts,
        prompt_tokens=prompt_tokens,
        cached_tokens_first=cached_first,
        long_prompt_tokens=first["meta_info"].get("prompt_tokens"),
        long_output_ids=first["output_ids"],
        cached_tokens_long_first=cached_long_first,
        cached_tokens_repeat=cached_again,
        cached_tokens_after_flush=cached_after_flush,
        flush_result=str(getattr(flushed, "success", flushed)),
        same_ids_repeat=same_again,
        same_ids_after_flush=same_after_flush,
        max_total_num_tokens=info.get("max_total_num_tokens"),
        dtype=info.get("dtype"),
        start_s=round(t_start, 1),
        generate_s=round(t_gen, 2),
        shutdown_s=round(t_shutdown, 1),
    )


def _post(url: str, body: dict | None = None, timeout: float = 60.0):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST" if data is not None else "GET")
    req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        raw = r.read().decode()
    try:
        return r.status, json.loads(raw)
    except json.JSONDecodeError:
        return r.status, raw


def run_server(model: str, page_size: int, log_path: str) -> dict:
    port = _free_port()
    flags = [
        "--model-path",
        model,
        "--device",
        "cpu",
        "--attention-backend",
        "torch_native",
        "--sampling-backend",
        "pytorch",
        "--disable-cuda-graph",
        "--max-total-tokens",
        "2048",
        "--page-size",
        str(page_size),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warning",
    ]
    cmd = [sys.executable, "-m", "sglang.launch_server", *flags]
    base = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    res: dict = dict(cmd=" ".join(cmd[1:]), log=log_path)
    try:
        ready = False
        while time.monotonic() - t0 < 300:
            if proc.poll() is not None:
                raise RuntimeError(f"launch_server exited rc={proc.returncode}; see {log_path}")
            try:
                st, _ = _post(base + "/health_generate", None, timeout=30)
                if st == 200:
                    ready = True
                    break
            except Exception:
                pass
            time.sleep(0.5)
        if not ready:
            raise RuntimeError(f"launch_server not ready after 300 s; see {log_path}")
        res["ready_s"] = round(time.monotonic() - t0, 1)
        t1 = time.monotonic()
        _, out = _post(base + "/generate", {"text": PROMPTS[0], "sampling_params": SAMPLING})
        res["generate_s"] = round(time.monotonic() - t1, 2)
        res["output_ids"] = out["output_ids"]
        res["cached_tokens"] = out["meta_info"].get("cached_tokens")
        long_req = {"text": LONG_PROMPT, "sampling_params": SAMPLING}
        _, first = _post(base + "/generate", long_req)
        res["long_output_ids"] = first["output_ids"]
        _, again = _post(base + "/generate", long_req)
        res["cached_tokens_repeat"] = again["meta_info"].get("cached_tokens")
        st, body = _post(base + "/flush_cache", {})
        res["flush_cache"] = [st, body if isinstance(body, str) else json.dumps(body)]
        _, after = _post(base + "/generate", long_req)
        res["cached_tokens_after_flush"] = after["meta_info"].get("cached_tokens")
        _, info = _post(base + "/server_info", None)
        mtt = info.get("max_total_num_tokens")
        if mtt is None and info.get("internal_states"):
            mtt = info["internal_states"][0].get("max_total_num_tokens")
        res["max_total_num_tokens"] = mtt
    finally:
        t2 = time.monotonic()
        try:
            os.killpg(proc.pid, 15)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
        res["stop_s"] = round(time.monotonic() - t2, 1)
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--skip-server", action="store_true")
    ap.add_argument("--workdir", default=None, help="keep model and logs here")
    a = ap.parse_args()
    _env_setup()

    work = a.workdir or tempfile.mkdtemp(prefix="kvcached_sglang_smoke_")
    os.makedirs(work, exist_ok=True)
    model = os.path.join(work, "tiny-llama")
    t0 = time.monotonic()
    _load_tiny_model_builder()(model, seed=0, vocab_size=512, hidden_size=64)
    summary: dict = {"model": model, "model_build_s": round(time.monotonic() - t0, 2)}
    ok = True

    if not a.skip_engine:
        runs = {}
        for ps in (1, 16):
            r1 = run_engine(model, ps)
            r2 = run_engine(model, ps)
            same = r1["output_ids"] == r2["output_ids"]
            print(
                f"page_size={ps}: run1 start {r1['start_s']}s gen {r1['generate_s']}s, "
                f"run2 start {r2['start_s']}s gen {r2['generate_s']}s, identical={same}",
                flush=True,
            )
            for r in (r1, r2):
                ok &= r["same_ids_repeat"] and r["same_ids_after_flush"]
                ok &= (r["cached_tokens_repeat"] or 0) > 0 and r["cached_tokens_after_flush"] == 0
            ok &= same
            runs[ps] = (r1, r2)
        cross = runs[1][0]["output_ids"] == runs[16][0]["output_ids"]
        ok &= cross
        summary["engine"] = {str(k): v[0] for k, v in runs.items()}
        summary["engine_identical_across_runs"] = {
            str(k): v[0]["output_ids"] == v[1]["output_ids"] for k, v in runs.items()
        }
        summary["engine_identical_across_page_sizes"] = cross
        for k, v in runs.items():
            summary["engine"][str(k)]["second_run_start_s"] = v[1]["start_s"]

    if not a.skip_server:
        s = run_server(model, 16, os.path.join(work, "launch_server.log"))
        if not a.skip_engine:
            e16 = summary["engine"]["16"]
            s["same_ids_as_engine"] = (
                s["output_ids"] == e16["output_ids"][0] and s["long_output_ids"] == e16["long_output_ids"]
            )
            ok &= s["same_ids_as_engine"]
        ok &= (s["cached_tokens_repeat"] or 0) > 0 and s["cached_tokens_after_flush"] == 0
        summary["server"] = s

    summary["ok"] = bool(ok)
    print("SMOKE_SUMMARY " + json.dumps(summary), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
