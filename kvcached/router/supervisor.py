"""One model's engine process group: start, health, crash and restart, stop.

``ModelEngine`` holds the state of one model behind the router and the
condition that requests wait on. Every state change happens under that
condition and wakes the waiters. The router's monitor thread calls ``tick``;
sleeping and waking run on a transition thread (``kvcached.router.router``),
so one slow engine never holds up the health checks of the others.

States: ``starting`` (process up, not healthy yet) -> ``ready`` -> ``sleeping``
(going to sleep) -> ``asleep`` -> ``waking`` -> ``ready``; a crash (exit, or
``HEALTH_FAILURES`` failed checks in a row) -> ``backoff`` -> ``starting`` after
a delay that doubles per crash up to the maximum (back to the first delay once
an engine has served for the maximum); ``stopped`` after shutdown.
"""

from __future__ import annotations

import http.client
import logging
import os
import random
import signal
import socket
import subprocess
import threading
import time
from typing import Callable, Dict, Mapping, Optional, Tuple

from kvcached.router.config import ModelSpec
from kvcached.router.engines import HIGHEST_PORT, engine_command, engine_env
from kvcached.router.logfiles import open_log
from kvcached.router.peer_check import CheckedConnection, EngineSockets, NotTheEngine

log = logging.getLogger("kvcached.router")

STARTING, READY, SLEEPING, ASLEEP, WAKING, BACKOFF, STOPPED = (
    "starting",
    "ready",
    "sleeping",
    "asleep",
    "waking",
    "backoff",
    "stopped",
)
STATES = (STARTING, READY, SLEEPING, ASLEEP, WAKING, BACKOFF, STOPPED)
HEALTH_FAILURES = 3  # failed checks in a row before a running engine counts as hung
HEALTH_TIMEOUT_S = 5.0  # a busy engine on a loaded host may answer /health slowly


def free_port(host: str = "127.0.0.1", highest: int = 65535) -> int:
    """A port free on ``host`` now, at most ``highest``: the system's pick while it is low
    enough (most are: the ephemeral range starts at 32768), else a random one below."""
    for attempt in range(256):
        with socket.socket() as s:
            try:
                s.bind((host, 0 if attempt < 8 else random.randint(1024, highest)))
            except OSError:  # taken
                continue
            port = s.getsockname()[1]
            if port <= highest:
                return port
    raise OSError(f"no free port at most {highest} on {host}")


def http_call(
    host: str,
    port: int,
    method: str,
    path: str,
    body: Optional[bytes] = None,
    timeout: float = 5.0,
    sockets: Optional[EngineSockets] = None,
) -> int:
    """One small request to an engine; its status (0: no answer). With ``sockets``, the
    connection is checked to reach that engine first (NotTheEngine raised when not)."""
    if sockets is None:
        conn = http.client.HTTPConnection(host, port, timeout=timeout)
    else:
        conn = CheckedConnection(host, port, sockets, timeout)
    try:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    except NotTheEngine:
        raise
    except (OSError, http.client.HTTPException):
        return 0
    finally:
        conn.close()


