"""A stand-alone worker process for tests and benchmarks of the IPC fan-out.

``python -m kvcached.testing.ipc_worker --name N --rank R [--pp-rank K] ...`` creates
KV tensors on the host backend (or none with ``--noop``), starts a WorkerListener,
prints ``READY <pid>``, serves until its stdin closes or it gets SIGTERM, then
stops the listener (drain, unlink), shuts the data plane down and prints
``STOPPED <True|False>``. Exit status 0 when the stop was clean.

``WorkerGroup`` starts one such process per (stage, rank) and stops them. Faults:
``--backend-fault op:nth[:count]`` arms the data plane's injection after the
tensors exist; ``--fd-headroom N`` makes page creation run out of file
descriptors (a real OutOfMemoryError); env ``KVCACHED_IPC_FAULT_INJECT`` arms
the listener's faults.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional, Sequence, Tuple

Key = Tuple[int, int]  # (pp_rank, rank)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvcached.testing.ipc_worker")
    ap.add_argument("--name", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--pp-rank", type=int, default=0)
    ap.add_argument("--page-size", type=int, default=64 * 1024)
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--contiguous", action="store_true")
    ap.add_argument("--noop", action="store_true", help="answer without touching memory (benchmark)")
    ap.add_argument("--backend-fault", default="", help="op:nth[:count] for kvcached._C.inject_fault")
    ap.add_argument(
        "--fd-headroom",
        type=int,
        default=-1,
        help="cap open files at the current count plus this many: page creation then "
        "fails with EMFILE, which the host backend reports as OutOfMemoryError",
    )
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")

    from kvcached import _C, vmm_ops
    from kvcached.ipc.executor import NullExecutor, VmmExecutor
    from kvcached.ipc.listener import WorkerListener

    capsules = None
    if not args.noop:
        _C.init_kvcached("cpu", args.page_size, args.contiguous)
        # The raw capsules keep the tensors alive; torch is not needed here.
        capsules = _C.create_kv_tensors(args.pages * args.page_size, args.layers, 2, 0)
        if args.backend_fault:
            op, nth, *count = args.backend_fault.split(":")
            _C.inject_fault(op, int(nth), int(count[0]) if count else 1)
    executor = NullExecutor() if args.noop else VmmExecutor()
    listener = WorkerListener(args.rank, args.pp_rank, args.name, executor=executor).start()

    def on_term(signum, frame):  # noqa: ARG001
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_term)
    if args.fd_headroom >= 0:
        import resource

        open_fds = len(os.listdir("/proc/self/fd"))
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (open_fds + args.fd_headroom, hard))
    print("READY", os.getpid(), flush=True)
    try:
        sys.stdin.buffer.read()  # until the parent closes our stdin
    except (SystemExit, KeyboardInterrupt):
        pass
    ok = listener.stop()
    if not args.noop:
        del capsules
        vmm_ops.shutdown_kvcached()  # warns about memory the driver would not release
    print("STOPPED", ok, flush=True)
    return 0 if ok else 3


class WorkerGroup:
    """``tp`` x ``pp`` worker processes of one IPC instance, for tests and benchmarks.

    ``env`` and ``args`` add environment variables / command-line arguments for
    single workers, keyed by (pp_rank, rank).
    """

    def __init__(
        self,
        name: str,
        tp: int,
        pp: int = 1,
        *,
        page_size: int = 64 * 1024,
        pages: int = 64,
        layers: int = 2,
        noop: bool = False,
        env: Optional[Dict[Key, Dict[str, str]]] = None,
        args: Optional[Dict[Key, List[str]]] = None,
        common_env: Optional[Dict[str, str]] = None,
    ) -> None:
        self.name, self.tp, self.pp = name, tp, pp
        self._base = ["--name", name, "--page-size", str(page_size), "--pages", str(pages), "--layers", str(layers)]
        if noop:
            self._base.append("--noop")
        self._env = env or {}
        self._args = args or {}
        self._common_env = common_env or {}
        self.procs: Dict[Key, subprocess.Popen] = {}
        self._stderr: Dict[Key, tempfile._TemporaryFileWrapper] = {}
        self.returncodes: Dict[Key, int] = {}
        self.outputs: Dict[Key, str] = {}

    def start(self) -> WorkerGroup:
        for k in range(self.pp):
            for r in range(self.tp):
                self._spawn((k, r))
        for key in list(self.procs):
            line = self.procs[key].stdout.readline()
            if not line.startswith("READY"):
                self.procs[key].wait(10)
                raise RuntimeError(f"worker {key} did not start: {line!r}\n{self.stderr(key)}")
        return self

    def _spawn(self, key: Key) -> None:
        env = dict(os.environ)
        env.update(self._common_env)
        env.update(self._env.get(key, {}))
        err = tempfile.TemporaryFile(mode="w+")
        self._stderr[key] = err
        cmd = [
            sys.executable,
            "-m",
            "kvcached.testing.ipc_worker",
            *self._base,
            "--rank",
            str(key[1]),
            "--pp-rank",
            str(key[0]),
            *self._args.get(key, []),
        ]
        self.procs[key] = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=env, text=True
        )

    def stderr(self, key: Key) -> str:
        f = self._stderr[key]
        f.seek(0)
        return f.read()

    def kill(self, key: Key) -> None:
        p = self.procs[key]
        p.kill()
        p.wait(10)
        self.returncodes[key] = p.returncode

    def wait_exit(self, key: Key, timeout: float = 10.0) -> int:
        self.returncodes[key] = self.procs[key].wait(timeout)
        return self.returncodes[key]

    def stop(self, timeout: float = 20.0) -> Dict[Key, int]:
        """Closes every worker's stdin (clean stop) and waits; returns exit codes."""
        for p in self.procs.values():
            if p.poll() is None and p.stdin and not p.stdin.closed:
                try:
                    p.stdin.close()
                except OSError:
                    pass
            p.stdin = None  # communicate() below must not touch it
        for key, p in self.procs.items():
            try:
                out, _ = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                out, _ = p.communicate()
            self.outputs[key] = out or ""
            self.returncodes[key] = p.returncode
        return dict(self.returncodes)

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in self._stderr.values():
            f.close()

    def __enter__(self) -> WorkerGroup:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop()
        finally:
            self.close()


