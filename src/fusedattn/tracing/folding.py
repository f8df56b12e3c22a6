"""The value, at trace time, of a traced array computed from constants alone.

Flax's ``make_causal_mask`` and ``jnp.tril(jnp.ones(...))`` inside a user's jit build a
mask from ``iota`` and literals: its value never depends on the function's inputs,
but reaches us as a tracer. `host_value` walks the equations that made it (each jit
tracer links to the equation that produced it) back to literals and the trace's
constants and, when no input of the traced function is among them, evaluates those
equations on the host: the drop-ins then recognise the mask (`block_sparse.recognise`)
as the built-in mask it is, with nothing left to run on the device.

Only primitives whose results are exact on every backend are evaluated (`EXACT`;
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

from .walk import NotWalkable, Walk

# Shape and layout, comparison, boolean and selection primitives: exact in any dtype.
EXACT = frozenset({
    "iota", "broadcast_in_dim", "reshape", "squeeze", "transpose",
    "convert_element_type", "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not", "xor",
    "select_n", "concatenate", "slice", "dynamic_slice", "pad", "rev", "max", "min", "neg",
    "abs", "sign", "clamp", "copy", "reduce_and", "reduce_or", "reduce_max",
    "reduce_min", "floor", "ceil", "round", "stop_gradient"})
# Arithmetic, exact on integers and booleans (float results could round differently).
INTEGER = frozenset({"add", "sub", "mul", "div", "rem", "integer_pow", "shift_left",
                      "shift_right_logical", "shift_right_arithmetic", "population_count"})
# Calls whose bodies are checked equation by equation.
CALLS = frozenset({"pjit", "jit", "closed_call", "core_call"})
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
        walk = Walk(x, _exact, MAX_EQUATIONS)
        if len(walk.leaves) != len(walk.consts):   # (an input of the traced function)
            return None
        values = {v: _constant(c) for v, c in walk.consts.items()}
        try:
            cpu = jax.devices("cpu")[0]
        except RuntimeError:   # (JAX_PLATFORMS without cpu: the default device evaluates)
            cpu = None
        # (run now, not staged into the caller's trace; traced again, as a program of its own)
        with jax.ensure_compile_time_eval(), jax.default_device(cpu):
            out = jax.jit(lambda: (reduce or (lambda v: v))(walk.rebuild(values)))()
        return jax.tree.map(np.asarray, out)
    except (_NotConstant, NotWalkable):
        return None
    except Exception:  # noqa: BLE001 - internals of another JAX version: keep the tracer
        return None


def _exact(eqn) -> bool:
    """Walk through `eqn` (raising _NotConstant unless it is exact)."""
    _check_eqn(eqn)
    return True


def _constant(value):
    # (an enclosing trace's tracer lifted into this one is a constant too)
    if isinstance(value, jax.core.Tracer) or np.size(value) > MAX_CONSTANT:
        raise _NotConstant
    return np.asarray(value)


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
    if prim.name in CALLS:
        body = call_body(params)
        if body is None:
            raise _NotConstant
        for eqn in body.eqns:
            _check_eqn(eqn)
    elif not exact(prim.name, out_avals):
        raise _NotConstant


def exact(name: str, out_avals) -> bool:
    """Whether primitive `name` with these results computes the same bits on every
    backend (a call's body aside: `call_body`)."""
    return name in EXACT or (name in INTEGER and all(
        np.issubdtype(a.dtype, np.integer) or a.dtype == np.bool_ for a in out_avals))


def call_body(params):
    """The jaxpr of a call equation (`CALLS`), or None."""
    jaxpr = params.get("jaxpr", params.get("call_jaxpr"))
    return getattr(jaxpr, "jaxpr", jaxpr)
