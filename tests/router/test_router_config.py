"""The router's config: what it accepts, and one clear line for what it does not."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from kvcached.router.config import ENGINE_SLEEP_FLAGS, ConfigError, load_config, parse_config
from kvcached.router.engines import engine_command, engine_env
from repo_paths import ROOT


def _model(tmp_path, **kw):
    d = {"name": "m", "engine": "vllm", "model": str(tmp_path)}
    d.update(kw)
    return d


def test_yaml_and_json_give_the_same_config(tmp_path):
    pytest.importorskip("yaml")
    (tmp_path / "ckpt").mkdir()
    yaml_text = """
port: 9000
wake_timeout_s: 30
kvcached: {gpu_utilization: 0.8, host_memory_budget: 2G}
models:
  - name: a
    engine: vllm
    model: ./ckpt
    args: [--max-model-len, 256]
    env: {FOO: 1}
    idle_seconds: 60
  - name: org/b
    engine: sglang
    model: org/some-model
    sleep: kv
"""
    (tmp_path / "c.yaml").write_text(yaml_text)
    cfg = load_config(str(tmp_path / "c.yaml"))
    data = {
        "port": 9000,
        "wake_timeout_s": 30,
        "kvcached": {"gpu_utilization": 0.8, "host_memory_budget": "2G"},
        "models": [
            {
                "name": "a",
                "engine": "vllm",
                "model": "./ckpt",
                "args": ["--max-model-len", 256],
                "env": {"FOO": 1},
                "idle_seconds": 60,
            },
            {"name": "org/b", "engine": "sglang", "model": "org/some-model", "sleep": "kv"},
        ],
    }
    (tmp_path / "c.json").write_text(json.dumps(data))
    assert load_config(str(tmp_path / "c.json")).models == cfg.models
    a, b = cfg.models
    assert cfg.port == 9000 and cfg.wake_timeout_s == 30
    assert dict(cfg.kvcached_env) == {"KVCACHED_GPU_UTILIZATION": "0.8", "KVCACHED_HOST_MEMORY_BUDGET": "2G"}
    assert a.model == str(tmp_path / "ckpt")  # relative to the config file
    assert a.args == ("--max-model-len", "256") and dict(a.env) == {"FOO": "1"} and a.idle_seconds == 60
    assert a.sleep_mode() == "stop"  # auto without the engine's sleep flag
    assert b.model == "org/some-model" and b.sleep_mode() == "kv" and b.idle_seconds is None
    assert b.instance == "kvcached_router_org_b"


def test_engine_command_and_environment(tmp_path):
    cfg = parse_config(
        {"kvcached": {"gpu_utilization": 0.5}, "models": [_model(tmp_path, args=["--seed", "0"], env={"X": "1"})]}
    )
    m = cfg.models[0]
    cmd = engine_command(m, "127.0.0.1", 1234)
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[cmd.index("--served-model-name") + 1] == "m" and cmd[cmd.index("--port") + 1] == "1234"
    assert cmd[-2:] == ["--seed", "0"]
    env = engine_env(m, cfg.kvcached_env, base={"KVCACHED_IPC_NAME": "stale", "PATH": "/bin"})
    assert env["ENABLE_KVCACHED"] == "true" and env["KVCACHED_IPC_NAME"] == "kvcached_router_m"
    assert env["KVCACHED_GPU_UTILIZATION"] == "0.5" and env["X"] == "1" and env["PATH"] == "/bin"
    sg = parse_config({"models": [_model(tmp_path, engine="sglang", kvcached=False)]}).models[0]
    assert engine_command(sg, "h", 1)[1:5] == ["-m", "sglang.launch_server", "--model-path", str(tmp_path)]
    env = engine_env(sg, {}, base={"KVCACHED_IPC_NAME": "stale"})
    assert env["ENABLE_KVCACHED"] == "false" and "KVCACHED_IPC_NAME" not in env


@pytest.mark.parametrize(
    "models, top, needle",
    [
        ([{"engine": "tgi"}], {}, "unknown engine 'tgi'; use one of: vllm, sglang"),
        ([{}, {}], {}, "duplicate name 'm'"),
        ([{"model": "/nonexistent/ckpt"}], {}, "model path /nonexistent/ckpt does not exist"),
        ([{"model": None}], {}, "needs 'model'"),
        ([{"name": ""}], {}, "needs a non-empty 'name'"),
        ([{"idle_seconds": 0}], {}, "idle_seconds must be > 0"),
        ([{"sleep": "deep"}], {}, "unknown sleep 'deep'"),
        ([{"sleep": "engine"}], {}, "sleep: engine needs --enable-sleep-mode in 'args'"),
        (
            [{"sleep": "engine", "engine": "sglang"}],
            {},
            "sleep: engine needs --enable-memory-saver and --enable-weights-cpu-backup in 'args'",
        ),
        (
            [{"sleep": "engine", "engine": "sglang", "args": ["--enable-memory-saver"]}],
            {},
            "sleep: engine needs --enable-weights-cpu-backup in 'args' (the sglang engine sleeps and wakes with",
        ),
        ([{"sleep": "kv", "kvcached": False}], {}, "sleep: kv gives the KV cache back through kvcached"),
        ([{"args": ["--port", "1"]}], {}, "sets --port, which the router sets"),
        ([{"colour": "red"}], {}, "unknown key 'colour'"),
        ([{"python": "/nonexistent/python"}], {}, "python /nonexistent/python is not an executable"),
        ([{"port": 8080}], {}, "the router and every model need their own port"),
        ([{}], {"port": "x"}, "port: must be a port number"),
        ([{}], {"kvcached": {"gpu_utilization": 2}}, "must be in (0, 1]"),
        ([], {}, "models: must be a non-empty list"),
        ([{}], {"max_awake": 0}, "max_awake: must be a whole number >= 1"),
        ([{}], {"max_awake": 1.5}, "max_awake: must be a whole number >= 1"),
    ],
)
def test_bad_config_is_one_line_naming_the_fix(tmp_path, models, top, needle):
    data = dict(top, models=[_model(tmp_path, **m) for m in models])
    with pytest.raises(ConfigError) as e:
        parse_config(data, source="c.json")
    msg = str(e.value)
    assert needle in msg and "\n" not in msg and msg.startswith("config c.json: ")


def test_auto_stops_an_sglang_engine_whose_release_would_drop_its_weights(tmp_path):
    """SGLang's memory saver without the weights' host copy frees the weights for good: a
    woken engine would serve from empty memory, so ``auto`` stops that engine instead."""
    cfg = parse_config({"models": [_model(tmp_path, engine="sglang", args=["--enable-memory-saver"])]})
    assert cfg.models[0].sleep_mode() == "stop"


@pytest.mark.parametrize("kvcached", [True, False])
def test_engine_sleep_is_accepted_with_and_without_kvcached(tmp_path, kvcached):
    cfg = parse_config(
        {
            "max_awake": 2,
            "models": [
                _model(tmp_path, name="v", args=["--enable-sleep-mode"], kvcached=kvcached),
                _model(tmp_path, name="s", engine="sglang", args=list(ENGINE_SLEEP_FLAGS["sglang"]), kvcached=kvcached),
            ],
        }
    )
    v, s = cfg.models
    assert cfg.max_awake == 2
    assert v.sleep_mode() == "engine" and s.sleep_mode() == "engine"  # auto: the engine has the option
    env = engine_env(v, {}, base={})
    assert env["VLLM_SERVER_DEV_MODE"] == "1"  # /sleep is a dev endpoint in vLLM
    assert env["ENABLE_KVCACHED"] == ("true" if kvcached else "false")


def _run(*args):
    return subprocess.run(
        [sys.executable, "-m", "kvcached.router", *args], capture_output=True, text=True, timeout=60, cwd=ROOT
    )


def test_cli_bad_config_exits_2_with_one_line(tmp_path):
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"models": [_model(tmp_path, engine="tgi")]}))
    r = _run("serve", str(p))
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().count("\n") == 0 and "unknown engine 'tgi'" in r.stderr
    p.write_text("{not json")
    r = _run("check", str(p))
    assert r.returncode == 2 and "is not valid JSON" in r.stderr
    r = _run("check", str(tmp_path / "missing.json"))
    assert r.returncode == 2 and "cannot read config" in r.stderr


def test_cli_check_prints_the_engine_commands(tmp_path):
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"models": [_model(tmp_path, idle_seconds=5)]}))
    r = _run("check", str(p))
    assert r.returncode == 0, r.stderr
    assert "m: sleep=stop idle_seconds=5.0 instance=kvcached_router_m" in r.stdout
    assert "vllm.entrypoints.openai.api_server" in r.stdout


def test_serve_on_a_port_in_use_starts_nothing(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        p = tmp_path / "c.json"
        p.write_text(json.dumps({"port": port, "log_dir": str(tmp_path / "logs"), "models": [_model(tmp_path)]}))
        r = _run("serve", str(p))
    assert r.returncode == 2 and f"port {port} on 127.0.0.1 is in use" in r.stderr
    assert r.stderr.strip().count("\n") == 0
    assert not (tmp_path / "logs").exists()  # no engine was started
