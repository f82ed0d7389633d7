"""Interpreter-start hook (imported by kvcached_autopatch.pth).

It must never break interpreter start-up: it only looks at the environment and
returns when kvcached is not enabled. Engine patches register from here once
the engine integrations exist.
"""

import os


def _wanted() -> bool:
    return os.environ.get("ENABLE_KVCACHED", "").strip().lower() in ("1", "true", "yes", "on")


if _wanted():  # pragma: no cover - engine integrations hook in here
    pass
