"""FP8 attention emulated in XLA: the semantics of the cuDNN FP8 kernels in fp32 math.

The inputs are the FP8 tensors the kernels would get; they are dequantized with
the same scales, attention runs in fp32 on the XLA backend, and the outputs
(o in the forward, dq / dk / dv in the backward) are quantized with the same
scales into the same formats. What the kernels quantize internally (the
probabilities S with ``scales.s``, dP with ``scales.dp``) stays fp32 here, so
the emulation is the FP8 computation minus those two roundings: the reference
the GPU tests hold cuDNN to, and what CPU runs.

The amaxes of S and dP need the s_q x s_kv matrices, which the tiled XLA kernels
never hold: they are computed densely here, so this emulation is for testing
and small shapes, not for long sequences.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from ... import fp8_scaling as fp8
from ...config import AttnConfig
from . import attention as xla
from ...inputs import AttnInputs, to_bshd
from .masks import tile_mask, token_info


def _fp32(config: AttnConfig) -> AttnConfig:
    return dataclasses.replace(config, dtype="float32", precision="default")


def _probabilities(config: AttnConfig, q, k, sequence, lse):
    """Dense softmax probabilities [b, h_q, s_q, s_kv] (0 where masked), from the lse."""
    q, k = to_bshd(config, q), to_bshd(config, k)
    k = jnp.repeat(k, config.group_size, axis=2)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) * config.scale
    p = jnp.exp(logits - lse[..., None])
    info = token_info(config, sequence)
    visible = tile_mask(config, info, info)
    return p if visible is None else jnp.where(visible[:, None], p, 0.0)


def fp8_forward(config: AttnConfig, q8, k8, v8, sequence, scales: fp8.Fp8Scales,
                training: bool):
    """(o8 E4M3, fp32 lse [b, h_q, s_q] or None, amax of S, amax of o)."""
    f32 = _fp32(config)
    q, k, v = (fp8.dequantize(x, s, jnp.float32)
               for x, s in ((q8, scales.q), (k8, scales.k), (v8, scales.v)))
    out, lse = xla.forward(f32, AttnInputs(q, k, v, sequence=sequence), True)
    amax_s = jnp.max(_probabilities(f32, q, k, sequence, lse))
    return fp8.quantize(out, scales.o), (lse if training else None), amax_s, fp8.amax(out)


def fp8_backward(config: AttnConfig, q8, k8, v8, o8, do8, lse, sequence,
                 scales: fp8.Fp8Scales):
    """(dq8, dk8, dv8 in config.fp8_grad, (amax dq, dk, dv, dP)). dP is what cuDNN
    quantizes: the gradient of q . k, scale * P * (d_out . v - d_out . o)."""
    f32 = _fp32(config)
    q, k, v, o = (fp8.dequantize(x, s, jnp.float32) for x, s in
                  ((q8, scales.q), (k8, scales.k), (v8, scales.v), (o8, scales.o)))
    d_out = fp8.dequantize(do8, scales.do, jnp.float32)
    grads = xla.backward(f32, AttnInputs(q, k, v, sequence=sequence), o, lse, d_out)
    p = _probabilities(f32, q, k, sequence, lse)
    v_q = jnp.repeat(to_bshd(f32, v), f32.group_size, axis=2)
    dp = jnp.einsum("bqhd,bkhd->bhqk", to_bshd(f32, d_out), v_q)
    delta = jnp.einsum("bqhd,bqhd->bhq", to_bshd(f32, d_out), to_bshd(f32, o))
    amax_dp = config.scale * jnp.max(jnp.abs(p * (dp - delta[..., None])))
    fmt = config.fp8_grad
    return (fp8.quantize(grads.q, scales.dq, fmt), fp8.quantize(grads.k, scales.dk, fmt),
            fp8.quantize(grads.v, scales.dv, fmt),
            (fp8.amax(grads.q), fp8.amax(grads.k), fp8.amax(grads.v), amax_dp))
