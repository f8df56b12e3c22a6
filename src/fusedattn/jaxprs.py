"""Jaxprs as flat lists of equations, and their evaluation one primitive at a time:
shared by the block-sparse kernels and the cuDNN score_mod lowering.

`block_sparse.hoisting` splits a mask_mod's or score_mod's flat equations; `plain`
evaluates a function inside a block-sparse kernel, one primitive at a time, so that
some can be rewritten (`block_sparse.mosaic_ops.FORMS`: JAX's derivatives sum
cotangents with ``add_any``, which the Mosaic GPU lowering has no rule for); the
cuDNN score_mod lowering (backends/cudnn/lowering) lowers `flatten`'s equations.
Calls (pjit, custom_jvp) that wrap library functions are inlined.
"""
from __future__ import annotations

from typing import Callable, Dict, List, NamedTuple, Tuple

import jax
import numpy as np
from jax.extend.core import Literal

_INLINE = frozenset({"pjit", "jit", "closed_call", "core_call", "custom_jvp_call",
                     "custom_vjp_call", "custom_vjp_call_jaxpr", "remat", "remat2", "checkpoint"})
# Primitives that change only a value's shape, never its elements.
SHAPE_ONLY = frozenset({"broadcast_in_dim", "reshape", "squeeze", "expand_dims", "copy",
                        "copy_p"})


class Eqn(NamedTuple):
    prim: object
    params: dict
    ins: tuple
    outs: tuple


class Var:
    """A fresh variable: an inlined call's values get one per call site."""
    def __init__(self, aval):
        self.aval = aval


def flatten(closed, keep: Callable[[object], bool] = lambda eqn: False
            ) -> Tuple[List[Eqn], Dict, Dict]:
    """(equations with calls inlined and every output renamed, {constant variable:
    value}, {the jaxpr's own variables: their names}) of a ClosedJaxpr. Constants
    that are NumPy values stay NumPy (usable at trace time). A call for which
    `keep(eqn)` holds stays one equation (a caller that lowers it whole)."""
    jaxpr = closed.jaxpr
    env = {v: v for v in jaxpr.invars}
    eqns: List[Eqn] = []
    consts: Dict = {}
    _constants(jaxpr, closed.consts, env, consts)
    _flatten(jaxpr, env, consts, eqns, keep)
    return eqns, consts, env


def name_of(env, v):
    return v if isinstance(v, Literal) else env[v]


def value_of(env, v):
    return np.asarray(v.val, v.aval.dtype) if isinstance(v, Literal) else env[v]


def plain(fn, *args, rewrite=lambda prim, ins, params: None):
    """``fn(*args)`` evaluated from its jaxpr, calls inlined; ``rewrite(primitive, ins,
    params)`` gives an equation's outputs in other primitives, or None to bind it as it
    is. `args` may be tracers of an enclosing trace."""
    closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    eqns, consts, env = flatten(closed)
    values = dict(consts)
    values.update((env[v], x) for v, x in zip(closed.jaxpr.invars,
                                              jax.tree_util.tree_leaves(args)))
    for e in eqns:
        ins = [value_of(values, v) for v in e.ins]
        outs = rewrite(e.prim, ins, e.params)
        outs = bind(e.prim, e.params, ins) if outs is None else \
            (outs if e.prim.multiple_results else [outs])
        values.update(zip(e.outs, outs))
    outs = [value_of(values, name_of(env, v)) for v in closed.jaxpr.outvars]
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(shape), outs)


def bind(prim, params, ins) -> list:
    """The outputs of primitive `prim` with an equation's `params` applied to `ins`."""
    bound = prim.get_bind_params(params)
    sub, bound = bound if isinstance(bound, tuple) else ((), bound)  # older JAX: subfuns
    outs = prim.bind(*sub, *ins, **bound)
    return outs if prim.multiple_results else [outs]


def _flatten(jaxpr, env, consts, eqns, keep):
    for eqn in jaxpr.eqns:
        ins = tuple(name_of(env, v) for v in eqn.invars)
        sub = next((eqn.params[k] for k in ("jaxpr", "call_jaxpr", "fun_jaxpr")
                    if k in eqn.params), None)
        if eqn.primitive.name in _INLINE and sub is not None and not keep(eqn):
            inner = getattr(sub, "jaxpr", sub)
            inner_env = dict(zip(inner.invars, ins))
            _constants(inner, getattr(sub, "consts", ()), inner_env, consts)
            _flatten(inner, inner_env, consts, eqns, keep)
            env.update((o, name_of(inner_env, i)) for o, i in zip(eqn.outvars, inner.outvars))
        else:
            outs = tuple(Var(v.aval) for v in eqn.outvars)
            env.update(zip(eqn.outvars, outs))
            eqns.append(Eqn(eqn.primitive, eqn.params, ins, outs))


def _constants(jaxpr, values, env, consts):
    for v, c in zip(jaxpr.constvars, values):
        env[v] = Var(v.aval)
        consts[env[v]] = np.asarray(c) if isinstance(c, (np.ndarray, np.generic)) else c
