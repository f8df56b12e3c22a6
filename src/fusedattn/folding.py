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

from typing import Optional

import jax
import numpy as np
from jax.extend.core import Literal

# Shape and layout, comparison, boolean and selection primitives: exact in any dtype.
_EXACT = frozenset({
    "iota", "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose",
    "convert_element_type", "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not", "xor",
    "select_n", "concatenate", "slice", "dynamic_slice", "pad", "rev", "max", "min", "neg",
    "abs", "sign", "clamp", "copy", "copy_p", "reduce_and", "reduce_or", "reduce_max",
    "reduce_min", "floor", "ceil", "round", "stop_gradient"})
# Arithmetic, exact on integers and booleans (float results could round differently).
_INTEGER = frozenset({"add", "sub", "mul", "div", "rem", "integer_pow", "shift_left",
                      "shift_right_logical", "shift_right_arithmetic", "population_count"})
# Calls whose bodies are checked equation by equation.
_CALLS = frozenset({"pjit", "jit", "closed_call", "core_call"})
MAX_EQUATIONS = 512      # equations walked at most
MAX_ELEMENTS = 1 << 28   # elements of the value (and of any intermediate) at most


class _NotConstant(Exception):
    pass


def host_value(x) -> Optional[np.ndarray]:
    """`x` as a NumPy array when its value is known at trace time (a NumPy array, or a
    jit tracer computed from constants by exact primitives), else None."""
    if isinstance(x, np.ndarray):
        return x
    if not isinstance(x, jax.core.Tracer):
        return None
    try:
        return np.asarray(_Folder(x).value(x))
    except _NotConstant:
        return None
    except Exception:  # noqa: BLE001 - internals of another JAX version: keep the tracer
        return None


class _Folder:
    def __init__(self, x):
        trace = getattr(x, "_trace", None)
        self.consts = getattr(getattr(trace, "frame", None), "constvar_to_val", None)
        if self.consts is None or not hasattr(x, "parent"):
            raise _NotConstant
        self.trace, self.values, self.walked = trace, {}, 0
        try:
            self.device = jax.devices("cpu")[0]
        except RuntimeError:   # (JAX_PLATFORMS without cpu: the default device evaluates)
            self.device = None

    def value(self, tracer):
        if not isinstance(tracer, jax.core.Tracer) or getattr(tracer, "_trace", None) is not self.trace:
            raise _NotConstant   # a tracer of an enclosing or inner transformation
        atom = tracer.val
        if isinstance(atom, Literal):
            return atom.val
        if atom in self.values:
            return self.values[atom]
        if atom in self.consts:
            value = self.consts[atom]
            # (an enclosing trace's tracer lifted into this one is a constant too)
            if isinstance(value, jax.core.Tracer) or np.size(value) > MAX_ELEMENTS:
                raise _NotConstant
            value = np.asarray(value)
        else:
            value = self._evaluate(tracer.parent, atom)
        self.values[atom] = value
        return value

    def _evaluate(self, eqn, atom):
        """The value of `atom`, an output of `eqn` (None: an input of the traced function)."""
        if eqn is None or eqn.effects:
            raise _NotConstant
        self.walked += 1
        if self.walked > MAX_EQUATIONS:
            raise _NotConstant
        avals = [v.aval for v in eqn.outvars]
        _check(eqn.primitive, eqn.params, avals)
        if any(np.prod(a.shape, dtype=np.int64) > MAX_ELEMENTS for a in avals):
            raise _NotConstant
        ins = [self.value(t) for t in eqn.in_tracers]
        with jax.ensure_compile_time_eval(), jax.default_device(self.device):
            outs = eqn.primitive.bind(*ins, **eqn.params)
        outs = outs if eqn.primitive.multiple_results else [outs]
        found = None
        for v, out in zip(eqn.outvars, outs):
            self.values[v] = np.asarray(out)
            if v is atom:
                found = self.values[v]
        if found is None:
            raise _NotConstant
        return found


def _check(prim, params, out_avals) -> None:
    """Raise _NotConstant unless `prim` (and every equation of a call's body) is exact."""
    name = prim.name
    if name in _CALLS:
        jaxpr = params.get("jaxpr")
        jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
        if jaxpr is None:
            raise _NotConstant
        for eqn in jaxpr.eqns:
            if eqn.effects:
                raise _NotConstant
            _check(eqn.primitive, eqn.params, [v.aval for v in eqn.outvars])
        return
    if name in _EXACT:
        return
    if name in _INTEGER and all(np.issubdtype(a.dtype, np.integer) or a.dtype == np.bool_
                                for a in out_avals):
        return
    raise _NotConstant
