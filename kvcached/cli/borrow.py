"""kvctl borrow: device memory held for a command that is not an engine.

    kvctl borrow SIZE [--device D] [--timeout S] [--partial] [--priority] [--name N] [--json] -- CMD [ARG ...]

Joins the device budget as a job (kvcached.borrowing: engines give back their
unused grant, mapped reserve and idle prefix caches; with ``--priority`` their
limits are lowered too), waits until SIZE is held, runs CMD, and gives the
memory back when CMD ends. CMD's environment gets ``KVCACHED_BORROW_NAME``,
``KVCACHED_BORROW_DEVICE`` and ``KVCACHED_BORROW_BYTES`` (what is held: less
than SIZE with ``--partial``). Before CMD starts, one line on stderr says what
is held; with ``--json`` a JSON object on stdout instead (name, device,
requested, nbytes, lowered).

Signals: SIGTERM, SIGINT, SIGHUP and SIGQUIT sent to kvctl go to CMD, except a
terminal's Ctrl-C / Ctrl-\\ (the kernel sends those to CMD's process group
itself; forwarding would deliver them twice); kvctl then waits for CMD. While
kvctl still waits for memory they cancel the borrow (nothing stays held).

Exit status: CMD's (128+N when signal N ended it); 2 bad input (nothing done);
75 the memory could not be had within --timeout (CMD not run); 126 CMD cannot
be run; 127 CMD not found; 1 another failure. If kvctl itself is SIGKILLed,
CMD runs on and the budget no longer counts its memory (``kvctl list``: dead).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shlex
import signal
import sys
from typing import Any, List, Optional, Tuple

from kvcached.cli import args as args_mod

EXIT_NO_MEMORY = 75  # EX_TEMPFAIL: try again later
EXIT_CANNOT_RUN, EXIT_NOT_FOUND = 126, 127
ENV_NAME, ENV_DEVICE, ENV_BYTES = "KVCACHED_BORROW_NAME", "KVCACHED_BORROW_DEVICE", "KVCACHED_BORROW_BYTES"
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
_SI_KERNEL = 0x80  # si_code of a signal the kernel sent (a terminal's Ctrl-C), not kill(2)
USAGE = "kvctl borrow SIZE [options] -- CMD [ARG ...]"


def add_parser(sub: Any, bad_input: type) -> None:
    """The ``borrow`` subcommand (its CMD is split off by ``split_command`` before parsing);
    ``bad_input`` is kvctl's BadInput, raised for user errors."""
    s = sub.add_parser("borrow", usage=USAGE, help="hold device memory for a command that is not an engine")
    s.add_argument("size", help="bytes or K/M/G/T suffix (e.g. 40G)")
    s.add_argument("--device", default="cuda", help="cuda (default: cuda:0), cuda:N or cpu (the host budget)")
    s.add_argument(
        "--timeout",
        type=args_mod.borrow_timeout,
        default=60.0,
        help="seconds (0-86400) to wait for engines (default 60)",
    )
    s.add_argument("--partial", action="store_true", help="at the timeout run CMD with what could be had")
    s.add_argument("--priority", action="store_true", help="also lower engines' limits (preempts running requests)")
    s.add_argument("--name", help="record name (default kvcached_job_<pid>)")
    s.add_argument("--json", action="store_true", help="print what is held as JSON on stdout before CMD runs")
    s.set_defaults(func=functools.partial(run, bad_input=bad_input), command=None)


def split_command(argv: List[str]) -> Tuple[List[str], Optional[List[str]]]:
    """(kvctl's arguments, CMD): everything after the first ``--`` is CMD's."""
    if "--" not in argv:
        return argv, None
    i = argv.index("--")
    return argv[:i], argv[i + 1 :]


class _Cancelled(BaseException):
    """A signal ended the wait for memory (BaseException: nothing may swallow it)."""

    def __init__(self, signo: int) -> None:
        super().__init__(signo)
        self.signo = signo


def _cancel(signo: int, _frame: Any) -> None:
    raise _Cancelled(signo)


def run(args: argparse.Namespace, bad_input: type) -> int:
    """``kvctl borrow``; raises ``bad_input`` (kvctl's BadInput) for user errors."""
    from kvcached.borrowing import reserve
    from kvcached.cli.table import printable
    from kvcached.errors import InvalidArgumentError, OutOfMemoryError
    from kvcached.units import format_size, parse_size

    command = args.command
    if not command:
        raise bad_input(f"give the command after --: {USAGE}")
    try:
        size = parse_size(args.size)
    except ValueError as e:
        raise bad_input(str(e)) from None
    if size <= 0:
        raise bad_input(f"size {args.size!r} must be > 0; give a positive size such as 4G")
    old = {s: signal.signal(s, _cancel) for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)}
    try:
        r = reserve(
            size,
            args.device,
            timeout_s=args.timeout,
            on_short="partial" if args.partial else "raise",
            name=args.name,
            priority=args.priority,
        )
    except InvalidArgumentError as e:
        raise bad_input(str(e)) from None
    except OutOfMemoryError as e:
        print(f"kvctl: borrow: {e}", file=sys.stderr)
        return EXIT_NO_MEMORY
    except _Cancelled as c:
        return 128 + c.signo
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    with r:
        held = {
            "name": r.name,
            "device": r.device,
            "requested": size,
            "nbytes": r.nbytes,
            "lowered": r.lowered,
            "command": command,
        }
        if args.json:
            json.dump(held, sys.stdout, sort_keys=True)
            sys.stdout.write("\n")
            sys.stdout.flush()
        else:
            print(
                f"kvctl borrow: {printable(r.name)} holds {format_size(r.nbytes)} of {r.device} "
                f"(asked {format_size(size)}); running {printable(shlex.join(command), 200)}",
                file=sys.stderr,
                flush=True,
            )
        env = dict(os.environ, **{ENV_NAME: r.name, ENV_DEVICE: r.device, ENV_BYTES: str(r.nbytes)})
        return run_command(command, env)


def run_command(command: List[str], env: dict) -> int:
    """Runs ``command`` to its end, forwarding signals (module doc); returns its exit status."""
    waited = set(_FORWARDED) | {signal.SIGCHLD}
    # Blocked before the spawn, so none is lost or runs a default action in between;
    # the child starts with an empty mask (setsigmask) and SIGPIPE/SIGXFSZ, which
    # Python ignores, at their defaults (as subprocess' restore_signals does).
    signal.pthread_sigmask(signal.SIG_BLOCK, waited)
    try:
        try:
            pid = os.posix_spawnp(command[0], command, env, setsigmask=(), setsigdef=(signal.SIGPIPE, signal.SIGXFSZ))
        except FileNotFoundError as e:
            print(f"kvctl: borrow: {command[0]}: {e.strerror}; check the command and PATH", file=sys.stderr)
            return EXIT_NOT_FOUND
        except OSError as e:
            print(f"kvctl: borrow: cannot run {command[0]}: {e.strerror or e}", file=sys.stderr)
            return EXIT_CANNOT_RUN
        while True:
            info = signal.sigtimedwait(waited, 1.0)  # the timeout only backs up SIGCHLD
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                code = os.waitstatus_to_exitcode(status)
                return 128 - code if code < 0 else code
            if info is None or info.si_signo == signal.SIGCHLD:
                continue
            if info.si_code == _SI_KERNEL and info.si_signo in (signal.SIGINT, signal.SIGQUIT):
                continue  # a terminal's: CMD's process group got it too
            try:
                os.kill(pid, info.si_signo)
            except ProcessLookupError:
                pass
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, waited)
