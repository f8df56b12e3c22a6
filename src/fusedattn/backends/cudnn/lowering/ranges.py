"""How large a forward program's result can get: interval arithmetic over its text.

cuDNN's backward recomputes the probabilities from float32 scores, and its error grows
with their magnitude (docs/decisions.md has the measurements). So a program whose result
provably reaches beyond `LIMIT` is refused (`flex.reason`). Positions are bounded by the call's lengths, the
score is taken as [-1, 1] (a unit logit: the bound measures what the program adds to or
multiplies into it), static inputs (per-head values, lengths) as unknown. Unknown
propagates as unbounded, and an unbounded result is not refused: only what can be shown
to be large is.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Sequence, Tuple

from .program import parse_lines

LIMIT = 2.0 ** 18
Interval = Tuple[float, float]
_ANY: Interval = (-math.inf, math.inf)
_BOOL: Interval = (0.0, 1.0)
_HUGE = 1e300  # past float32's range


def _corners(f: Callable[[float, float], float], a: Interval, b: Interval) -> Interval:
    values = [f(x, y) for x in a for y in b]
    if any(math.isnan(v) for v in values):
        return _ANY
    return min(values), max(values)


def _mul(x: float, y: float) -> float:
    return 0.0 if 0.0 in (x, y) else x * y


def _monotone(f: Callable[[float], float], lo_domain: float = -math.inf):
    def apply(a: Interval) -> Interval:
        if a[0] < lo_domain:
            return _ANY
        ends = []
        for x in a:
            try:
                ends.append(f(x))
            except OverflowError:  # known to be huge, not unknown
                ends.append(math.copysign(_HUGE, x))
            except ValueError:
                return _ANY
        return ends[0], ends[1]
    return apply


def _div(a: Interval, b: Interval) -> Interval:
    if b[0] <= 0.0 <= b[1]:
        return _ANY
    return _corners(lambda x, y: x / y, a, b)


def _pow(a: Interval, b: Interval) -> Interval:
    if a[0] < 0.0 or b[0] != b[1] or not math.isfinite(a[1]):
        return _ANY  # a constant exponent of a non-negative base is what we bound
    e = b[0]
    try:
        ends = sorted((a[0] ** e if a[0] > 0 or e > 0 else math.inf, a[1] ** e))
    except (OverflowError, ZeroDivisionError):
        return _ANY
    return ends[0], ends[1]


def _abs(a: Interval) -> Interval:
    lo = 0.0 if a[0] <= 0.0 <= a[1] else min(abs(a[0]), abs(a[1]))
    return lo, max(abs(a[0]), abs(a[1]))


def _hull(a: Interval, b: Interval) -> Interval:
    return min(a[0], b[0]), max(a[1], b[1])


_UNARY: Dict[str, Callable[[Interval], Interval]] = {
    "neg": lambda a: (-a[1], -a[0]), "abs": _abs, "id": lambda a: a,
    "exp": _monotone(math.exp), "log": _monotone(math.log, lo_domain=1e-300),
    "sqrt": _monotone(math.sqrt, lo_domain=0.0), "floor": _monotone(math.floor),
    "ceil": _monotone(math.ceil), "tanh": lambda a: (-1.0, 1.0),
    "sigmoid": lambda a: (0.0, 1.0), "sin": lambda a: (-1.0, 1.0),
    "cos": lambda a: (-1.0, 1.0), "erf": lambda a: (-1.0, 1.0), "not": lambda a: _BOOL,
}
_BINARY: Dict[str, Callable[[Interval, Interval], Interval]] = {
    "add": lambda a, b: (a[0] + b[0], a[1] + b[1]),
    "sub": lambda a, b: (a[0] - b[1], a[1] - b[0]),
    "mul": lambda a, b: _corners(_mul, a, b), "div": _div, "pow": _pow,
    "max": lambda a, b: (max(a[0], b[0]), max(a[1], b[1])),
    "min": lambda a, b: (min(a[0], b[0]), min(a[1], b[1])),
    "mod": lambda a, b: (-max(map(abs, b)), max(map(abs, b))),
}


def bound(lines: Sequence[str], s_q: int, s_kv: int) -> float:
    """The largest magnitude the program's result can reach (inf: not known), masked
    pairs (a select to -inf) aside."""
    known: Dict[str, Interval] = {"s": (-1.0, 1.0), "q": (0.0, max(s_q - 1, 0)),
                                  "k": (0.0, max(s_kv - 1, 0))}
    values: List[Interval] = []

    def read(token: str) -> Interval:
        if token in known:
            return known[token]
        if token.startswith("v"):
            return values[int(token[1:])]
        if token.startswith("c"):
            value = float(token[1:])
            return (value, value) if math.isfinite(value) else _ANY
        return _ANY  # a static input: its values are not known here
    for op, args in parse_lines(lines):
        base = op.split(".")[0]
        if base in ("eq", "ne", "gt", "ge", "lt", "le", "and", "or"):
            values.append(_BOOL)
        elif base == "sel":  # a select to -inf is a mask: its other side is the value
            sides = [read(t) for t in args[1:] if t != "c-inf"]
            values.append(sides[0] if len(sides) == 1 else _hull(*sides))
        elif base in _UNARY and len(args) == 1:
            values.append(_UNARY[base](read(args[0])))
        elif base in _BINARY and len(args) == 2:
            values.append(_BINARY[base](read(args[0]), read(args[1])))
        else:
            values.append(_ANY)
    if not values:
        return 1.0
    lo, hi = values[-1]
    return max(abs(lo), abs(hi))
