"""``python -m kvcached.router serve CONFIG``: the same as ``kvcached serve CONFIG``."""

import sys

from kvcached.router.cli import main

sys.exit(main())
