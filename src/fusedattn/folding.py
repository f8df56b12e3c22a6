"""The value, at trace time, of a traced array computed from constants alone.

Flax's ``make_causal_mask`` and ``jnp.tril(jnp.ones(...))`` inside a user's jit build a
mask from ``iota`` and literals: its value never depends on the function's inputs,
but reaches us as a tracer. `host_value` walks the equations that made it (each jit
tracer links to the equation that produced it) back to literals and the trace's
constants and, when no input of the traced function is among them, evaluates those
equations on the host: the drop-ins then recognise the mask (`block_sparse.recognise`)
as the built-in mask it is, with nothing left to run on the device.

Only primitives whose results are exact on every backend are evaluated (`_EXACT`;
arithmetic only on integers and booleans), so the host value is the value the device
would compute. Anything else (an input, a random number, a transcendental function, a
tracer of another transformation) gives None, and the caller keeps the traced array.
This reads JAX's tracing internals (`DynamicJaxprTracer.parent`, the trace's
constants); where they differ the answer is None, never a guess.
"""
from __future__ import annotations

from typing import Callable, Optional

import jax
import numpy as np
from jax.extend.core import Literal

# Shape and layout, comparison, boolean and selection primitives: exact in any dtype.
_EXACT = frozenset({
    "iota", "broadcast_in_dim", "reshape", "squeeze", "transpose",
    "convert_element_type", "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not", "xor",
    "select_n", "concatenate", "slice", "dynamic_slice", "pad", "rev", "max", "min", "neg",
    "abs", "sign", "clamp", "copy", "reduce_and", "reduce_or", "reduce_max",
    "reduce_min", "floor", "ceil", "round", "stop_gradient"})
# Arithmetic, exact on integers and booleans (float results could round differently).
_INTEGER = frozenset({"add", "sub", "mul", "div", "rem", "integer_pow", "shift_left",
                      "shift_right_logical", "shift_right_arithmetic", "population_count"})
# Calls whose bodies are checked equation by equation.
_CALLS = frozenset({"pjit", "jit", "closed_call", "core_call"})
MAX_EQUATIONS = 512      # equations walked at most
MAX_ELEMENTS = 1 << 31   # elements of the value (and of any intermediate) at most
MAX_CONSTANT = 1 << 26   # elements of a trace constant read at most


class _NotConstant(Exception):
    pass


def host_value(x, reduce: Optional[Callable] = None):
    """`x` as a NumPy array when its value is known at trace time (a NumPy array, or a
    jit tracer computed from constants by exact primitives), else None. With `reduce`,
    ``reduce(x)`` (a pytree of arrays, from jnp code) instead, computed in the same
    XLA program on the host: a large mask need not exist whole on the host."""
    if isinstance(x, np.ndarray):
        return x if reduce is None else jax.tree.map(np.asarray, reduce(x))
    if not isinstance(x, jax.core.Tracer):
        return None
    try:
        build = _Graph(x).rebuild
        try:
            cpu = jax.devices("cpu")[0]
        except RuntimeError:   # (JAX_PLATFORMS without cpu: the default device evaluates)
            cpu = None
        # (run now, not staged into the caller's trace; traced again, as a program of its own)
        with jax.ensure_compile_time_eval(), jax.default_device(cpu):
            out = jax.jit(lambda: (reduce or (lambda v: v))(build()))()
        return jax.tree.map(np.asarray, out)
    except _NotConstant:
        return None
    except Exception:  # noqa: BLE001 - internals of another JAX version: keep the tracer
        return None


class _Graph:
    """The equations that made tracer `x`, walked back from it and checked: exact
    primitives, no input of the traced function, no other trace's tracer."""

    def __init__(self, x):
        trace = getattr(x, "_trace", None)
        consts = getattr(getattr(trace, "frame", None), "constvar_to_val", None)
        if consts is None or not hasattr(x, "parent"):
            raise _NotConstant
        self.trace, self.consts, self.x = trace, consts, x
        self.order, self.leaves, seen = [], {}, set()   # equations, producers first
        stack = [(x, False)]
        while stack:
            tracer, done = stack.pop()
            atom = self._atom(tracer)
            if done:
                self.order.append(tracer.parent)
                continue
            if isinstance(atom, Literal) or atom in seen:
                continue
            seen.add(atom)
            if atom in consts:
                self.leaves[atom] = self._constant(consts[atom])
                continue
            eqn = tracer.parent
            _check_eqn(eqn)
            if len(seen) > MAX_EQUATIONS:
                raise _NotConstant
            stack.append((tracer, True))
            stack += [(t, False) for t in eqn.in_tracers]

    def _atom(self, tracer):
        if not isinstance(tracer, jax.core.Tracer) or \
                getattr(tracer, "_trace", None) is not self.trace:
            raise _NotConstant   # a tracer of an enclosing or inner transformation
        return tracer.val

    @staticmethod
    def _constant(value):
        # (an enclosing trace's tracer lifted into this one is a constant too)
        if isinstance(value, jax.core.Tracer) or np.size(value) > MAX_CONSTANT:
            raise _NotConstant
        return np.asarray(value)

    def rebuild(self):
        """The value of `x`, its equations bound again under the current trace."""
        values = dict(self.leaves)
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


def _check_eqn(eqn) -> None:
    """Raise _NotConstant unless `eqn` (None: an input of the traced function) is exact,
    effect-free and within `MAX_ELEMENTS`."""
    if eqn is None or eqn.effects:
        raise _NotConstant
    avals = [v.aval for v in eqn.outvars]
    if any(np.prod(a.shape, dtype=np.int64) > MAX_ELEMENTS for a in avals):
        raise _NotConstant
    _check(eqn.primitive, eqn.params, avals)


def _check(prim, params, out_avals) -> None:
    """Raise _NotConstant unless `prim` (and every equation of a call's body) is exact."""
    name = prim.name
    if name in _CALLS:
        jaxpr = params.get("jaxpr", params.get("call_jaxpr"))
        jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
        if jaxpr is None:
            raise _NotConstant
        for eqn in jaxpr.eqns:
            _check_eqn(eqn)
        return
    if name in _EXACT:
        return
    if name in _INTEGER and all(np.issubdtype(a.dtype, np.integer) or a.dtype == np.bool_
                                for a in out_avals):
        return
    raise _NotConstant
