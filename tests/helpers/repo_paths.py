"""Where things are in the checkout, for tests in any folder under tests/ (one place
knows the layout, so a test that moves between folders keeps finding them)."""

from __future__ import annotations

import os

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/
ROOT = os.path.dirname(TESTS)  # the checkout: README.md, docs/, scripts/, kvcached/
