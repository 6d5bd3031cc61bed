"""argparse types the command lines share (``autopar``'s and ``autopar.tools.bench``'s).

In: the bounds of an option's value. Out: a function argparse calls on the option's text,
returning the value or raising ``argparse.ArgumentTypeError`` with the fix.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable


def at_least(minimum: int, what: str) -> Callable[[str], int]:
    """An argparse type: a whole number of ``what`` of at least ``minimum``."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            n = minimum - 1
        if n < minimum:
            raise argparse.ArgumentTypeError(
                f"{text!r}: give a whole number of {what}, {minimum} or more"
            )
        return n

    return parse
