"""The router's core: one ``ModelEngine`` per model, the monitor thread
(supervision and the idle policy) and the sleep/wake transitions.

A request calls ``acquire(model)``: it waits, bounded by ``wake_timeout_s``,
until the engine serves (waking it if asleep), then ``release``. A model whose
engine has had no request in flight for ``idle_seconds`` is put to sleep, but
never while a request is in flight or waiting.
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
from kvcached.router.sleep import SleepError, sleep_mode_for
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

    # -- life cycle --------------------------------------------------------
    def start(self) -> None:
        """Checks the engine ports, then starts every engine and the monitor."""
        for e in self.engines.values():
            if e.spec.port:
                check_port_free("127.0.0.1", e.spec.port, f"model {e.name!r}")
        prepare_log_dir(self.config.log_dir)
        for e in self.engines.values():
            os.close(open_log(e.log_path))  # a planted link stops the start here, in one line
        for e in self.engines.values():
            e.spawn()
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
        log.info("%s: idle for %.0f s; sleeping (%s)", engine.name, engine.spec.idle_seconds, mode.name)
        try:
            mode.sleep(engine)
        except Exception as e:
            log.error("%s: sleep (%s) failed: %s; restarting the engine", engine.name, mode.name, e)
            engine.crashed("failed to sleep")
            return
        self.metrics.slept(engine.name)
        with engine.cond:
            if engine.state != SLEEPING:
                return  # shut down meanwhile
            engine.set_state(ASLEEP)
            if engine.waiting:  # a request came while it fell asleep
                self._begin_wake(engine)

    def _begin_wake(self, engine: ModelEngine) -> None:
        """Under ``engine.cond``, the engine asleep: starts waking it."""
        engine.set_state(WAKING)
        self._transition(engine, self._wake)

    def _wake(self, engine: ModelEngine) -> None:
        mode = sleep_mode_for(engine)
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
        self.metrics.woke(engine.name, dt, ok=True)
        log.info("%s: awake after %.2f s", engine.name, dt)
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
