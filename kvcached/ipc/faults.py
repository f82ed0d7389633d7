"""Test-only fault injection in the worker listener, so the coordinator's failure
paths run against real processes. The data plane has its own (backend calls,
``kvcached._C.inject_fault``); this one covers what the network can do.

Spec (env ``KVCACHED_IPC_FAULT_INJECT`` read when a listener starts, or ``arm``)::

    <command>:<nth>:<action>[,<command>:<nth>:<action>...]

``command`` is a protocol command name (map, rollback_map, prepare, commit, abort,
...), ``nth`` counts that command's requests from 1 (only the nth one is hit), and
``action`` is one of:

    drop         run the request, then close the connection without replying (a lost reply)
    exit         run the request, then end the process at once (a worker dying mid-call)
    delay=<s>    sleep s seconds before running the request (a slow worker)
    backend=<op>:<k>
                 arm the data plane's fault injection right before running the request,
                 so its k-th backend <op> call (create/map/set_access/unmap/release)
                 fails: a failure at a precise point inside one request

Unarmed cost: one truth test of a module-level dict per request.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Dict, Optional

from kvcached import config
from kvcached.errors import InvalidArgumentError
from kvcached.ipc.protocol import Cmd


@dataclass(frozen=True)
class Action:
    kind: str  # "drop", "exit", "delay" or "backend"
    seconds: float = 0.0
    backend_op: str = ""
    backend_nth: int = 0


_rules: Dict[int, tuple] = {}  # cmd -> (nth, Action)
_counts: Dict[int, int] = {}
_lock = threading.Lock()


def parse(spec: str) -> Dict[int, tuple]:
    rules: Dict[int, tuple] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        try:
            name, nth, action = part.split(":", 2)
            cmd = Cmd[name.strip().upper()]
            n = int(nth)
            if n < 1:
                raise ValueError
            if action == "drop" or action == "exit":
                act = Action(action)
            elif action.startswith("delay="):
                act = Action("delay", float(action[len("delay=") :]))
            elif action.startswith("backend="):
                op, k = action[len("backend=") :].split(":")
                if op not in ("create", "map", "set_access", "unmap", "release") or int(k) < 1:
                    raise ValueError
                act = Action("backend", backend_op=op, backend_nth=int(k))
            else:
                raise ValueError
        except (ValueError, KeyError):
            raise InvalidArgumentError(
                f"bad IPC fault spec {part!r}; use <command>:<nth>:drop|exit|delay=<seconds>|backend=<op>:<k>"
            ) from None
        rules[int(cmd)] = (n, act)
    return rules


def arm(spec: str) -> None:
    """Replaces the armed rules with ``spec`` and restarts the counts."""
    rules = parse(spec)
    with _lock:
        _rules.clear()
        _rules.update(rules)
        _counts.clear()


def arm_from_env() -> None:
    spec = config.ipc_fault_inject()
    if spec:
        arm(spec)


def clear() -> None:
    with _lock:
        _rules.clear()
        _counts.clear()


def seen(cmd: int) -> int:
    """How many requests of ``cmd`` reached a worker since the rules were armed."""
    with _lock:
        return _counts.get(cmd, 0)


def take(cmd: int) -> Optional[Action]:
    """Counts one request of ``cmd``; returns the action when this one is hit."""
    if not _rules:
        return None
    with _lock:
        rule = _rules.get(cmd)
        if rule is None:
            return None
        n = _counts.get(cmd, 0) + 1
        _counts[cmd] = n
        return rule[1] if n == rule[0] else None
