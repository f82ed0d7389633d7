"""The router's engine logs are private and never opened through a link (issue 34, item 2),
and a request that took its engine down is not sent again (item 6): real router, real
stand-in engine processes (tests/router/test_router_standin.py), real files."""

from __future__ import annotations

import json
import os
import stat

import pytest

from kvcached.router.config import ConfigError, parse_config
from kvcached.router.server import bind
from router_helpers import complete, request, wait_for
from test_router_standin import standin_python


def _config(tmp_path, log_dir):
    model = {"name": "alpha", "engine": "vllm", "model": str(tmp_path), "kvcached": False}
    model["python"] = standin_python(tmp_path)
    return parse_config({"port": 0, "log_dir": str(log_dir), "models": [model]})


def _start_fails(tmp_path, log_dir) -> str:
    server = bind(_config(tmp_path, log_dir))
    try:
        with pytest.raises(ConfigError) as e:
            server.router.start()
        assert all(e.proc is None for e in server.router.engines.values())  # no engine was started
        return str(e.value)
    finally:
        server.router.shutdown()
        server.server_close()


def test_a_log_dir_others_can_write_is_refused(tmp_path):
    logs = tmp_path / "shared"
    logs.mkdir()
    os.chmod(logs, 0o777)
    assert "writable by other users (mode 777)" in _start_fails(tmp_path, logs)


def test_a_link_planted_at_the_log_is_not_followed(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir(mode=0o700)
    target = tmp_path / "victim"
    target.write_text("precious\n")
    os.chmod(target, 0o600)
    os.symlink(target, logs / "kvcached_router_alpha.log")
    assert "symbolic link" in _start_fails(tmp_path, logs)
    assert target.read_text() == "precious\n"


def test_logs_are_private_and_an_old_open_log_is_tightened(running, tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir(mode=0o700)
    old = logs / "kvcached_router_alpha.log"
    old.write_text("earlier run\n")
    os.chmod(old, 0o644)
    r = running([{"name": "alpha"}])
    r.ready()
    assert stat.S_IMODE(os.stat(old).st_mode) == 0o600 and "starting" in old.read_text()
    fresh = tmp_path / "made"
    r2 = running([{"name": "beta"}], log_dir=str(fresh))
    r2.ready()
    assert stat.S_IMODE(os.stat(fresh).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(fresh / "kvcached_router_beta.log").st_mode) == 0o600


def test_a_request_that_crashed_its_engine_is_not_sent_again(running, tmp_path, monkeypatch):
    crashes = tmp_path / "crashes"
    monkeypatch.setenv("STANDIN_CRASH_LOG", str(crashes))
    r = running([{"name": "alpha"}])
    r.ready()
    status, _, body = request(r.port, "POST", "/v1/completions", {"model": "alpha", "prompt": "crash"})
    assert status == 502 and "was not sent again" in json.loads(body)["error"]["message"]
    assert len(crashes.read_text().split()) == 1  # the restarted engine never saw it
    wait_for(lambda: r.router.engines["alpha"].restarts == 1, "the restart")
    r.ready()
    assert complete(r.port, "alpha")[0] == 200
    assert len(crashes.read_text().split()) == 1
