"""Numbers on the kvctl/kvtop command lines: ASCII digits only, finite, bounded.

argparse's ``type=float``/``int`` would take ``inf`` (a wait that never ends),
``nan``, ``1_0`` or non-ASCII digits such as ``１２３``; these parsers refuse
them with one line naming what is accepted (argparse exits 2 with it).
"""

from __future__ import annotations

import argparse
import re

_DECIMAL = re.compile(r"^\s*([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))\s*$", re.ASCII)
_INTEGER = re.compile(r"^\s*([0-9]+)\s*$", re.ASCII)

MAX_INTERVAL_S = 86400.0  # a refresh period of a day at most
MAX_WAIT_S = 3600.0  # how long kvctl limit may wait for the owner's acknowledgement
MAX_COUNT = 1 << 31
MAX_REVISION = (1 << 32) - 1  # revisions are 32-bit counters in the record


def decimal(text: str, what: str, lo: float, hi: float, lo_open: bool = False) -> float:
    """``text`` as a number in [lo, hi] (``(lo, hi]`` with ``lo_open``); ValueError naming the range."""
    m = _DECIMAL.match(str(text))
    span = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
    if not m:
        raise ValueError(f"{what} {text!r} is not a number; give a decimal number in {span}")
    v = float(m.group(1))
    if v > hi or v < lo or (lo_open and v == lo):
        raise ValueError(f"{what} {text!r} is outside {span}")
    return v


def integer(text: str, what: str, lo: int, hi: int) -> int:
    """``text`` as an integer in [lo, hi]; ValueError naming the range."""
    m = _INTEGER.match(str(text))
    if not m:
        raise ValueError(f"{what} {text!r} is not an integer; give one in [{lo}, {hi}]")
    v = int(m.group(1))
    if not lo <= v <= hi:
        raise ValueError(f"{what} {text!r} is outside [{lo}, {hi}]")
    return v


def _arg_type(fn, *a):  # noqa: ANN001, ANN202 - argparse type= adapters
    def parse(text: str):  # noqa: ANN202
        try:
            return fn(text, *a)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse


interval = _arg_type(decimal, "-n", 0.0, MAX_INTERVAL_S, True)
wait = _arg_type(decimal, "--wait", 0.0, MAX_WAIT_S)
count = _arg_type(integer, "--count", 1, MAX_COUNT)
port = _arg_type(integer, "--port", 0, 65535)
borrow_timeout = _arg_type(decimal, "--timeout", 0.0, 86400.0)  # kvctl borrow: at most a day


class OneLineParser(argparse.ArgumentParser):
    """Bad arguments: one line on stderr naming the fix, exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog.split()[0]}: error: {message}; see `{self.prog.split()[0]} --help`\n")
