"""FP8 attention: per-tensor scaled E4M3 q, k, v, o (E4M3 or E5M2 d_out and gradients).

Two levels, one set of kernels (``fp8_forward`` / ``fp8_backward`` of a backend's
FP8 module: `backends.cudnn_fp8` on NVIDIA, `backends.xla_fp8`, the emulation
that runs anywhere and is the tests' reference):

1. ``fused_attn(q, k, v, ..., precision="fp8")``: bf16 / fp16 in and out.
   `current_scaling_attention` quantizes q, k, v (and d_out in the backward)
   with scales from their amax, computed by XLA in the same jit, runs the FP8
   kernels and dequantizes o and the gradients. Tensors whose amax cannot be
   known before the kernel runs get scales from bounds (`forward_scales`,
   `backward_scales` say which and why), so nothing overflows.
2. `attention`: float8 q, k, v plus an `Fp8Scales` pytree, for training loops
   that keep their own scaling state (delayed scaling: `DelayedScaling`).
   Returns o (FP8 or dequantized) and the forward amaxes; differentiable.

Convention: ``x_fp8 = saturate(x * scale)``, ``x = x_fp8 / scale``; every scale is
an fp32 scalar array, so new values never retrace or rebuild a graph.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional, Tuple

import jax
import jax.numpy as jnp

from . import dispatch
from .backends import fp8_op
from .fp8_scaling import (BOUND_MARGIN, E4M3, E5M2, FORMATS, FP8_MAX, BackwardAmax,  # noqa: F401
                          DelayedScaling, ForwardAmax, Fp8Scales, InputStats, amax,
                          backward_scales, config_reason, dequantize, forward_scales, quantize,
                          scale_for)
from .validation import build_call, check_now_or_when_run


def attention(q: jax.Array, k: jax.Array, v: jax.Array, scales: Fp8Scales,
              backward_amax: Optional[BackwardAmax] = None, *, out_dtype=E4M3,
              d_out_format: str = "e5m2", sequence=None, mask: str = "none",
              window=None, scale: Optional[float] = None, layout: str = "bshd",
              deterministic: bool = False, backend: str = "auto"
              ) -> Tuple[jax.Array, ForwardAmax]:
    """Attention of E4M3 q, k, v whose real values are ``x / scales.x``.

    Returns ``(out, ForwardAmax)``: out is E4M3 quantized with ``scales.o`` when
    ``out_dtype`` is float8_e4m3fn, else dequantized into ``out_dtype`` (bf16 / fp16).

    Differentiable, with the convention of JAX's own cuDNN FP8 attention: the
    cotangent of q (k, v) is the gradient of the real q quantized with
    ``scales.dq`` (E4M3, q's dtype), and the cotangent of `backward_amax` (a
    `BackwardAmax` placeholder, zeros by default) carries the backward's amaxes,
    so ``jax.grad`` hands them to the scaling state. An FP8 output's cotangent is
    E4M3 d_out quantized with ``scales.do``; a bf16 output's cotangent is
    quantized here with ``scales.do`` into ``d_out_format``.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if jnp.dtype(x.dtype) != jnp.dtype(E4M3):
            raise TypeError(f"{name} must be float8_e4m3fn (quantized with scales.{name}), "
                            f"got {jnp.dtype(x.dtype).name}")
    if not isinstance(scales, Fp8Scales):
        raise TypeError(f"scales must be a fusedattn.fp8.Fp8Scales, got {type(scales).__name__}")
    for field, value in zip(Fp8Scales._fields, scales):
        if getattr(value, "shape", None) != ():
            raise ValueError(f"scales.{field} must be a scalar (shape ()), got "
                             f"{getattr(value, 'shape', type(value).__name__)}")
        # A zero, negative or non-finite scale gives inf / NaN out of the kernels with no
        # error: checked now when concrete, when the program runs in checked mode.
        check_now_or_when_run(functools.partial(_check_scale, field), value)
    fp8_out = jnp.dtype(out_dtype) == jnp.dtype(E4M3)
    if not fp8_out and jnp.dtype(out_dtype).name not in ("bfloat16", "float16"):
        raise TypeError(f"out_dtype must be float8_e4m3fn, bfloat16 or float16, got {out_dtype}")
    if d_out_format not in FORMATS:
        raise ValueError(f"d_out_format must be one of {tuple(FORMATS)}, got {d_out_format!r}")
    high = "bfloat16" if fp8_out else jnp.dtype(out_dtype).name
    shaped = [jax.ShapeDtypeStruct(x.shape, high) for x in (q, k, v)]
    config, _ = build_call(*shaped, sequence=sequence, mask=mask, window=window, scale=scale,
                           deterministic=deterministic, layout=layout, precision="fp8")
    config = dataclasses.replace(config, fp8_out=fp8_out, fp8_grad="e4m3",
                                 fp8_do="e4m3" if fp8_out else d_out_format)
    plan = dispatch.plan(config, backend)
    if backward_amax is None:
        backward_amax = BackwardAmax.zeros()
    return fp8_op.explicit(config, plan.require(), q, k, v, sequence, scales, backward_amax)


def _check_scale(field: str, value) -> None:
    if not (math.isfinite(float(value)) and float(value) > 0.0):
        raise ValueError(f"scales.{field} must be finite and > 0 (x_fp8 = x * scale), got "
                         f"{float(value)}")
