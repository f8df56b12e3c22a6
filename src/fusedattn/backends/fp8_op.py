"""The differentiable FP8 calls over a backend's FP8 kernels, partitioned by
`native_op` like every native call: current scaling (``precision="fp8"``: scales
from the tensors, q's dtype in and out) and explicit FP8 tensors with their scales
(`fusedattn.fp8.attention`)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..fp8_scaling import (BackwardAmax, ForwardAmax, Fp8Scales, backward_scales, dequantize,
                           forward_scales, quantize)
from ..partitioning import typed_like
from . import native_op


def current_scaling_attention(config: AttnConfig, inputs, backend: str) -> jax.Array:
    """``fused_attn(..., precision="fp8")`` on `backend`'s FP8 kernels: q's dtype in and out."""
    return _current(config, backend, inputs.q, inputs.k, inputs.v, inputs.sequence)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _current(config, backend, q, k, v, sequence):
    # No gradient taken: the inference graph, and none of the backward's statistics.
    return _current_forward(config, backend, q, k, v, sequence, training=False)[0]


def _current_forward(config, backend, q, k, v, sequence, training):
    scales, stats = forward_scales(q, k, v, training)
    q8, k8, v8 = quantize(q, scales.q), quantize(k, scales.k), quantize(v, scales.v)
    o8, lse, _, _ = native_op.fp8_forward(backend, config, q8, k8, v8, sequence, scales, training)
    out = dequantize(o8, scales.o, q.dtype)
    return out, (q8, k8, v8, o8, lse, sequence, scales, stats)


def _current_fwd(config, backend, q, k, v, sequence):
    return _current_forward(config, backend, q, k, v, sequence, training=True)


def _current_bwd(config, backend, residuals, d_out):
    q8, k8, v8, o8, lse, sequence, fwd, stats = residuals
    # d_out typed as q (a cotangent made from an unsharded constant is not).
    d_out = typed_like(d_out, q8)
    scales = backward_scales(config, fwd, stats, d_out)
    do8 = quantize(d_out, scales.do, config.fp8_do)
    dq8, dk8, dv8, _ = native_op.fp8_backward(backend, config, q8, k8, v8, o8, do8, lse, sequence, scales)
    dtype = config.dtype
    # Each gradient carries its primal's sharding type (Explicit mesh axes).
    return tuple(typed_like(dequantize(g, s, dtype), x) for g, s, x in
                 ((dq8, scales.dq, q8), (dk8, scales.dk, k8), (dv8, scales.dv, v8))) + (None,)


_current.defvjp(_current_fwd, _current_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def explicit(config, backend, q8, k8, v8, sequence, scales, backward_amax):
    return _explicit_forward(config, backend, q8, k8, v8, sequence, scales, False)[0]


def _explicit_forward(config, backend, q8, k8, v8, sequence, scales, training):
    o8, lse, amax_s, amax_o = native_op.fp8_forward(backend, config, q8, k8, v8, sequence, scales, training)
    out = o8 if config.fp8_out else dequantize(o8, scales.o, config.dtype)
    return (out, ForwardAmax(amax_s, amax_o)), (q8, k8, v8, o8, lse, sequence, scales)


def _explicit_fwd(config, backend, q8, k8, v8, sequence, scales, backward_amax):
    return _explicit_forward(config, backend, q8, k8, v8, sequence, scales, True)


def _explicit_bwd(config, backend, residuals, cotangents):
    q8, k8, v8, o8, lse, sequence, scales = residuals
    d_out = typed_like(cotangents[0], q8)
    do8 = d_out if config.fp8_out else quantize(d_out, scales.do, config.fp8_do)
    dq8, dk8, dv8, bwd_amax = native_op.fp8_backward(backend, config, q8, k8, v8, o8, do8, lse, sequence, scales)
    zeros = Fp8Scales(*(jnp.zeros_like(x) for x in scales))
    dq8, dk8, dv8 = (typed_like(g, x) for g, x in ((dq8, q8), (dk8, k8), (dv8, v8)))
    return dq8, dk8, dv8, None, zeros, BackwardAmax(*bwd_amax)


explicit.defvjp(_explicit_fwd, _explicit_bwd)
