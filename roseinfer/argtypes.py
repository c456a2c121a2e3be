"""Flag value types: argparse ``type`` functions with the range in their error.

Shared by the command-line tools (``roseinfer.cli``) and by the policy flags an
engine embedding the policies parses (:mod:`roseinfer.policy_args`), so a value
range is written once. Nothing here parses a command line.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

MAX_INT_FLAG = 2**31 - 1
"""Largest value of a count flag (tokens, sequences): int32, the index type of tensors."""


def clip(text: str, max_chars: int = 40) -> str:
    """``text`` cut to ``max_chars`` characters (with ``...``), for echoing a user's
    value in an error."""
    return text if len(text) <= max_chars else text[:max_chars] + "..."


def int_in(lo: int, hi: int = MAX_INT_FLAG) -> Callable[[str], int]:
    """An argparse ``type``: an integer in ``[lo, hi]`` (the error names the range)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {clip(text)!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(
                f"must be an integer in [{lo}, {hi}], got {clip(text)!r}"
            )
        return value

    return parse


def float_in(
    lo: float, hi: float = math.inf, *, lo_open: bool = False, allow_inf: bool = False
) -> Callable[[str], float]:
    """An argparse ``type``: a number in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``),
    never NaN, and infinite only with ``allow_inf`` (the error names the range)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {clip(text)!r}") from None
        in_range = (lo < value if lo_open else lo <= value) and value <= hi
        if not in_range or (math.isinf(value) and not allow_inf):
            what = _range(lo, hi, lo_open, allow_inf)
            raise argparse.ArgumentTypeError(f"must be {what}, got {clip(text)!r}")
        return value

    return parse


def _range(lo: float, hi: float, lo_open: bool, allow_inf: bool) -> str:
    if math.isfinite(hi):
        return f"a number in {'(' if lo_open else '['}{lo:g}, {hi:g}]"
    kind = "a number" if allow_inf else "a finite number"
    bound = "" if math.isinf(lo) else f" {'>' if lo_open else '>='} {lo:g}"
    return f"{kind}{bound}{' (or inf)' if allow_inf else ''}"


POSITIVE = int_in(1)
"""argparse type of a count flag: an integer in [1, 2^31 - 1]."""
