"""kvtop: a live table of kvcached instances and their devices.

    kvtop [-n SEC | -r SEC | --refresh SEC] [--once] [--count N] [NAME ...]

``--refresh``/``-r`` and the instance names are upstream kvtop's spellings.

Reads the records in /dev/shm through the extension only: it imports neither
torch nor any GPU library, so it runs over ssh on any box that has the
records. On a terminal it redraws in place (q or Ctrl-C quits); in a pipe it
prints one frame per refresh.
"""

from __future__ import annotations

import os
import select
import socket
import sys
import time
from typing import Optional, Sequence

from kvcached.cli import args as args_mod
from kvcached.cli.table import device_summaries, percent, printable, problems, record_head, render
from kvcached.limits.records import RecordView, list_records
from kvcached.naming import validate_name
from kvcached.units import format_size

BAR_WIDTH = 20


def bar(part: int, whole: int, width: int = BAR_WIDTH) -> str:
    """``[#####.....]``: part of whole; ``!`` marks over the whole (shrinking)."""
    if whole <= 0:
        return "[" + "?" * width + "]"
    filled = min(width, int(round(width * part / whole)))
    over = part > whole
    return "[" + ("!" if over else "#") * filled + "." * (width - filled) + "]"


def frame(records: Sequence[RecordView], interval: float, names: Sequence[str] = ()) -> str:
    """One screen: header, per-device budget lines, per-instance rows."""
    lines = [
        f"kvtop  {socket.gethostname()}  {time.strftime('%Y-%m-%d %H:%M:%S')}  every {interval:g}s  (q quits)",
        "",
    ]
    devs = device_summaries(records)
    if devs:
        rows = []
        for d in devs:
            usable, held, mapped = int(d["usable"]), int(d["held"]), int(d["mapped"])  # type: ignore[arg-type]
            rows.append(
                [
                    str(d["device"]),
                    format_size(usable) if usable else "-",
                    format_size(held),
                    format_size(mapped),
                    bar(mapped, usable) + " " + percent(mapped, usable),
                    f"{d['alive']} alive, {d['dead']} dead" + (f", {d['invalid']} invalid" if d["invalid"] else ""),
                ]
            )
        lines.append(render(("DEVICE", "USABLE", "HELD", "MAPPED", "USE", "INSTANCES"), rows))
        lines.append("")
    if not records:
        which = f"named {', '.join(map(printable, names))}" if names else "(records in /dev/shm readable by this user)"
        lines.append(f"no kvcached instances {which}")
        return "\n".join(lines)
    rows = [
        record_head(r)
        + [format_size(r.granted) if r.granted else "-", bar(r.mapped, r.limit) + " " + percent(r.mapped, r.limit)]
        for r in records
    ]
    lines.append(
        render(("NAME", "ENGINE", "DEVICE", "PID", "STATE", "LIMIT", "USED", "PREALLOC", "GRANT", "MAPPED/LIMIT"), rows)
    )
    lines.extend(problems(records))
    return "\n".join(lines)


def _wait_for_quit(timeout: float, interactive: bool) -> bool:
    """Sleeps up to ``timeout``; True if the user pressed q."""
    if not interactive:
        time.sleep(timeout)
        return False
    ready, _, _ = select.select([sys.stdin], [], [], timeout)
    if ready:
        ch = os.read(sys.stdin.fileno(), 1)
        return ch in (b"q", b"Q", b"\x03")
    return False


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = args_mod.OneLineParser(prog="kvtop", description="Live table of kvcached instances.")
    p.add_argument(
        "-n", "--interval", "-r", "--refresh", dest="interval", type=args_mod.interval, default=1.0,
        help="seconds between refreshes",
    )  # fmt: skip
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    p.add_argument("--count", type=args_mod.count, default=None, help="stop after this many frames (>= 1)")
    p.add_argument("names", nargs="*", metavar="NAME", help="only these instances (default: every one)")
    args = p.parse_args(argv)
    for name in args.names:
        try:
            validate_name(name)
        except ValueError as e:
            p.error(str(e))
    names = set(args.names)
    count = 1 if args.once else args.count
    tty = sys.stdout.isatty() and not args.once
    interactive = tty and sys.stdin.isatty()
    old_term = None
    if interactive:
        import termios
        import tty as ttymod

        old_term = termios.tcgetattr(sys.stdin.fileno())
        ttymod.setcbreak(sys.stdin.fileno())
    if tty:
        sys.stdout.write("\x1b[?1049h\x1b[?25l")  # alternate screen, hide cursor
    n = 0
    try:
        while count is None or n < count:
            recs = [r for r in list_records() if not names or r.name in names]
            text = frame(recs, args.interval, args.names)
            if tty:
                sys.stdout.write("\x1b[H\x1b[2J" + text + "\n")
            else:
                sys.stdout.write(("\n" if n else "") + text + "\n")
            sys.stdout.flush()
            n += 1
            if count is not None and n >= count:
                break
            if _wait_for_quit(args.interval, interactive):
                break
    except KeyboardInterrupt:
        pass
    except BrokenPipeError:
        return 0
    finally:
        if tty:
            sys.stdout.write("\x1b[?25h\x1b[?1049l")
            sys.stdout.flush()
        if old_term is not None:
            import termios

            termios.tcsetattr(sys.stdin.fileno(), termios.TCSADRAIN, old_term)
    return 0


if __name__ == "__main__":
    sys.exit(main())
