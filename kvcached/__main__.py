"""``python -m kvcached --version``: which kvcached build this interpreter imports."""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcached", description=__doc__)
    parser.add_argument("--version", action="store_true", help="print the version, commit and location, then exit")
    args = parser.parse_args(argv)
    if not args.version:
        parser.print_help()
        return 2
    from kvcached import version_line

    print(version_line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
