"""Environment knobs of the IPC fan-out, read when a listener or coordinator is built.

  KVCACHED_IPC_NAME     instance name; the scheduler and its workers must agree on it,
                        and two engines on one host must differ (default "kvcached").
  KVCACHED_IPC_TIMEOUT  seconds one request may take before the coordinator treats the
                        rank as not answering (default 10). Recovery (rollback, abort,
                        commit retries) gets RECOVERY_FACTOR times this.
  KVCACHED_PP_SIZE      pipeline stages a coordinator covers when pp_rank == -1 (default 1).
  KVCACHED_IPC_SPIN_US  microseconds the coordinator polls for a reply before it sleeps
                        (default 50; 0 = sleep at once). See kvcached.ipc.transport.
"""

from __future__ import annotations

import os

DEFAULT_IPC_NAME = "kvcached"
DEFAULT_TIMEOUT_S = 10.0
# Recovery waits longer than one request: a rank that is merely slow must get the
# chance to run the queued rollback/commit, or a recoverable case becomes fail-closed.
RECOVERY_FACTOR = 3.0


def ipc_name() -> str:
    return os.environ.get("KVCACHED_IPC_NAME") or DEFAULT_IPC_NAME


def ipc_timeout() -> float:
    v = os.environ.get("KVCACHED_IPC_TIMEOUT")
    if v is None or v.strip() == "":
        return DEFAULT_TIMEOUT_S
    try:
        t = float(v)
    except ValueError:
        raise ValueError(f"KVCACHED_IPC_TIMEOUT={v!r} is not a number of seconds") from None
    if not t > 0:
        raise ValueError(f"KVCACHED_IPC_TIMEOUT={v!r} must be > 0 seconds")
    return t


def pp_size() -> int:
    v = os.environ.get("KVCACHED_PP_SIZE")
    if v is None or v.strip() == "":
        return 1
    try:
        n = int(v)
    except ValueError:
        raise ValueError(f"KVCACHED_PP_SIZE={v!r} is not an integer") from None
    if n < 1:
        raise ValueError(f"KVCACHED_PP_SIZE={v!r} must be >= 1")
    return n


DEFAULT_SPIN_US = 50


def ipc_spin_s() -> float:
    v = os.environ.get("KVCACHED_IPC_SPIN_US")
    if v is None or v.strip() == "":
        return DEFAULT_SPIN_US * 1e-6
    try:
        us = float(v)
    except ValueError:
        raise ValueError(f"KVCACHED_IPC_SPIN_US={v!r} is not a number of microseconds") from None
    if us < 0:
        raise ValueError(f"KVCACHED_IPC_SPIN_US={v!r} must be >= 0")
    return us * 1e-6
