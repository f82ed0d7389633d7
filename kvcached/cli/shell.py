"""``kvctl`` without a command (or ``kvctl shell``): upstream's interactive shell.

Each line is one kvctl command, parsed and checked exactly as on the command
line (``kvctl.main``), so a typo gets the same one-line error and changes
nothing. Tab completes commands and instance names where readline exists;
history is kept in ``~/.kvctl_history`` (0600). Unlike upstream's shell, a
line that is not a kvctl command is an error, never run by the system shell.
"""

from __future__ import annotations

import os
import shlex
import sys
from typing import Callable, List, Optional, Sequence

COMMANDS = ("list", "limit", "limit-percent", "watch", "kvtop", "delete", "cleanup", "version", "help", "exit", "quit")
HELP = """commands (as on the command line; `<command> --help` for options):
  list [NAME ...] [--json]          instances and their memory
  limit NAME SIZE                   cap an instance (512M, 2G, bytes)
  limit-percent NAME PCT            cap at a percent of the device's usable memory
  watch [-n SEC] [NAME ...]         list every -n seconds (Ctrl-C stops)
  kvtop [-r SEC] [NAME ...]         live table (q quits)
  delete NAME [--force]             remove a record
  cleanup                           remove every dead record
  version                           the kvcached build
  help, exit, quit"""
HISTORY = os.path.expanduser("~/.kvctl_history")


def _instance_names() -> List[str]:
    from kvcached.limits.records import list_records

    try:
        return [r.name for r in list_records()]
    except Exception:  # completion must never break the prompt
        return []


def _setup_readline() -> Optional[Callable[[], None]]:
    """Completion and history; returns the function that saves the history (None: no readline)."""
    try:
        import readline
    except ImportError:
        return None

    def complete(text: str, state: int) -> Optional[str]:
        words = readline.get_line_buffer()[: readline.get_begidx()].split()
        pool: Sequence[str] = COMMANDS if not words else _instance_names()
        options = [w for w in pool if w.startswith(text)]
        return options[state] if state < len(options) else None

    readline.set_completer(complete)
    readline.parse_and_bind("tab: complete")
    try:
        readline.read_history_file(HISTORY)
    except OSError:
        pass

    def save() -> None:
        try:
            readline.write_history_file(HISTORY)
            os.chmod(HISTORY, 0o600)
        except OSError:
            pass

    return save


def run(dispatch: Callable[[List[str]], int], stdin=None) -> int:  # noqa: ANN001 - a text stream
    """Reads commands until ``exit``, ``quit`` or end of input; returns the last command's status."""
    stdin = sys.stdin if stdin is None else stdin
    interactive = stdin.isatty()
    save = _setup_readline() if interactive else None
    if interactive:
        print("kvctl shell: 'help' lists the commands, 'exit' quits.")
    status = 0
    try:
        while True:
            try:
                line = input("kvctl> ") if interactive else stdin.readline()
            except KeyboardInterrupt:
                print()
                continue
            except EOFError:
                print()
                break
            if not interactive and not line:
                break  # end of input
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            if line in ("exit", "quit"):
                break
            if line == "help":
                print(HELP)
                continue
            try:
                tokens = shlex.split(line)
            except ValueError as e:
                print(f"kvctl: error: {e}; quote names with spaces", file=sys.stderr)
                status = 2
                continue
            if tokens[0] == "shell":
                print("kvctl: already in the shell", file=sys.stderr)
                continue
            if tokens[0] == "borrow":  # it runs a program: the shell runs none
                print(
                    "kvctl: error: borrow runs a command; run `kvctl borrow SIZE -- CMD` from your shell",
                    file=sys.stderr,
                )
                status = 2
                continue
            try:
                status = dispatch(tokens)
            except SystemExit as e:  # argparse's one-line error (or --help)
                status = e.code if isinstance(e.code, int) else 2
            sys.stdout.flush()
    finally:
        if save is not None:
            save()
    return status
