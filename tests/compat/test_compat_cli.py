"""kvctl and kvtop with upstream kvctl's commands and flags, against live instances
in other processes (host backend): names on list/watch/kvtop, ``--refresh``/``-r``,
upstream's ``--json`` keys, the interactive shell, ``kvctl version``, and
``kvcached.cli.utils``'s upstream helpers."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvcached.cli import utils as cli_utils
from kvcached.limits.records import list_records, read_record
from limits_helpers import BPP, Worker, kvctl, record_state, remove_records, unique_prefix


@pytest.fixture(scope="module")
def two():
    """Two live instances in child processes."""
    prefix = unique_prefix()
    ws = [Worker(name=prefix + s, pages=16, budget_bytes=32 * BPP, scope=prefix) for s in ("a", "b")]
    yield ws
    for w in ws:
        w.kill()
    remove_records(prefix)


def test_list_and_watch_take_names(two):
    a, b = two
    r = kvctl("list", a.name)
    assert r.returncode == 0 and a.name in r.stdout and b.name not in r.stdout
    rows = json.loads(kvctl("list", a.name, b.name, "--json").stdout)
    assert sorted(x["name"] for x in rows) == sorted([a.name, b.name])
    for x in rows:  # upstream's keys beside ours
        rec = read_record(x["name"])
        assert (x["ipc"], x["limit_bytes"], x["used_bytes"]) == (rec.name, rec.limit, rec.used)
        assert x["limit"] == x["limit_bytes"]
    r = kvctl("list", a.name, a.name + "_nope")
    assert r.returncode == 1 and a.name in r.stdout and r.stderr.count("\n") == 1 and "_nope" in r.stderr
    r = kvctl("list", "bad/name")
    assert r.returncode == 2 and r.stderr.startswith("kvctl: error: ")
    r = kvctl("watch", "-n", "0.05", "--count", "2", b.name)
    assert r.returncode == 0 and r.stdout.count(b.name) == 2 and a.name not in r.stdout


def test_kvtop_refresh_and_names(two):
    a, b = two
    for argv in (["--refresh", "0.05"], ["-r", "0.05"]):
        r = subprocess.run(
            [sys.executable, "-m", "kvcached.cli.kvtop", *argv, "--count", "2", a.name],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert r.returncode == 0 and r.stdout.count("kvtop  ") == 2, r.stderr
        assert r.stdout.count(a.name) == 2 and b.name not in r.stdout
    r = kvctl("kvtop", "-r", "0.05", "--once", b.name)  # upstream: kvctl kvtop [-r SEC] [ipc ...]
    assert r.returncode == 0 and b.name in r.stdout and a.name not in r.stdout
    r = kvctl("kvtop", "--once", a.name + "_nope")
    assert r.returncode == 0 and "no kvcached instances named" in r.stdout
    r = kvctl("kvtop", "--refresh", "inf", "--once")
    assert r.returncode == 2 and r.stderr.count("\n") == 1


def test_shell_runs_each_line_as_a_command(two):
    a, _ = two
    before = record_state(a.name)
    lines = [
        f"list {a.name}",
        "# a comment",
        "limit",  # a bad line: one error, the shell goes on
        f"limit {a.name} 0",  # refused, nothing written
        "rm -rf /tmp/nothing-here",  # not a kvctl command: never run by a system shell
        f"limit {a.name} 2M --wait 2",
        "version",
        "exit",
        f"delete {a.name} --force",  # after exit: never read
    ]
    r = subprocess.run(
        [sys.executable, "-m", "kvcached.cli.kvctl"], input="\n".join(lines) + "\n",
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.stdout.count(a.name) >= 2 and "kvcached 0.2.0 commit" in r.stdout, r.stdout
    errors = r.stderr.splitlines()
    assert len(errors) == 3 and "required" in errors[0] and "must be > 0" in errors[1] and "invalid choice" in errors[2]
    assert read_record(a.name).limit == 2 << 20 and read_record(a.name).alive
    assert record_state(a.name) != before  # the 2M write happened, the rest did not
    r = subprocess.run(
        [sys.executable, "-m", "kvcached.cli.kvctl", "shell"],
        input="list\n",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and a.name in r.stdout  # end of input ends the shell


def test_version_names_the_installed_build():
    r = kvctl("version")
    assert r.returncode == 0 and r.stdout.startswith("kvcached 0.2.0 commit "), r.stderr
    info = json.loads(kvctl("version", "--json").stdout)
    assert set(info) == {"version", "commit", "location", "source"} and info["version"] == "0.2.0"


def test_cli_utils_upstream_helpers(two):
    a, _ = two
    assert (
        cli_utils.get_ipc_path(a.name) == f"/dev/shm/{a.name}"
        and cli_utils.get_ipc_name(f"/dev/shm/{a.name}") == a.name
    )
    name = unique_prefix() + "init"
    try:
        rec = cli_utils.init_kv_cache_limit(name, 4 * BPP)
        assert (rec.name, rec.limit, rec.total_size) == (name, 4 * BPP, 4 * BPP)
        assert cli_utils.get_kv_cache_limit(name).limit == 4 * BPP
        with pytest.raises(ValueError, match="live process"):
            cli_utils.init_kv_cache_limit(name, BPP)  # one owner per name, not overwritten
        with pytest.raises(ValueError, match="is alive"):
            cli_utils.delete_kv_cache_segment(a.name)  # another process's live instance: refused
        assert cli_utils.delete_kv_cache_segment(name) is True
        assert cli_utils.delete_kv_cache_segment(name) is False
        assert name not in {r.name for r in list_records()}
    finally:
        remove_records(name)
    assert cli_utils.get_total_gpu_memory() >= 0 and cli_utils._format_size(3 << 20) == "3.00M"
