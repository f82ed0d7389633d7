"""The router's core: one ``ModelEngine`` per model, the monitor thread
(supervision and the idle policy) and the sleep/wake transitions.

A request calls ``acquire(model)``: it waits, bounded by ``wake_timeout_s``,
until the engine serves (waking it if asleep), then ``release``. A model whose
engine has had no request in flight for ``idle_seconds`` is put to sleep, but
never while a request is in flight or waiting.

``max_awake`` (more models than the device holds): at most that many engines
hold their weights at once (starting, ready, waking, going to sleep, restarting,
or asleep with ``sleep: kv``). The router starts that many and leaves the rest
asleep without a process; a wake that would exceed the bound waits while the
monitor puts the least recently used idle model to sleep (one with
``idle_seconds`` and a sleep that frees its weights: ``engine`` or ``stop``),
then proceeds. Slots are counted under one lock taken inside an engine's
condition, never the other way round.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Dict, List, Optional

from kvcached.router.config import ConfigError, RouterConfig
from kvcached.router.logfiles import open_log, prepare_log_dir
from kvcached.router.metrics import RouterMetrics
from kvcached.router.sleep import NotIdle, SleepError, sleep_mode_for, wake_mode_for
from kvcached.router.supervisor import ASLEEP, BACKOFF, READY, SLEEPING, STARTING, WAKING, ModelEngine

log = logging.getLogger("kvcached.router")

STARTING_POLL_S = 0.5


def idle_due(engine: ModelEngine, now: float) -> bool:
    """The idle policy: ready, nothing in flight or waiting, idle for ``idle_seconds``."""
    idle = engine.spec.idle_seconds
    return (
        idle is not None
        and engine.state == READY
        and engine.inflight == 0
        and engine.waiting == 0
        and now - engine.last_activity >= idle
    )


# States in which an engine holds its weights on the device (see holds_weights).
_HOLDING = (STARTING, READY, SLEEPING, WAKING, BACKOFF)


def holds_weights(engine: ModelEngine) -> bool:
    """Whether the engine counts against ``max_awake``: any state but asleep or stopped,
    and asleep with ``sleep: kv`` (its weights stay resident) while its process lives."""
    if engine.state in _HOLDING:
        return True
    return engine.state == ASLEEP and engine.proc is not None and engine.spec.sleep_mode() == "kv"


def evictable(engine: ModelEngine) -> bool:
    """A model ``max_awake`` may put to sleep early: ready, nothing in flight or waiting,
    allowed to sleep (``idle_seconds``), and its sleep frees its weights."""
    return (
        engine.state == READY
        and engine.inflight == 0
        and engine.waiting == 0
        and engine.spec.idle_seconds is not None
        and engine.spec.sleep_mode() != "kv"
    )


def check_port_free(host: str, port: int, what: str) -> None:
    """Raises ConfigError (one line) when ``port`` cannot be bound."""
    if port == 0:
        return
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise ConfigError(f"{what}: port {port} on {host} is in use ({e.strerror}); pick another port") from None


class Router:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.metrics = RouterMetrics()
        self.engines: Dict[str, ModelEngine] = {
            m.name: ModelEngine(
                m,
                log_dir=config.log_dir,
                kvcached_env=config.kvcached_env,
                start_timeout_s=config.start_timeout_s,
                backoff_s=config.restart_backoff_s,
                backoff_max_s=config.restart_backoff_max_s,
                stop_timeout_s=config.stop_timeout_s,
            )
            for m in config.models
        }
        self._stop = threading.Event()
        self._poke = threading.Event()  # set by a crash noticed outside the monitor: restart without waiting
        self.interval = config.health_interval_s
        for e in self.engines.values():
            e.poke = self._poke.set
        self._monitor: Optional[threading.Thread] = None
        self._transitions: List[threading.Thread] = []
        self.max_awake = config.max_awake
        self._slots = threading.Lock()  # taken inside an engine's cond (never the reverse)

    # -- life cycle --------------------------------------------------------
    def start(self) -> None:
        """Checks the engine ports, then starts every engine and the monitor."""
        for e in self.engines.values():
            if e.spec.port:
                check_port_free("127.0.0.1", e.spec.port, f"model {e.name!r}")
        prepare_log_dir(self.config.log_dir)
        for e in self.engines.values():
            os.close(open_log(e.log_path))  # a planted link stops the start here, in one line
        for i, e in enumerate(self.engines.values()):
            if self.max_awake is None or i < self.max_awake:
                e.spawn()
            else:  # held back: started by the first request for it (wake_mode_for)
                e.set_state(ASLEEP)
                log.info("%s: not started yet (max_awake %d); a request for it starts it", e.name, self.max_awake)
        self._monitor = threading.Thread(target=self._monitor_loop, name="router-monitor", daemon=True)
        self._monitor.start()

    def shutdown(self) -> None:
        """Stops every engine (in parallel, each bounded by ``stop_timeout_s``)."""
        self._stop.set()
        self._poke.set()
        if self._monitor is not None:
            self._monitor.join(timeout=self.config.health_interval_s + 10)
        stoppers = [threading.Thread(target=e.close, daemon=True) for e in self.engines.values()]
        for t in stoppers:
            t.start()
        for t in stoppers + self._transitions:
            t.join(timeout=self.config.stop_timeout_s + 20)
        log.info("router: every engine stopped")

    def _monitor_loop(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic()
            for e in self.engines.values():
                if self._stop.is_set():
                    return
                try:
                    e.tick()
                except Exception:  # one engine's surprise must not stop the supervision of all
                    log.exception("%s: supervision step failed", e.name)
                with e.cond:
                    due = idle_due(e, now)
                    if due:
                        e.set_state(SLEEPING)
                if due:
                    self._transition(e, self._sleep)
            self._make_room()
            self._poke.wait(self._next_wait())
            self._poke.clear()

    def _next_wait(self) -> float:
        """Until the next round: the health interval, shorter while an engine starts
        (its readiness is noticed within ``STARTING_POLL_S``) or a restart is due."""
        wait = self.interval
        for e in self.engines.values():
            if e.state == STARTING:
                wait = min(wait, STARTING_POLL_S)
            elif e.state == BACKOFF:
                wait = min(wait, e.next_start_at - time.monotonic())
        return max(0.01, wait)

    # -- sleep and wake -----------------------------------------------------
    def _transition(self, engine: ModelEngine, fn) -> None:
        t = threading.Thread(target=fn, args=(engine,), name=f"router-{fn.__name__}-{engine.name}", daemon=True)
        self._transitions = [x for x in self._transitions if x.is_alive()] + [t]
        t.start()

    def _sleep(self, engine: ModelEngine) -> None:
        mode = sleep_mode_for(engine)
        idle = time.monotonic() - engine.last_activity
        log.info("%s: idle for %.0f s; sleeping (%s)", engine.name, idle, mode.name)
        t0 = time.monotonic()
        try:
            mode.sleep(engine)
        except NotIdle as e:
            log.info("%s: not put to sleep: %s; it stays ready", engine.name, e)
            with engine.cond:
                if engine.state == SLEEPING:
                    engine.set_state(READY)  # idle counts from now: tried again later
            return
        except Exception as e:
            log.error("%s: sleep (%s) failed: %s; restarting the engine", engine.name, mode.name, e)
            engine.crashed("failed to sleep")
            return
        log.info("%s: asleep after %.2f s (%s)", engine.name, time.monotonic() - t0, mode.name)
        self.metrics.slept(engine.name)
        with engine.cond:
            if engine.state != SLEEPING:
                return  # shut down meanwhile
            engine.set_state(ASLEEP)
            if engine.waiting:  # a request came while it fell asleep
                self._begin_wake(engine)
        self._slot_freed()

    def _begin_wake(self, engine: ModelEngine) -> None:
        """Under ``engine.cond``, the engine asleep: starts waking it, unless ``max_awake``
        engines hold their weights (then the monitor makes room and the waiting request
        calls this again)."""
        with self._slots:
            if self.max_awake is not None and not holds_weights(engine):
                holding = sum(1 for e in self.engines.values() if holds_weights(e))
                if holding >= self.max_awake:
                    self._poke.set()  # the monitor puts the least recently used idle model to sleep
                    return
            engine.set_state(WAKING)
        self._transition(engine, self._wake)

    def _make_room(self) -> None:
        """The monitor's part of ``max_awake``: for each asleep model with requests waiting
        beyond the free slots and the sleeps already under way, puts the least recently
        used evictable model to sleep."""
        if self.max_awake is None:
            return
        engines = list(self.engines.values())
        wanting = sum(1 for e in engines if e.state == ASLEEP and e.waiting > 0 and not holds_weights(e))
        free = self.max_awake - sum(1 for e in engines if holds_weights(e))
        short = wanting - max(free, 0) - sum(1 for e in engines if e.state == SLEEPING)
        for victim in sorted((e for e in engines if evictable(e)), key=lambda e: e.last_activity):
            if short <= 0:
                return
            with victim.cond:
                if not evictable(victim):
                    continue
                victim.set_state(SLEEPING)
            log.info("%s: put to sleep to make room for a waiting model (max_awake %d)", victim.name, self.max_awake)
            self.metrics.evicted(victim.name)
            self._transition(victim, self._sleep)
            short -= 1

    def _slot_freed(self) -> None:
        """An engine stopped holding its weights: requests waiting for asleep models try again."""
        if self.max_awake is None:
            return
        for e in self.engines.values():
            with e.cond:
                if e.state == ASLEEP and e.waiting:
                    e.cond.notify_all()

    def _wake(self, engine: ModelEngine) -> None:
        mode = wake_mode_for(engine)
        t0 = time.monotonic()
        log.info("%s: waking (%s)", engine.name, mode.name)
        try:
            mode.wake(engine, self.config.start_timeout_s)
        except (SleepError, OSError) as e:
            self.metrics.woke(engine.name, 0.0, ok=False)
            log.error("%s: wake (%s) failed: %s", engine.name, mode.name, e)
            engine.crashed("failed to wake")
            return
        dt = time.monotonic() - t0
        self.metrics.woke(engine.name, dt, ok=True, mode=mode.name)
        log.info("%s: awake after %.2f s (%s)", engine.name, dt, mode.name)
        with engine.cond:
            if engine.state == WAKING:
                engine.last_activity = time.monotonic()
                engine.set_state(READY)

    # -- requests ------------------------------------------------------------
    def acquire(self, model: str, timeout: Optional[float] = None) -> bool:
        """Waits until ``model`` serves (waking it), then counts a request in flight."""
        engine = self.engines[model]
        return engine.acquire(self.config.wake_timeout_s if timeout is None else timeout, self._begin_wake)

    def release(self, model: str) -> None:
        self.engines[model].release()