if __name__ == "__main__":
    sys.exit(main())


def handle_baselines(states: Sequence[object]) -> Dict[Key, int]:
    """Per worker, the live backend handles that are not pages (the zero page):
    take it once before the test maps anything, then pass it to consistency_problems."""
    return {(s.pp_rank, s.rank): s.live_handles - s.mapped_pages * s.units_per_page for s in states if s.reachable}


def consistency_problems(states: Sequence[object], expected: Sequence[int], baselines: Dict[Key, int]) -> List[str]:
    """What is wrong with the workers' states (kvcached.ipc.protocol.WorkerState), if
    anything: every rank must map exactly ``expected``, hold no pending unmap
    transaction or quarantined handle, and hold exactly the handles its mapped
    pages need (no leak)."""
    problems = []
    want = sorted(set(expected))
    for s in states:
        key = (s.pp_rank, s.rank)
        if not s.reachable:
            problems.append(f"{key}: unreachable: {s.failure}")
            continue
        if sorted(s.mapped_offsets) != want:
            problems.append(f"{key}: maps {sorted(s.mapped_offsets)}, expected {want}")
        if s.prepared_pages or s.pending_transactions:
            problems.append(f"{key}: {s.pending_transactions} pending unmap transaction(s), {s.prepared_pages} page(s)")
        if s.quarantined:
            problems.append(f"{key}: {s.quarantined} quarantined handle(s)")
        if s.failed:
            problems.append(f"{key}: data plane failed closed: {s.failure}")
        handles = baselines[key] + s.mapped_pages * s.units_per_page
        if s.live_handles != handles:
            problems.append(f"{key}: {s.live_handles} live handles, {handles} expected (leak)")
    return problems
