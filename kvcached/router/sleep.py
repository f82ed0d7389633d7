"""What putting a model to sleep means, one class per way (``sleep:`` in the config).

* ``stop``: the KV cache is given back through kvcached (the instance's limit
  set to 0: idle cached blocks are evicted and their pages unmapped, so a peer on
  the same device can use them at once), then the engine process group is
  stopped; waking starts it again and waits until it is healthy. Frees weights
  and everything else; works on every engine and device (the only full sleep on
  CPU, where neither engine can sleep).
* ``engine``: the engine's own sleep (vLLM ``POST /sleep?level=1`` /
  ``POST /wake_up``; SGLang ``/release_memory_occupation`` /
  ``/resume_memory_occupation``): the weights go to host memory, the process
  stays. Needs the engine's sleep options (``--enable-sleep-mode``;
  ``--enable-memory-saver --enable-weights-cpu-backup``: GPU only). With kvcached the engine gives its KV
  pages back itself as part of that sleep (kvcached's engine patches: nothing is
  mapped but the null block's page, the limit stays as the operator set it) and
  maps on demand again after the wake; the router only reads the record after.
  The wake call returns once the weights are back, so the request is sent to a
  model whose weights are resident.
* ``kv``: only the KV give-back (limit 0); weights stay resident, waking
  restores the limit (milliseconds).

An engine the router has not started yet (``max_awake`` held it back) is woken
by starting it, whatever its mode.
"""

from __future__ import annotations

import json
import logging
from typing import Optional, Tuple

from kvcached.router.engines import IDLE_CALLS, SLEEP_CALLS
from kvcached.router.supervisor import WAKING, ModelEngine, http_call

log = logging.getLogger("kvcached.router")

GIVE_BACK_WAIT_S = 2.0  # how long the owner has to acknowledge the limit of 0


class SleepError(RuntimeError):
    """A sleep or wake step failed; the router restarts the engine."""


class NotIdle(SleepError):
    """The engine still had work when it was to sleep; nothing changed, it stays ready."""


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


def kv_mapped_bytes(engine: ModelEngine) -> Optional[int]:
    """Bytes the engine's kvcached record maps now (None: no live record)."""
    from kvcached.limits.records import read_record

    try:
        rec = read_record(engine.spec.instance)
    except Exception:
        return None
    return int(rec.mapped) if rec.alive and not rec.problem else None


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
            if not engine.alive():
                raise SleepError(f"engine exited during its restart (log {engine.log_path})")
            raise SleepError(f"engine not healthy within {timeout:.0f} s of its restart")


class EngineSleep(SleepMode):
    name = "engine"

    def _call(self, engine: ModelEngine, call: Tuple[str, str, object], timeout: float) -> int:
        method, path, body = call
        data = None if body is None else json.dumps(body).encode()
        host, port, sockets = engine.endpoint()
        return http_call(host, port, method, path, data, timeout=timeout, sockets=sockets)

    def _must(self, engine: ModelEngine, which: int, timeout: float) -> None:
        method, path, body = SLEEP_CALLS[engine.spec.engine][which]
        status = self._call(engine, (method, path, body), timeout)
        if status != 200:
            raise SleepError(f"{method} {path} answered {status or 'nothing'}")

    def sleep(self, engine: ModelEngine) -> None:
        idle = IDLE_CALLS.get(engine.spec.engine)
        if idle is not None and self._call(engine, idle, timeout=60) != 200:
            raise NotIdle(f"{idle[0]} {idle[1]} did not find the engine idle")
        # With kvcached the engine's own sleep gives every KV page back (its patches; the
        # limit stays the operator's): a limit of 0 written from here would only be undone.
        self._must(engine, 0, timeout=300)
        mapped = kv_mapped_bytes(engine) if engine.spec.kvcached else None
        if mapped is not None:
            log.info("%s: engine asleep, %d KiB of KV still mapped", engine.name, mapped >> 10)

    def wake(self, engine: ModelEngine, timeout: float) -> None:
        self._must(engine, 1, timeout=timeout)


class KVSleep(SleepMode):
    name = "kv"

    def sleep(self, engine: ModelEngine) -> None:
        give_back_kv(engine)

    def wake(self, engine: ModelEngine, timeout: float) -> None:
        restore_kv(engine)


MODES = {m.name: m for m in (StopSleep(), EngineSleep(), KVSleep())}


def sleep_mode_for(engine: ModelEngine) -> SleepMode:
    return MODES[engine.spec.sleep_mode()]


def wake_mode_for(engine: ModelEngine) -> SleepMode:
    """How to wake: the model's mode, or a start for an engine that has no process
    (held back at the router's start by ``max_awake``)."""
    return MODES["stop"] if engine.proc is None else sleep_mode_for(engine)
