"""A score_mod's derivative in the forms cuDNN's backward engines take.

JAX differentiates ``tanh(x)`` into ``ct * (1 - tanh(x)**2)``: a bprop that
applies tanh (or multiplies forward values into that chain) which cuDNN's
engines refuse, while they take the frontend's own soft-capping, whose
bprop is one ``TANH_BWD(dy, x)`` on the forward's value ``x``
(benchmarks/tune/flex_ops.py, the ``softcap-`` probes). So the derivative is
traced with tanh re-bound to a `jax.custom_vjp` function whose backward calls a
jitted function of a known name (`FUSED_BWD`); the lowering keeps that call
whole and emits cuDNN's derivative op for it (``tanh_bwd:dy,x``). Anything XLA
evaluates (a static value) runs the same jitted function, so the values are JAX's
own either way. The sigmoid goes through tanh (``0.5 + 0.5 * tanh(x / 2)``), in the
forward program too.

The rest of the function is re-evaluated equation by equation, nested jit calls
included; the derivative is still JAX's, only tanh's rule is replaced by an
equal one.
"""
from __future__ import annotations

from typing import Callable, Sequence, Tuple

import jax
from jax import lax
from jax.extend.core import Literal

from ....jaxprs import bind


def fusedattn_tanh_bwd(dy, x):
    t = lax.tanh(x)
    return dy * (1.0 - t * t)


_TANH_BWD = jax.jit(fusedattn_tanh_bwd)
# jit name -> the program op (csrc/cuda/flex.cc: cuDNN's TANH_BWD)
FUSED_BWD = {"fusedattn_tanh_bwd": "tanh_bwd"}


def _with_bwd(forward: Callable, bwd_fn: Callable) -> Callable:
    fn = jax.custom_vjp(forward)
    fn.defvjp(lambda x: (forward(x), x), lambda x, ct: (bwd_fn(ct, x),))
    return fn


_tanh = _with_bwd(lax.tanh, _TANH_BWD)
# The sigmoid as 0.5 + 0.5 * tanh(x / 2) (equal in fp32), so its derivative is TANH_BWD
# too: cuDNN's engines take ``s * sigmoid(s)`` with SIGMOID_BWD in its bprop and then
# compute dV wrong, dQ / dK right (docs/decisions.md; tests/gpu/test_flex_gpu.py).
# The forward program is traced from the same
# rewritten function, so the bprop reads the forward's x / 2 (`REWRITES_FORWARD`).
_REPLACED = {"tanh": _tanh, "logistic": lambda x: 0.5 + 0.5 * _tanh(0.5 * x)}
REWRITES_FORWARD = ("logistic",)


def _evaluate(jaxpr, consts: Sequence, args: Sequence):
    env = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))

    def read(atom):
        return atom.val if isinstance(atom, Literal) else env[atom]
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        sub = eqn.params.get("jaxpr")
        if eqn.primitive.name in _REPLACED:
            outs = [_REPLACED[eqn.primitive.name](*ins)]
        elif eqn.primitive.name in ("pjit", "jit") and sub is not None:
            outs = _evaluate(sub.jaxpr, sub.consts, ins)
        else:
            outs = bind(eqn.primitive, eqn.params, ins)
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def with_fused_derivatives(fn: Callable, specs: Sequence) -> Tuple[Callable, bool]:
    """`fn` (traced at `specs`) with tanh (and the sigmoid, through tanh) differentiated
    into a call of `FUSED_BWD`, the same values; and whether the forward program must be
    traced from it too (it calls a primitive of `REWRITES_FORWARD`)."""
    closed = jax.make_jaxpr(fn)(*specs)
    return (lambda *args: _evaluate(closed.jaxpr, closed.consts, args)[0],
            _calls(closed.jaxpr, REWRITES_FORWARD))


def _calls(jaxpr, names) -> bool:
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in names:
            return True
        sub = eqn.params.get("jaxpr")
        if eqn.primitive.name in ("pjit", "jit") and sub is not None and _calls(sub.jaxpr, names):
            return True
    return False
