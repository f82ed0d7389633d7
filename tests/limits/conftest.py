"""The limits tests' fixtures: instances in child processes (``limits_helpers.Worker``)."""

from __future__ import annotations

import pytest

from limits_helpers import Worker


@pytest.fixture
def workers():
    """Start instances in child processes (``workers(name=..., pages=..., ...)``); killed after the test."""
    made = []

    def start(**cfg):
        w = Worker(**cfg)
        made.append(w)
        return w

    yield start
    for w in made:
        w.kill()
