"""The equations that made a jit tracer, walked back from it.

Each tracer of a jit trace links to the equation that produced it (``.parent``, a JAX
internal, with the equation's input tracers); a trace's constants sit in its frame.
`Walk` follows those links from one tracer, through the equations its caller
chooses to expand, and keeps what it stops at as leaves: inputs of the traced
function, trace constants, outputs of equations it does not expand. `rebuild` binds
the walked equations again on values given for the leaves.
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
        trace = getattr(x, "_trace", None)
        consts = getattr(getattr(trace, "frame", None), "constvar_to_val", None)
        if consts is None or not hasattr(x, "parent"):
            raise NotWalkable("not a tracer of a jit trace")
        self.trace, self.x = trace, x
        self.order: List[object] = []
        self.leaves: Dict[object, object] = {}
        self.consts: Dict[object, object] = {}
        seen, count = set(), 0
        stack = [(x, False)]
        while stack:
            tracer, done = stack.pop()
            atom = self.atom(tracer)
            if done:
                self.order.append(tracer.parent)
                continue
            if isinstance(atom, Literal) or atom in seen:
                continue
            seen.add(atom)
            eqn = tracer.parent
            if atom in consts or eqn is None or not expand(eqn):
                self.leaves[atom] = tracer
                if atom in consts:
                    self.consts[atom] = consts[atom]
                continue
            count += 1
            if count > max_equations:
                raise NotWalkable(f"more than {max_equations} equations")
            stack.append((tracer, True))
            stack += [(t, False) for t in eqn.in_tracers]

    def atom(self, tracer):
        """The variable (or literal) of a tracer of this walk's trace."""
        if not isinstance(tracer, jax.core.Tracer) or \
                getattr(tracer, "_trace", None) is not self.trace:
            raise NotWalkable("a tracer of an enclosing or inner transformation")
        return tracer.val

    def rebuild(self, values: Dict):
        """The value of `x`, the walked equations bound again under the current trace
        on `values` (``{leaf variable: array}``)."""
        values = dict(values)
        done = set()
        for eqn in self.order:
            if id(eqn) in done:
                continue
            done.add(id(eqn))
            ins = [t.val.val if isinstance(t.val, Literal) else values[t.val]
                   for t in eqn.in_tracers]
            outs = eqn.primitive.bind(*ins, **eqn.params)
            outs = outs if eqn.primitive.multiple_results else [outs]
            values.update(zip(eqn.outvars, outs))
        return values[self.x.val]
