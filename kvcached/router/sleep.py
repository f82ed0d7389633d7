"""What putting a model to sleep means, one class per way (``sleep:`` in the config).

Every way gives the KV cache back through kvcached first (the instance's limit
set to 0: idle cached blocks are evicted and their pages unmapped, so a peer on
the same device can use them at once), then:

* ``stop``: the engine process group is stopped; waking starts it again and
  waits until it is healthy. Frees weights and everything else; works on every
  engine and device (the only full sleep on CPU, where neither engine can sleep).
* ``engine``: the engine's own sleep (vLLM ``POST /sleep?level=1`` /
  ``POST /wake_up``; SGLang ``/release_memory_occupation`` /
  ``/resume_memory_occupation``). Needs the engine's sleep option, which
  kvcached refuses today (docs/ROUTER.md says why), so only with ``kvcached: false``.
* ``kv``: only the KV give-back; weights stay resident, waking restores the
  limit (milliseconds).
"""

from __future__ import annotations

import json
import logging
from typing import Optional

from kvcached.router.engines import SLEEP_CALLS
from kvcached.router.supervisor import WAKING, ModelEngine, http_call

log = logging.getLogger("kvcached.router")

GIVE_BACK_WAIT_S = 2.0  # how long the owner has to acknowledge the limit of 0


class SleepError(RuntimeError):
    """A sleep or wake step failed; the router restarts the engine."""


def give_back_kv(engine: ModelEngine) -> Optional[int]:
    """Sets the engine's kvcached limit to 0 and remembers the old one; returns the
    bytes still mapped right after (None when the engine has no kvcached record)."""
    if not engine.spec.kvcached:
        return None
    from kvcached.control import set_instance_memory_limit
    from kvcached.limits.records import read_record

    try:
        before = read_record(engine.spec.instance)
    except Exception as e:  # no record: kvcached is not active in that engine
        log.warning("%s: no kvcached record %s to give KV back through (%s)", engine.name, engine.spec.instance, e)
        return None
    if not before.alive or before.problem:
        return None
    engine.saved_kv_limit = before.limit
    r = set_instance_memory_limit(0, name=engine.spec.instance, wait_s=GIVE_BACK_WAIT_S)
    log.info("%s: KV limit 0 (was %d bytes): %s, %s mapped", engine.name, before.limit, r["status"], r["mapped_bytes"])
    return r["mapped_bytes"]


def restore_kv(engine: ModelEngine) -> None:
    """Puts back the limit ``give_back_kv`` saved (same process only)."""
    limit, engine.saved_kv_limit = engine.saved_kv_limit, None
    if limit is None:
        return
    from kvcached.control import set_instance_memory_limit

    r = set_instance_memory_limit(limit, name=engine.spec.instance, wait_s=GIVE_BACK_WAIT_S)
    if r["status"] not in ("applied", "deferred"):
        raise SleepError(f"restoring the KV limit of {engine.spec.instance} failed: {r['message']}")


class SleepMode:
    """One way to sleep and wake; ``sleep`` and ``wake`` raise SleepError on failure."""

    name = ""

    def sleep(self, engine: ModelEngine) -> None:
        raise NotImplementedError

    def wake(self, engine: ModelEngine, timeout: float) -> None:
        raise NotImplementedError


class StopSleep(SleepMode):
    name = "stop"

    def sleep(self, engine: ModelEngine) -> None:
        give_back_kv(engine)
        engine.saved_kv_limit = None  # the next process starts with its own record
        engine.terminate()

    def wake(self, engine: ModelEngine, timeout: float) -> None:
        if not engine.spawn(state=WAKING):
            raise SleepError("the router is shutting down")
        if not engine.wait_healthy(timeout):
            raise SleepError(f"engine not healthy within {timeout:.0f} s of its restart")


class EngineSleep(SleepMode):
    name = "engine"

    def _call(self, engine: ModelEngine, which: int, timeout: float) -> None:
        method, path, body = SLEEP_CALLS[engine.spec.engine][which]
        data = None if body is None else json.dumps(body).encode()
        host, port, sockets = engine.endpoint()
        status = http_call(host, port, method, path, data, timeout=timeout, sockets=sockets)
        if status != 200:
            raise SleepError(f"{method} {path} answered {status or 'nothing'}")

    def sleep(self, engine: ModelEngine) -> None:
        give_back_kv(engine)
        self._call(engine, 0, timeout=300)

    def wake(self, engine: ModelEngine, timeout: float) -> None:
        self._call(engine, 1, timeout=timeout)
        restore_kv(engine)


class KVSleep(SleepMode):
    name = "kv"

    def sleep(self, engine: ModelEngine) -> None:
        give_back_kv(engine)

    def wake(self, engine: ModelEngine, timeout: float) -> None:
        restore_kv(engine)


MODES = {m.name: m for m in (StopSleep(), EngineSleep(), KVSleep())}


def sleep_mode_for(engine: ModelEngine) -> SleepMode:
    return MODES[engine.spec.sleep_mode()]