class ModelEngine:
    """The engine of one model and the router's view of it (see the module doc)."""

    def __init__(
        self,
        spec: ModelSpec,
        *,
        host: str = "127.0.0.1",
        log_dir: str = ".",
        kvcached_env: Optional[Mapping[str, str]] = None,
        start_timeout_s: float = 600.0,
        backoff_s: float = 1.0,
        backoff_max_s: float = 60.0,
        stop_timeout_s: float = 30.0,
    ) -> None:
        self.spec = spec
        self.name = spec.name
        self.host = host
        self.port = spec.port or 0
        self.log_path = os.path.join(log_dir, f"{spec.instance}.log")
        self.kvcached_env = dict(kvcached_env or {})
        self.start_timeout_s = start_timeout_s
        self.backoff_first_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.stop_timeout_s = stop_timeout_s
        self.cond = threading.Condition()
        self.proc: Optional[subprocess.Popen] = None
        # Checks that a connection to the port reaches this process (one per start).
        self.sockets: Optional[EngineSockets] = None
        self._refused: Optional[EngineSockets] = None  # the start whose port was found taken
        self.state = STOPPED
        self.inflight = 0
        self.waiting = 0
        self.last_activity = time.monotonic()
        self.started_at = 0.0
        self.ready_since: Optional[float] = None
        self.next_start_at = 0.0
        self.backoff_s = backoff_s
        self.restarts = 0
        self.health_failures = 0
        self.last_exit: Optional[int] = None
        self.saved_kv_limit: Optional[int] = None  # the kvcached limit before a sleep gave KV back
        self.closed = False
        self.poke: Callable[[], None] = lambda: None  # tells the monitor a restart is due

    # -- process ---------------------------------------------------------
    def spawn(self, state: str = STARTING) -> bool:
        """Starts the engine process group (in ``state``: ``starting``, or ``waking``
        when a wake waits for it); False once the router is shutting down. Under
        ``cond``, so ``close`` sees every process."""
        with self.cond:
            if self.closed:
                return False
            port = self.spec.port or free_port(self.host, HIGHEST_PORT.get(self.spec.engine, 65535))
            cmd = engine_command(self.spec, self.host, port)
            env: Dict[str, str] = engine_env(self.spec, self.kvcached_env)
            with os.fdopen(open_log(self.log_path), "ab") as logf:
                logf.write(f"\n=== kvcached router: starting {' '.join(cmd)}\n".encode())
                logf.flush()
                self.proc = subprocess.Popen(
                    cmd,
                    env=env,
                    stdout=logf,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            self.port = port
            self.sockets = EngineSockets(self.proc.pid)
            self.started_at = time.monotonic()
            self.health_failures = 0
            self._set(state)
        log.info("%s: started %s engine pid %d on port %d", self.name, self.spec.engine, self.proc.pid, port)
        return True

    def terminate(self, timeout: Optional[float] = None) -> Optional[int]:
        """Stops the engine's process group (see ``stop_group``); its exit status."""
        with self.cond:
            proc, self.proc = self.proc, None
        if proc is None:
            return None
        return stop_group(proc, self.stop_timeout_s if timeout is None else timeout, self.name)

    def close(self) -> None:
        """Shutdown: no process is started any more, waiters give up; then stops the engine."""
        with self.cond:
            self.closed = True
            self._set(STOPPED)
        self.terminate()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def endpoint(self) -> Tuple[str, int, Optional[EngineSockets]]:
        """Host, port and the check of the current start, read together."""
        with self.cond:
            return self.host, self.port, self.sockets

    def healthy(self, timeout: float = HEALTH_TIMEOUT_S) -> bool:
        """Whether the engine answers ``/health``; NotTheEngine when another process holds its port."""
        host, port, sockets = self.endpoint()
        return self.alive() and http_call(host, port, "GET", "/health", timeout=timeout, sockets=sockets) == 200

    def refused(self, sockets: Optional[EngineSockets], err: NotTheEngine) -> None:
        """A connection to the port of the start ``sockets`` reached another process: nothing
        was sent to it. Handled like a failed start (restart, on a new port unless one is
        configured); logged once per start."""
        with self.cond:
            if sockets is None or sockets is not self.sockets or self._refused is sockets:
                return  # an older start, or already handled
            if self.state not in (STARTING, READY):
                return  # sleeping and waking fail (and restart) on their own
            self._refused = sockets
        log.error("%s: %s", self.name, err)
        self.crashed(f"lost port {err.port} to another process")

    def wait_healthy(self, timeout: float) -> bool:
        """Polls ``/health`` until it answers 200, the process exits, or ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                return False
            if self.healthy():
                return True
            time.sleep(0.25)
        return False

    # -- state -----------------------------------------------------------
    def _set(self, state: str) -> None:
        """Under ``cond``: the new state, waking every waiter."""
        if state == READY and self.state != READY:
            self.ready_since = self.last_activity = time.monotonic()  # idle counts from here
        elif state != READY:
            self.ready_since = None
        self.state = state
        self.cond.notify_all()

    def set_state(self, state: str) -> None:
        with self.cond:
            self._set(state)

    def crashed(self, why: str) -> None:
        """The engine died or hung: stop what is left of it and schedule a restart
        after the backoff. Idempotent: the first caller (monitor or request) acts."""
        with self.cond:
            if self.state in (STOPPED, BACKOFF):
                return
            now = time.monotonic()
            if self.ready_since is not None and now - self.ready_since >= self.backoff_max_s:
                self.backoff_s = self.backoff_first_s  # it had served a good while: start over
            proc, self.proc = self.proc, None
            self.restarts += 1
            self.next_start_at = float("inf")  # set once the old group is gone
            self._set(BACKOFF)
        self.last_exit = None if proc is None else stop_group(proc, 5.0, self.name)
        with self.cond:
            self.next_start_at = time.monotonic() + self.backoff_s
            log.warning(
                "%s: engine %s (exit %s); restart #%d in %.1f s (log %s)",
                self.name,
                why,
                self.last_exit,
                self.restarts,
                self.backoff_s,
                self.log_path,
            )
            self.backoff_s = min(self.backoff_s * 2, self.backoff_max_s)
        self.poke()

    def check_exited(self, wait_s: float = 5.0) -> bool:
        """True (and a restart scheduled) when the serving engine's process has exited
        or exits within ``wait_s`` (a killed engine's socket closes before it is reaped)."""
        with self.cond:
            if self.state in (BACKOFF, STARTING):
                return True  # the monitor saw it first: being restarted
            proc = self.proc if self.state == READY else None
        if proc is None:
            return False
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            return False
        with self.cond:
            dead = self.proc is proc
        if dead:
            self.crashed("exited")
        return dead

    def tick(self) -> None:
        """One round of supervision (the monitor thread): health, crash, restart."""
        with self.cond:
            state, proc = self.state, self.proc
        try:
            self._tick(state, proc)
        except NotTheEngine as e:
            self.refused(e.sockets, e)

    def _tick(self, state: str, proc: Optional[subprocess.Popen]) -> None:
        if state == STARTING:
            if proc is None or proc.poll() is not None:
                self.crashed("exited while starting")
            elif self.healthy():
                with self.cond:
                    if self.state == STARTING:
                        self._set(READY)
                log.info("%s: ready on port %d", self.name, self.port)
            elif time.monotonic() - self.started_at > self.start_timeout_s:
                self.crashed(f"not healthy after {self.start_timeout_s:.0f} s")
        elif state == READY:
            if proc is None or proc.poll() is not None:
                self.crashed("exited")
            elif self.healthy():
                self.health_failures = 0
            else:
                self.health_failures += 1
                if self.health_failures >= HEALTH_FAILURES:
                    self.crashed(f"failed {HEALTH_FAILURES} health checks in a row")
        elif state == BACKOFF and time.monotonic() >= self.next_start_at:
            try:
                self.spawn()
            except OSError as e:  # e.g. the interpreter is gone: keep trying, slower each time
                with self.cond:
                    self._set(STARTING)
                self.crashed(f"could not be started ({e})")

    # -- requests --------------------------------------------------------
    def acquire(self, timeout: float, on_asleep) -> bool:
        """Waits (at most ``timeout``) until the engine serves, then counts one
        request in flight. ``on_asleep`` is called (under ``cond``) when the
        engine is asleep, to start waking it. False on timeout or shutdown."""
        deadline = time.monotonic() + timeout
        with self.cond:
            self.waiting += 1
            try:
                while True:
                    if self.state == READY:
                        self.inflight += 1
                        self.last_activity = time.monotonic()
                        return True
                    if self.state == STOPPED:
                        return False
                    if self.state == ASLEEP:
                        on_asleep(self)
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self.cond.wait(min(left, 1.0))
            finally:
                self.waiting -= 1

    def release(self) -> None:
        with self.cond:
            self.inflight -= 1
            self.last_activity = time.monotonic()
            self.cond.notify_all()


def stop_group(proc: subprocess.Popen, timeout: float, name: str = "") -> Optional[int]:
    """SIGTERM to the process group; SIGKILL to whatever of it is left after
    ``timeout`` (the engine's other processes get the same time as the leader to
    finish, e.g. to remove their kvcached records). Returns the leader's exit
    status once the group is gone (every wait bounded)."""
    deadline = time.monotonic() + timeout
    _signal_group(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        log.warning("%s: engine pid %d ignored SIGTERM for %.0f s; killing it", name, proc.pid, timeout)
    while time.monotonic() < deadline and _group_alive(proc.pid):
        time.sleep(0.05)
    _signal_group(proc.pid, signal.SIGKILL)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        log.error("%s: engine pid %d survived SIGKILL", name, proc.pid)
    kill_deadline = time.monotonic() + 10
    while time.monotonic() < kill_deadline and _group_alive(proc.pid):
        time.sleep(0.05)
    return proc.returncode


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
