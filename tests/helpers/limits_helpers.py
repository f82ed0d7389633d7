"""Shared pieces of the limits tests: instance worker processes, kvctl runs,
unique record names."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from typing import Any, Dict, List, Optional

from kvcached import _C

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "limits_worker.py")
PAGE = 64 * 1024
LAYERS = 2
BPP = PAGE * LAYERS * 2  # bytes per kvcached page over all layers, K and V


def unique_prefix() -> str:
    """A record-name prefix no other test run uses (also a budget scope)."""
    return f"kvt{os.getpid()}x{uuid.uuid4().hex[:6]}_"


def two_in_one_budget(make_pa: Any, prefix: str, budget_pages: int) -> tuple:
    """``(budget, pa_a, pa_b, a, b)``: instances ``<prefix>a`` and ``<prefix>b`` over the
    allocators ``make_pa(0)`` and ``make_pa(1)``, in one host budget of ``budget_pages``
    pages, a quantum of one page each (close both)."""
    from kvcached.limits import DeviceBudget, InstanceLimits

    budget = DeviceBudget("cpu", budget_pages * BPP, scope=prefix)
    pas = make_pa(0), make_pa(1)
    inst = [
        InstanceLimits.for_page_allocator(
            pa, engine="t", device="cpu", name=prefix + k, budget=budget, quantum_bytes=BPP
        )
        for pa, k in zip(pas, "ab")
    ]
    return (budget, *pas, *inst)


class Worker:
    """An instance in a child process (tests/helpers/limits_worker.py)."""

    def __init__(self, **cfg: Any) -> None:
        self.name = cfg["name"]
        self.proc = subprocess.Popen(
            [sys.executable, WORKER, json.dumps(cfg)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.name} failed to start: {self.proc.stderr.read()}")
        self.ready: Dict[str, Any] = json.loads(line)["ready"]
        self.pid = self.ready["pid"]

    def call(self, op: str, **kw: Any) -> Dict[str, Any]:
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.name} died: {self.proc.stderr.read()}")
        return json.loads(line)

    def send(self, op: str, **kw: Any) -> None:
        """Starts a command without waiting for its answer (see ``result``)."""
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()

    def result(self) -> Dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.name} died: {self.proc.stderr.read()}")
        return json.loads(line)

    def wait_stderr(self, text: str, timeout: float = 30.0) -> str:
        """Reads the worker's stderr until a line contains ``text``; returns that line."""
        import select

        end = time.monotonic() + timeout
        while time.monotonic() < end:
            ready, _, _ = select.select([self.proc.stderr], [], [], max(0.0, end - time.monotonic()))
            if not ready:
                break
            line = self.proc.stderr.readline()
            if not line:
                break
            if text in line:
                return line
        raise AssertionError(f"worker {self.name} did not log {text!r} within {timeout} s")

    def exit(self) -> None:
        self.call("exit")
        self.proc.wait(10)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            try:
                f.close()
            except Exception:
                pass


def kvctl(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    """Runs the kvctl console script as an operator would."""
    return subprocess.run(
        [sys.executable, "-m", "kvcached.cli.kvctl", *args], capture_output=True, text=True, timeout=timeout
    )


def kvctl_list_json() -> List[Dict[str, Any]]:
    r = kvctl("list", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def remove_records(prefix: str) -> None:
    """Deletes every record whose name starts with ``prefix`` and the budget
    lock file of that scope (test cleanup)."""
    from kvcached.limits import DeviceBudget

    for n in _C.list_mem_info_records():
        if n.startswith(prefix):
            try:
                _C.delete_mem_info_record(n, True)
            except _C.KvcachedError:
                pass
    # And what no record API lists: a record truncated to 0 bytes, a name squatted by
    # another user, the other test users' budget locks of this scope (tests/limits/test_security_*).
    scope_tag = os.path.basename(DeviceBudget("cpu", 1, scope=prefix).lock_path).rsplit("-", 1)[1].split(".")[0]
    for name in os.listdir("/dev/shm"):
        if name.startswith(prefix) or (name.startswith("kvcached-budget-u") and f"-{scope_tag}." in name):
            try:
                os.unlink(os.path.join("/dev/shm", name))
            except (FileNotFoundError, PermissionError):
                pass


def record_state(name: str) -> Optional[tuple]:
    """(revision, limit) of a record, or None if it is gone."""
    try:
        s = _C.MemInfoTracker.open(name).snapshot()
    except _C.KvcachedError:
        return None
    return (s.revision, s.limit)


# Byte offsets of the record fields (csrc/include/kvcached/mem_info_tracker.hpp),
# for tests that corrupt or forge records the way a crash or another user could.
RECORD_SIZE = 312
FIELDS = {
    "magic": (0, "<Q"),
    "version": (8, "<I"),
    "record_size": (12, "<I"),
    "device_type": (16, "<i"),
    "device_index": (20, "<i"),
    "owner_pid": (24, "<i"),
    "owner_start_time": (32, "<Q"),
    "seq": (40, "<I"),
    "revision": (44, "<I"),
    "limit": (48, "<q"),
    "used": (56, "<q"),
    "prealloc": (64, "<q"),
    "total": (72, "<q"),
    "updated_ns": (80, "<q"),
    "name": (88, "128s"),
    "engine": (216, "32s"),
    "granted": (248, "<q"),
    "device_bytes": (256, "<q"),
    "applied_revision": (264, "<I"),
    "wanted": (272, "<q"),
    "wanted_ns": (280, "<q"),
    "quarantined": (288, "<q"),
    # Version 2: the statistics block after the 312 bytes of version 1.
    "stats_magic": (312, "<Q"),
    "stats_version": (320, "<I"),
    "stats_size": (324, "<I"),
    "stats_counter_slots": (328, "<I"),
    "want_since_ns": (344, "<q"),
    "counter_pages_mapped": (352, "<Q"),
    "counter_pages_unmapped": (360, "<Q"),
    "hist_map_bucket0": (480, "<Q"),
}
RECORD_V2_SIZE = 1056


def shm_path(name: str) -> str:
    return os.path.join("/dev/shm", name)


def poke(record: str, **fields: Any) -> None:
    """Writes raw field values into the record file ``record`` (no lock, no seqlock)."""
    import struct

    fd = os.open(shm_path(record), os.O_RDWR | os.O_NOFOLLOW)
    try:
        for field, value in fields.items():
            off, fmt = FIELDS[field]
            os.pwrite(fd, struct.pack(fmt, value), off)
    finally:
        os.close(fd)


def peek(record: str, field: str) -> Any:
    import struct

    off, fmt = FIELDS[field]
    with open(shm_path(record), "rb") as f:
        f.seek(off)
        return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]
