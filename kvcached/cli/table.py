"""Plain-text tables of instance records, shared by kvctl and kvtop."""

from __future__ import annotations

from typing import Dict, List, Sequence

from kvcached.limits.budget import WANT_TTL_S
from kvcached.limits.records import RecordView
from kvcached.limits.units import format_size

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
    "LIMIT%",
    "WANTS",
    "REV",
)


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


def record_row(r: RecordView) -> List[str]:
    return [
        r.name,
        r.engine or "-",
        r.device,
        str(r.owner_pid),
        r.state,
        format_size(r.limit),
        format_size(r.used),
        format_size(r.prealloc),
        format_size(r.mapped),
        percent(r.mapped, r.limit),
        _wants(r),
        str(r.revision),
    ]


def _wants(r: RecordView) -> str:
    """What the instance's load lacks because the device budget is full ("-": nothing)."""
    n = r.wants(WANT_TTL_S)
    return format_size(n) if n else "-"


def records_table(records: Sequence[RecordView]) -> str:
    if not records:
        return "no kvcached instances (records in /dev/shm readable by this user)"
    return render(RECORD_HEADERS, [record_row(r) for r in records])


def device_summaries(records: Sequence[RecordView]) -> List[Dict[str, object]]:
    """Per device: usable bytes (as its instances report it), held, mapped, counts."""
    out: Dict[str, Dict[str, object]] = {}
    for r in records:
        d = out.setdefault(r.device, {"device": r.device, "usable": 0, "held": 0, "mapped": 0, "alive": 0, "dead": 0})
        d["usable"] = max(int(d["usable"]), r.device_bytes)  # type: ignore[arg-type]
        d["held"] = int(d["held"]) + r.held  # type: ignore[arg-type]
        d["mapped"] = int(d["mapped"]) + (r.mapped if r.alive else 0)  # type: ignore[arg-type]
        d["alive" if r.alive else "dead"] = int(d["alive" if r.alive else "dead"]) + 1  # type: ignore[arg-type]
    return list(out.values())
