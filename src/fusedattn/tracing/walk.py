"""The equations that made a jit tracer, walked back from it.

Each tracer of a jit trace links to the equation that produced it (``.parent``, a JAX
internal, with the equation's input tracers); a trace's constants sit in its frame.
`Walk` follows those links from one tracer, through the equations its caller
chooses to expand, and keeps what it stops at as leaves: inputs of the traced
function, trace constants, outputs of equations it does not expand. A constant that is
an enclosing jit trace's tracer (an array a `lax.scan` body, a `jax.checkpoint`ed or
jitted function closes over) is followed into that trace, so a mask made outside the
inner function is seen whole. An input of the inner function has no such link: it
stays a leaf. `rebuild` binds the walked equations again on values given for the
leaves.
"""
from __future__ import annotations

from typing import Callable, Dict, List

import jax
from jax.extend.core import Literal


class NotWalkable(Exception):
    """The tracer is not of a jit trace this module reads, or its graph is too large or
    reaches another transformation's tracer."""


class Walk:
    """The graph behind jit tracer `x`: `order` (equations, producers first), `leaves`
    (``{variable: tracer}`` where the walk stopped) and `consts` (``{variable: value}``
    of the leaves that are trace constants)."""

    def __init__(self, x, expand: Callable[[object], bool], max_equations: int):
        if _constants(x) is None or not hasattr(x, "parent"):
            raise NotWalkable("not a tracer of a jit trace")
        self.x = x
        self.traces = {id(x._trace)}   # (x's, and the enclosing ones its constants lead to)
        self.order: List[object] = []  # equations, and (inner variable, outer tracer) links
        self.leaves: Dict[object, object] = {}
        self.consts: Dict[object, object] = {}
        seen, count = set(), 0
        stack = [(x, False)]
        while stack:
            tracer, done = stack.pop()
            if done:
                self.order.append(tracer)
                continue
            atom = self.atom(tracer)
            if isinstance(atom, Literal) or atom in seen:
                continue
            seen.add(atom)
            consts = _constants(tracer)
            outer = consts.get(atom)
            if atom in consts and _constants(outer) is not None and hasattr(outer, "parent"):
                self.traces.add(id(outer._trace))   # (follow the constant into its trace)
                stack += [((atom, outer), True), (outer, False)]
                continue
            eqn = tracer.parent
            if atom in consts or eqn is None or not expand(eqn):
                self.leaves[atom] = tracer
                if atom in consts:
                    self.consts[atom] = outer
                continue
            count += 1
            if count > max_equations:
                raise NotWalkable(f"more than {max_equations} equations")
            stack.append((eqn, True))
            stack += [(t, False) for t in eqn.in_tracers]

    def atom(self, tracer):
        """The variable (or literal) of a tracer of this walk's traces."""
        if not isinstance(tracer, jax.core.Tracer) or \
                id(getattr(tracer, "_trace", None)) not in self.traces:
            raise NotWalkable("a tracer of an inner or unrelated transformation")
        return tracer.val

    def rebuild(self, values: Dict):
        """The value of `x`, the walked equations bound again under the current trace
        on `values` (``{leaf variable: array}``)."""
        values = dict(values)
        done = set()
        for eqn in self.order:
            if isinstance(eqn, tuple):   # (a constant of an inner trace: its outer value)
                inner, outer = eqn
                values[inner] = _value(outer.val, values)
                continue
            if id(eqn) in done:
                continue
            done.add(id(eqn))
            ins = [_value(t.val, values) for t in eqn.in_tracers]
            outs = eqn.primitive.bind(*ins, **eqn.params)
            outs = outs if eqn.primitive.multiple_results else [outs]
            values.update(zip(eqn.outvars, outs))
        return values[self.x.val]


# Operations that only move or convert an array's elements: an input behind them is still
# the input (`mask_program` adds `iota` and a rule for each).
MOVES = frozenset({"broadcast_in_dim", "reshape", "squeeze", "transpose", "slice", "rev",
                   "copy", "copy_p", "convert_element_type"})


def is_input(x) -> bool:
    """Whether jit tracer `x` is an input of the function being traced (or of an enclosing
    one it closes over), up to moves and conversions: whatever made it outside is not
    visible in this trace."""
    try:
        walk = Walk(x, lambda eqn: eqn.primitive.name in MOVES, 16)
    except NotWalkable:
        return False
    return bool(walk.leaves) and all(t.parent is None and v not in walk.consts
                                     for v, t in walk.leaves.items())


def _constants(tracer):
    """``{variable: value}`` of the constants of `tracer`'s jit trace, or None when it is
    not a tracer of one."""
    frame = getattr(getattr(tracer, "_trace", None), "frame", None)
    return getattr(frame, "constvar_to_val", None)


def _value(atom, values):
    return atom.val if isinstance(atom, Literal) else values[atom]
