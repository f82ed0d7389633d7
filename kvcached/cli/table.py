"""Plain-text tables of instance records, shared by kvctl and kvtop.

Every text taken from a record is passed through ``printable`` first: a name
is whatever bytes sit in a file in /dev/shm, and terminal escape codes in it
must reach the screen as text, not as commands.
"""

from __future__ import annotations

from typing import Dict, List, Sequence

from kvcached.limits.budget import WANT_TTL_S
from kvcached.limits.records import RecordView
from kvcached.units import format_size

RECORD_HEADERS = (
    "NAME",
    "ENGINE",
    "DEVICE",
    "PID",
    "STATE",
    "LIMIT",
    "USED",
    "PREALLOC",
    "MAPPED",
    "HELD",
    "LIMIT%",
    "WANTS",
    "LEAKED",
    "REV",
)


def printable(text: object, limit: int = 128) -> str:
    """``text`` with every non-printable or non-ASCII character escaped
    (``\\x1b``, ``\\u202e``), cut to ``limit`` characters."""
    s = str(text)
    if s.isascii() and s.isprintable():
        return s[:limit]
    return "".join(c if c.isascii() and c.isprintable() else ascii(c)[1:-1] for c in s)[:limit]


def render(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned text columns, two spaces apart; numbers right-aligned."""
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, row)]
    numeric = [all(_is_number(r[i]) for r in rows) and bool(rows) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(cells, widths, numeric)).rstrip()

    return "\n".join([line(headers)] + [line(r) for r in rows])


def _is_number(s: str) -> bool:
    return bool(s) and (s[0].isdigit() or s == "-")


def percent(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.0f}%" if whole > 0 else "-"


def record_head(r: RecordView) -> List[str]:
    """The columns every record table starts with: NAME ENGINE DEVICE PID STATE LIMIT USED PREALLOC."""
    return [
        printable(r.name),
        printable(r.engine) or "-",
        printable(r.device),
        str(r.owner_pid),
        r.state,
        format_size(r.limit),
        format_size(r.used),
        format_size(r.prealloc),
    ]


def record_row(r: RecordView) -> List[str]:
    return record_head(r) + [
        format_size(r.mapped),
        format_size(r.held),  # budget bytes: a grant beyond what is mapped, or a borrower's (engine "job")
        percent(r.mapped, r.limit),
        _wants(r),
        format_size(r.quarantined) if r.quarantined else "-",
        str(r.revision),
    ]


def _wants(r: RecordView) -> str:
    """What the instance's load lacks because the device budget is full ("-": nothing)."""
    n = r.wants(WANT_TTL_S)
    return format_size(n) if n else "-"


def problems(records: Sequence[RecordView]) -> List[str]:
    """One line per record that is invalid, busy or holds leaked memory, saying why."""
    out = []
    for r in records:
        if r.damaged:
            out.append(
                f"! {printable(r.name)}: damaged while its owner lives; every budget of this user counts it as "
                f"full until it is restarted: {printable(r.problem, 300)}"
            )
        elif r.problem:
            out.append(f"! {printable(r.name)}: invalid, ignored by budgets: {printable(r.problem, 300)}")
        elif r.busy:
            out.append(f"! {printable(r.name)}: busy: a limit write did not finish (limit and revision may not pair)")
        if r.stats_problem and not r.problem:
            out.append(f"! {printable(r.name)}: statistics not shown: {printable(r.stats_problem, 300)}")
        if r.quarantined:
            out.append(
                f"! {printable(r.name)}: {format_size(r.quarantined)} could not be released (driver error); "
                "it stays allocated until the instance exits"
            )
    return out


def records_table(records: Sequence[RecordView]) -> str:
    if not records:
        return "no kvcached instances (records in /dev/shm readable by this user)"
    return "\n".join([render(RECORD_HEADERS, [record_row(r) for r in records])] + problems(records))


def device_summaries(records: Sequence[RecordView]) -> List[Dict[str, object]]:
    """Per device: usable bytes (as its valid instances report it), held, mapped, counts."""
    out: Dict[str, Dict[str, object]] = {}
    for r in records:
        d = out.setdefault(
            printable(r.device),
            {"device": printable(r.device), "usable": 0, "held": 0, "mapped": 0, "alive": 0, "dead": 0, "invalid": 0},
        )
        kind = "invalid" if not r.valid else "alive" if r.alive else "dead"
        d[kind] = int(d[kind]) + 1  # type: ignore[arg-type]
        if kind == "invalid":
            continue
        d["usable"] = max(int(d["usable"]), r.device_bytes)  # type: ignore[arg-type]
        d["held"] = int(d["held"]) + r.held  # type: ignore[arg-type]
        d["mapped"] = int(d["mapped"]) + (r.mapped if r.alive else 0)  # type: ignore[arg-type]
    return list(out.values())
