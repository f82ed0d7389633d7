"""The router tests' fixture: routers over stand-in engine processes."""

from __future__ import annotations

import pytest


@pytest.fixture
def running(tmp_path):
    """Routers over stand-in engines (``router_helpers.Running``), closed after the test."""
    from router_helpers import Running

    made = []

    def make(models, **top):
        r = Running(tmp_path, models, **top)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()
