"""SGLang's ``--sleep-on-idle``: an idle scheduler sleeps in its IdleSleeper's zmq poll
(up to 1 s) before kvcached's idle hooks run. The instance's wake (a peer's want, an
applied limit) ends that poll through a pipe of ours (``idle_wake.py``)."""

from __future__ import annotations

import os
import threading
from types import SimpleNamespace

import pytest

idle_sleeper = pytest.importorskip("sglang.srt.managers.scheduler_components.idle_sleeper")


@pytest.fixture
def sleeper_cls():
    """A copy of SGLang's IdleSleeper, patched (SGLang's own class stays as it is)."""
    from kvcached.integration.sglang.idle_wake import patch_idle_sleeper

    base = idle_sleeper.IdleSleeper
    cls = type("IdleSleeper", (base,), {"__init__": base.__init__, "maybe_sleep": base.maybe_sleep})
    patch_idle_sleeper(SimpleNamespace(IdleSleeper=cls))
    return cls


@pytest.fixture
def socket():
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.bind(f"ipc:///tmp/kvcached-test-idle-{os.getpid()}")
    yield sock
    sock.close(0)
    ctx.term()


def test_a_wake_ends_the_idle_poll_and_is_drained(sleeper_cls, socket):
    from kvcached.integration.sglang.idle_wake import waker_of

    s = sleeper_cls([socket])
    poll = s.poller.poll
    s.poller.poll = lambda *a, **k: poll(None)  # no timeout: only a wake can end this sleep
    wake = waker_of(s)
    assert wake is not None
    for _ in range(2):  # drained after each poll: the second sleep waits for the second wake
        t = threading.Thread(target=s.maybe_sleep, daemon=True)
        t.start()
        t.join(0.2)
        assert t.is_alive()  # asleep in the poll
        wake()
        t.join(30)
        assert not t.is_alive(), "the wake did not end the poll"


def test_a_sleeper_without_our_pipe_has_no_waker():
    from kvcached.integration.sglang.idle_wake import waker_of

    assert waker_of(None) is None and waker_of(SimpleNamespace(poller=None)) is None


def test_the_scheduler_connects_its_sleeper_to_the_instance(sleeper_cls, socket, monkeypatch):
    import kvcached.integration.sglang.scheduler_hooks as sh
    from kvcached.elastic import ElasticInstance

    inst = ElasticInstance("t")
    monkeypatch.setattr(sh, "instance", lambda: inst)
    monkeypatch.setattr(sh, "elastic_groups", lambda: [object()])
    s = sleeper_cls([socket])
    sh.after_init(SimpleNamespace(idle_sleeper=s))
    t = threading.Thread(target=s.maybe_sleep, daemon=True)
    poll = s.poller.poll
    s.poller.poll = lambda *a, **k: poll(None)
    t.start()
    inst.wake_idle_loop()  # as the limits' watcher does on a peer's want or an applied limit
    t.join(30)
    assert not t.is_alive() and inst.poke.is_set()
