"""The guardian of a priority borrow's lowered limits (kvcached.borrowing.priority).

    python -m kvcached.borrowing.guard <borrower name>

Reads JSON lines on stdin: ``{"cuts": {engine: [original, limit, revision]}}``
(the whole table, before every limit write) and ``{"done": true}`` (the
borrower restored them itself). When stdin closes without "done" the
borrower died: every limit still as it left it is restored, one line each on
stderr. Started in its own session by the borrower; nothing else starts it.
"""

from __future__ import annotations

import json
import signal
import sys
from typing import Dict, List


def main(argv: List[str]) -> int:
    borrower = argv[0] if argv else "?"
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only the pipe ends it
    table: Dict[str, list] = {}
    for line in sys.stdin:
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        if msg.get("done"):
            return 0
        if isinstance(msg.get("cuts"), dict):
            table = msg["cuts"]
    if not table:
        return 0
    from kvcached.borrowing.priority import Cut, restore_cut

    for name, (original, limit, revision) in sorted(table.items()):
        what = restore_cut(name, Cut(int(original), int(limit), int(revision)))
        print(f"kvcached: borrow {borrower} ended without giving back; the limit of {name}: {what}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
