"""Environment knobs of the IPC fan-out, read when a listener or coordinator is built.

The variables are documented in kvcached.config (the table of all of them):

  KVCACHED_IPC_NAME     instance name; the scheduler and its workers must agree on it,
                        and two engines on one host must differ (default "kvcached"
                        for a fan-out built without an engine: kvcached.naming, rule 4).
  KVCACHED_IPC_TIMEOUT  seconds one request may take before the coordinator treats the
                        rank as not answering (default 10). Recovery (rollback, abort,
                        commit retries) gets RECOVERY_FACTOR times this.
                        A rank whose worker process died is reported at once, not
                        after this (kvcached.ipc.peer); a live one gets all of it.
  KVCACHED_PP_SIZE      pipeline stages a coordinator covers when pp_rank == -1 (default 1).
  KVCACHED_IPC_SPIN_US  microseconds the coordinator polls for a reply before it sleeps
                        (default 50; 0 = sleep at once). See kvcached.ipc.transport.
"""

from __future__ import annotations

from kvcached import config, naming

DEFAULT_IPC_NAME = naming.DEFAULT_IPC_NAME
DEFAULT_TIMEOUT_S = config.DEFAULT_IPC_TIMEOUT_S
# Recovery waits longer than one request: a rank that is merely slow must get the
# chance to run the queued rollback/commit, or a recoverable case becomes fail-closed.
RECOVERY_FACTOR = 3.0
DEFAULT_SPIN_US = int(config.DEFAULT_IPC_SPIN_US)
# How long the coordinator waits for a socket that no worker process has answered
# on yet (missing or refused; capped by the request timeout). Every integration
# starts its listeners before the first map, so this covers a listener being bound
# right now, not a worker still loading; a longer wait only delays noticing a worker
# that died before we met it (upstream fails such a connect at once).
LISTENER_WAIT_S = 1.0


def ipc_name() -> str:
    """KVCACHED_IPC_NAME or "kvcached" (kvcached.naming.ipc_name)."""
    return naming.ipc_name()


def ipc_timeout() -> float:
    return config.ipc_timeout_s()


def pp_size() -> int:
    return config.pp_size()


def ipc_spin_s() -> float:
    return config.ipc_spin_us() * 1e-6
