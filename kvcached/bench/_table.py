"""Shared output for benchmarks: an aligned text table, or JSON with --json."""

from __future__ import annotations

import json
import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence


def print_table(
    rows: Sequence[Dict[str, object]], columns: Optional[Sequence[str]], as_json: bool, meta: Dict[str, object]
) -> None:
    """``columns``: the table's columns in order; None: the first row's keys (a benchmark
    whose rows are built in table order names its columns once, in the row)."""
    if columns is None:
        columns = list(rows[0]) if rows else []
    if as_json:
        print(json.dumps({"meta": meta, "rows": list(rows)}, indent=2))
        return
    for k, v in meta.items():
        print(f"# {k}: {v}")
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) if rows else len(c) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns))
    print("  ".join("-" * widths[c] for c in columns))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(widths[c]) for c in columns))


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return "" if v is None else str(v)


def median_time(fn: Callable[[], None], repeats: int) -> float:
    """Median wall time of fn() over `repeats` runs, in seconds."""
    times: List[float] = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
