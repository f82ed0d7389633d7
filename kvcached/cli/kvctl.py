"""kvctl: list, cap and clean up kvcached instances from the shell.

    kvctl list [NAME ...] [--json]
    kvctl limit <name> <size> [--revision R] [--json]     size: 512M, 1.5G, bytes
    kvctl limit-percent <name> <pct> [--revision R] [--json]   pct of the device's usable memory
    kvctl watch [-n SEC] [--count N] [NAME ...]
    kvctl delete <name> [--force] [--json]
    kvctl cleanup [--prefix P] [--json]                    delete every dead instance
    kvctl kvtop [kvtop options] [NAME ...]
    kvctl version [--json]                                 the kvcached build installed
    kvctl metrics --port N [--host H] [--prefix P]        Prometheus /metrics of every instance
    kvctl borrow SIZE [--device D] [--timeout S] [--partial] [--priority] [--name N] [--json] -- CMD ...
                                                           hold memory for CMD's lifetime (kvcached.cli.borrow)
    kvctl [shell]                                          one command per line (kvcached.cli.shell)

Upstream kvctl's commands and flags work as there (docs/COMPAT.md); ``list
--json`` carries upstream's ``ipc``/``limit_bytes``/``used_bytes`` beside ours.

Exit status: 0 done; 2 bad input (one line on stderr naming the fix; nothing
changed); 1 the write lost to another writer (stale/conflict) or the system
failed. ``kvctl borrow`` passes CMD's status through (kvcached.cli.borrow).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, List, Optional, Sequence, Tuple

from kvcached.cli import args as args_mod
from kvcached.cli import borrow as borrow_cmd

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2
MAX_SIZE = (1 << 63) - 1  # the record's limit is a signed 64-bit byte count


class BadInput(Exception):
    """A user error: reported as one line, exit status 2, nothing changed."""


def _print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2, sort_keys=True)
    sys.stdout.write("\n")


def _parse_size_arg(text: str) -> int:
    from kvcached.units import parse_size

    try:
        n = parse_size(text)
    except ValueError as e:
        raise BadInput(str(e)) from None
    if n <= 0:
        raise BadInput(f"size {text!r} must be > 0; give a positive size such as 4G")
    if n > MAX_SIZE:
        raise BadInput(f"size {text!r} is too large; the most a record holds is {MAX_SIZE} bytes")
    return n


def _parse_revision(text: Optional[str]) -> Optional[int]:
    if text is None:
        return None
    try:
        return args_mod.integer(text, "--revision", 0, args_mod.MAX_REVISION)
    except ValueError as e:
        raise BadInput(f"{e} (the REV column of `kvctl list`)") from None


def _records(names: Sequence[str]) -> Tuple[List[Any], List[str]]:
    """(records, names asked for that have none): every record, or those named."""
    from kvcached.limits.records import list_records
    from kvcached.naming import validate_name

    for n in names:
        try:
            validate_name(n)
        except ValueError as e:
            raise BadInput(str(e)) from None
    recs = list_records()
    if not names:
        return recs, []
    found = [r for r in recs if r.name in names]
    return found, sorted(set(names) - {r.name for r in found})


def cmd_list(args: argparse.Namespace) -> int:
    from kvcached.cli.table import printable, records_table

    recs, missing = _records(args.names)
    if args.json:
        # Upstream's keys (ipc, limit_bytes, used_bytes) beside ours.
        _print_json([dict(r.to_dict(), ipc=r.name, limit_bytes=r.limit, used_bytes=r.used) for r in recs])
    else:
        print(records_table(recs))
    for n in missing:
        print(f"kvctl: no kvcached instance named {printable(n)!r}; see `kvctl list`", file=sys.stderr)
    return EXIT_FAILED if missing else EXIT_OK


def _set_limit(name: str, limit: int, revision: Optional[int], as_json: bool, wait_s: float) -> int:
    from kvcached.control import APPLIED, DEFERRED, REJECTED, set_instance_memory_limit
    from kvcached.errors import InvalidArgumentError
    from kvcached.units import format_size

    try:
        r = set_instance_memory_limit(limit, revision, name=name, wait_s=wait_s)
    except InvalidArgumentError as e:  # the data plane refused the write (e.g. an invalid record)
        raise BadInput(str(e)) from None
    if r == REJECTED:
        raise BadInput(r.message)
    if as_json:
        _print_json(
            {
                "name": r.name,
                "status": r.status,
                "revision": r.revision,
                "limit": r.limit,
                "mapped": r.mapped,
                "message": r.message,
            }
        )
    elif r in (APPLIED, DEFERRED):
        print(
            f"{r.name}: limit {format_size(r.limit)} ({r.limit} bytes), revision {r.revision}: {r.status}"
            + ("" if r == APPLIED else f" ({r.message})")
        )
    else:
        print(f"kvctl: {r.name}: {r.status}: {r.message}", file=sys.stderr)
    return EXIT_OK if r in (APPLIED, DEFERRED) else EXIT_FAILED


def cmd_limit(args: argparse.Namespace) -> int:
    limit = _parse_size_arg(args.size)
    return _set_limit(args.name, limit, _parse_revision(args.revision), args.json, args.wait)


def cmd_limit_percent(args: argparse.Namespace) -> int:
    from kvcached import _C
    from kvcached.limits.records import read_record

    text = args.pct.strip()
    try:
        pct = args_mod.decimal(text[:-1] if text.endswith("%") else text, "percent", 0.0, 100.0, lo_open=True)
    except ValueError as e:
        raise BadInput(f"{e}; give a value such as 50") from None
    revision = _parse_revision(args.revision)
    try:
        rec = read_record(args.name)
    except _C.KvcachedError as e:
        raise BadInput(str(e)) from None
    if rec.device_bytes <= 0:
        raise BadInput(f"the usable memory of {rec.device} is unknown for {rec.name!r}; use `kvctl limit` with a size")
    limit = int(rec.device_bytes * pct / 100.0)
    if limit <= 0:
        raise BadInput(f"{pct}% of {rec.device_bytes} bytes is 0 bytes; give a larger percent")
    return _set_limit(args.name, limit, revision, args.json, args.wait)


def cmd_watch(args: argparse.Namespace) -> int:
    from kvcached.cli.table import records_table

    _records(args.names)  # names are checked once; instances may come and go meanwhile
    tty = sys.stdout.isatty()
    n = 0
    try:
        while args.count is None or n < args.count:
            if n:
                time.sleep(args.interval)
            frame = f"Every {args.interval:g}s: kvctl list    {time.strftime('%Y-%m-%d %H:%M:%S')}\n\n"
            frame += records_table(_records(args.names)[0])
            # On a terminal redraw in place; in a pipe keep every frame.
            sys.stdout.write(("\x1b[H\x1b[2J" if tty else ("\n" if n else "")) + frame + "\n")
            sys.stdout.flush()
            n += 1
    except KeyboardInterrupt:
        pass
    return EXIT_OK


def cmd_delete(args: argparse.Namespace) -> int:
    from kvcached import _C

    try:
        _C.delete_mem_info_record(args.name, args.force)
    except _C.InvalidArgumentError as e:
        raise BadInput(str(e)) from None
    if args.json:
        _print_json({"deleted": [args.name]})
    else:
        print(f"deleted {args.name}")
    return EXIT_OK


def cmd_cleanup(args: argparse.Namespace) -> int:
    from kvcached.cli.table import printable
    from kvcached.elastic.cleanup import cleanup_dead_instances

    failed: dict = {}
    deleted = cleanup_dead_instances(args.prefix, failed=failed)
    if args.json:
        _print_json({"deleted": deleted, "failed": failed})
    else:
        print(
            f"deleted {len(deleted)} dead instance(s)" + (": " + ", ".join(map(printable, deleted)) if deleted else "")
        )
        for name, why in sorted(failed.items()):
            print(f"kvctl: could not delete {printable(name)}: {printable(why, 300)}", file=sys.stderr)
    return EXIT_FAILED if failed else EXIT_OK


def cmd_version(args: argparse.Namespace) -> int:
    from kvcached import build_info, version_line

    if args.json:
        _print_json(build_info())
    else:
        print(version_line())
    return EXIT_OK


def cmd_metrics(args: argparse.Namespace) -> int:
    try:
        from kvcached.metrics import exporter
    except ImportError as e:
        raise BadInput(f"{e}; install it: pip install prometheus_client") from None

    def ready(server: Any) -> None:
        host, port = server.server_address[:2]
        host = f"[{host}]" if ":" in host else host
        print(f"kvctl metrics: serving http://{host}:{port}/metrics (SIGTERM or Ctrl-C stops)", flush=True)

    try:
        exporter.run(args.host, args.port, args.prefix, on_ready=ready)
    except OSError as e:  # address in use, not an address of this machine
        why = e.strerror or e
        raise BadInput(f"cannot listen on {args.host}:{args.port}: {why}; pick another --port/--host") from None
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    p = args_mod.OneLineParser(prog="kvctl", description="Watch and cap kvcached instances (records in /dev/shm).")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND", parser_class=args_mod.OneLineParser)

    s = sub.add_parser("list", help="list instances (dead owners shown as dead)")
    s.add_argument("names", nargs="*", metavar="NAME", help="only these instances")
    s.add_argument("--json", action="store_true", help="machine-readable output, bytes")
    s.set_defaults(func=cmd_list)

    for cmd, arg, helptext, func in (
        ("limit", "size", "new limit: bytes or K/M/G/T suffix (e.g. 4G)", cmd_limit),
        ("limit-percent", "pct", "percent (0, 100] of the device's usable memory", cmd_limit_percent),
    ):
        s = sub.add_parser(cmd, help=f"set an instance's KV memory limit ({helptext})")
        s.add_argument("name")
        s.add_argument(arg, help=helptext)
        s.add_argument("--revision", help="write only if the record is still at this revision")
        s.add_argument(
            "--wait", type=args_mod.wait, default=0.5, help="seconds (0-3600) to wait for the owner to apply it"
        )
        s.add_argument("--json", action="store_true")
        s.set_defaults(func=func)

    s = sub.add_parser("watch", help="print `kvctl list` every -n seconds")
    s.add_argument("-n", "--interval", type=args_mod.interval, default=2.0, help="seconds between refreshes")
    s.add_argument("--count", type=args_mod.count, default=None, help="stop after this many refreshes (>= 1)")
    s.add_argument("names", nargs="*", metavar="NAME", help="only these instances")
    s.set_defaults(func=cmd_watch)

    s = sub.add_parser("delete", help="remove an instance record (refused while its owner lives)")
    s.add_argument("name")
    s.add_argument("--force", action="store_true", help="remove even if the owner is alive")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_delete)

    s = sub.add_parser("cleanup", help="remove every record whose owner is dead")
    s.add_argument("--prefix", default="", help="only records whose name starts with this")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_cleanup)

    s = sub.add_parser("version", help="the kvcached build installed (version, commit, location)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_version)

    s = sub.add_parser("metrics", help="serve Prometheus /metrics of every instance over HTTP (until SIGTERM)")
    s.add_argument("--port", type=args_mod.port, required=True, help="TCP port (0: any free one, printed)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    s.add_argument("--prefix", default="", help="only instances whose name starts with this")
    s.set_defaults(func=cmd_metrics)

    borrow_cmd.add_parser(sub, BadInput)

    # Listed for --help; main() hands these to kvtop / the shell before parsing.
    sub.add_parser("kvtop", help="live table of instances (same as `kvtop`; see `kvtop --help`)")
    sub.add_parser("shell", help="one kvctl command per line (also: kvctl without a command)")
    return p


def _protect_negative_sizes(argv: List[str]) -> List[str]:
    """``kvctl limit x -5M``: argparse would take ``-5M`` for an option and
    answer "missing size"; pass it through so the answer is "must be > 0"."""
    if argv and argv[0] in ("limit", "limit-percent", "borrow") and "--" not in argv:
        for i, tok in enumerate(argv[1:], 1):
            # argparse takes "-1" as an option's value itself
            value_of_option = argv[i - 1] in ("--revision", "--wait", "--timeout", "--device", "--name")
            if len(tok) > 1 and tok[0] == "-" and (tok[1].isdigit() or tok[1] == ".") and not value_of_option:
                # Last, after "--": the options that follow it stay options.
                return argv[:i] + argv[i + 1 :] + ["--", tok]
    return argv


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["kvtop"]:
        # Its options belong to kvtop; argparse would claim the ones that look like kvctl's.
        from kvcached.cli import kvtop

        return kvtop.main(argv[1:])
    if argv in ([], ["shell"]):
        from kvcached.cli import shell

        return shell.run(main)
    command = None
    if argv[:1] == ["borrow"]:
        argv, command = borrow_cmd.split_command(argv)  # CMD's arguments are not kvctl's
    args = build_parser().parse_args(_protect_negative_sizes(argv))
    if command is not None:
        args.command = command
    try:
        return int(args.func(args))
    except BadInput as e:
        print(f"kvctl: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BrokenPipeError:
        return EXIT_OK  # `kvctl list | head`
    except Exception as e:  # a system failure: one line, not a traceback
        print(f"kvctl: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
