"""FP8 scaling: formats, per-tensor scales and amaxes, quantization, the scales of
current scaling (from the tensors or from bounds) and delayed scaling's state. Pure
JAX, no kernels: the backends' FP8 kernels and `fusedattn.fp8` build on it.

Convention: ``x_fp8 = saturate(x * scale)``, ``x = x_fp8 / scale``; every scale is
an fp32 scalar array, so new values never retrace or rebuild a graph.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp

from .config import AttnConfig


E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2
FORMATS = {"e4m3": E4M3, "e5m2": E5M2}
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
# Bounds are rigorous for the real tensors; this margin covers the rounding of the
# FP8 inputs they are computed from (at most 2^-4 relative per E4M3 value) and more.
BOUND_MARGIN = 2.0


class Fp8Scales(NamedTuple):
    """Per-tensor scales (x_fp8 = x * scale), fp32 scalars. ``s`` scales the softmax
    probabilities, ``dp`` the gradient of the logits; the kernels use both inside."""
    q: jax.Array
    k: jax.Array
    v: jax.Array
    s: jax.Array
    o: jax.Array
    do: jax.Array
    dp: jax.Array
    dq: jax.Array
    dk: jax.Array
    dv: jax.Array

    @classmethod
    def ones(cls) -> "Fp8Scales":
        return cls(*(jnp.ones((), jnp.float32) for _ in cls._fields))


class ForwardAmax(NamedTuple):
    """max |x| of the forward's internal / output tensors (fp32 scalars)."""
    s: jax.Array
    o: jax.Array


class BackwardAmax(NamedTuple):
    """max |x| of the backward's gradients and of dP (fp32 scalars)."""
    dq: jax.Array
    dk: jax.Array
    dv: jax.Array
    dp: jax.Array

    @classmethod
    def zeros(cls) -> "BackwardAmax":
        return cls(*(jnp.zeros((), jnp.float32) for _ in cls._fields))


def quantize(x: jax.Array, scale: jax.Array, fmt: str = "e4m3") -> jax.Array:
    """x * scale, saturated to the format's finite range (E4M3 has no infinity) and cast."""
    top = FP8_MAX[fmt]
    return jnp.clip(x.astype(jnp.float32) * scale, -top, top).astype(FORMATS[fmt])


def dequantize(x8: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    return (x8.astype(jnp.float32) / scale).astype(dtype)


def scale_for(amax: jax.Array, fmt: str = "e4m3") -> jax.Array:
    """The scale that maps amax to the format's largest value (1 for an all-zero tensor)."""
    amax = amax.astype(jnp.float32)
    return jnp.where(amax > 0, FP8_MAX[fmt] / jnp.where(amax > 0, amax, 1.0), 1.0)


def amax(x: jax.Array) -> jax.Array:
    return jnp.max(jnp.abs(x)).astype(jnp.float32)


def _max_row_norm(x: jax.Array) -> jax.Array:
    """max over tokens and heads of the L2 norm over the head dim."""
    x = x.astype(jnp.float32)
    return jnp.sqrt(jnp.max(jnp.sum(x * x, axis=-1)))


# ---- what the FP8 kernels serve ---------------------------------------------------------
def config_reason(config: AttnConfig) -> Optional[str]:
    """What the FP8 path cannot run, for every backend with FP8 kernels (None: it can)."""
    if config.has_bias:
        return "FP8 attention takes no bias (cuDNN's FP8 SDPA has none)"
    if config.has_dropout:
        return "FP8 attention here has no dropout"
    if config.softmax != "vanilla":
        return f"FP8 attention here has no {config.softmax} softmax (sink)"
    if config.score_mod is not None:
        return "FP8 attention here takes no score_mod"
    if config.qkv_packing != "separate":
        return "FP8 attention takes separate q, k, v (layout bshd or sbhd)"
    if config.sequence not in ("dense", "padding"):
        return (f"FP8 attention here serves dense and padded sequences, not {config.sequence} "
                f"(cuDNN's FP8 backward has no THD on Hopper)")
    return None


# ---- level 1: current scaling (precision="fp8") -----------------------------------------
def forward_scales(q, k, v, training: bool = True) -> Tuple[Fp8Scales, Optional[InputStats]]:
    """Scales for the forward from the tensors themselves.

    q, k, v: their amax. s: the kernels quantize probabilities in [0, 1], so 448.
    o: every output row is a convex combination of v's rows, so |o| <= amax(v),
    times the rounding margin. The backward entries are filled by `backward_scales`
    from the `InputStats` returned with them (None unless `training`).
    """
    one = jnp.ones((), jnp.float32)
    amax_q, amax_k, amax_v = amax(q), amax(k), amax(v)
    scales = Fp8Scales(q=scale_for(amax_q), k=scale_for(amax_k), v=scale_for(amax_v),
                       s=jnp.float32(FP8_MAX["e4m3"]), o=scale_for(amax_v * BOUND_MARGIN),
                       do=one, dp=one, dq=one, dk=one, dv=one)
    return scales, (InputStats(amax_q, amax_k, _max_row_norm(v)) if training else None)


class InputStats(NamedTuple):
    """What the backward's bounds need of the forward's inputs (kept instead of them)."""
    amax_q: jax.Array
    amax_k: jax.Array
    max_norm_v: jax.Array  # max over rows of |v_j| (L2 over the head dim)


def backward_scales(config: AttnConfig, fwd: Fp8Scales, stats: InputStats, d_out) -> Fp8Scales:
    """Scales for the backward: d_out from its amax; dP and the gradients from bounds.

    With dS the gradient of the scaled logits, P <= 1 in every row and
    sum_j P_ij = 1 (so |o_i| <= max_j |v_j|):
      |dS_ij| = P_ij |d_out_i . v_j - d_out_i . o_i| <= 2 max|d_out_i| max|v_j| (L2 norms)
      dP (what the kernels quantize) = scale * dS, the gradient of q . k
      |dq_i|  <= scale * amax(k) * that bound           (sum_j P_ij = 1)
      |dk_j|  <= scale * amax(q) * that bound * s_q * g (g query heads per kv head)
      |dv_j|  <= amax(d_out) * s_q * g
    Each bound holds for any data; the formats' range absorbs how loose the last
    two can be (E5M2 spans 2^30 of normal values), which is why current scaling
    defaults to E5M2 for d_out (whose type dP shares) and the gradients.
    """
    fd, fg = config.fp8_do, config.fp8_grad
    amax_do = amax(d_out)
    ds_bound = 2.0 * _max_row_norm(d_out) * stats.max_norm_v * BOUND_MARGIN
    fan_in = float(config.s_q * config.group_size)
    return fwd._replace(
        do=scale_for(amax_do, fd),
        dp=scale_for(config.scale * ds_bound, fd),
        dq=scale_for(config.scale * stats.amax_k * ds_bound, fg),
        dk=scale_for(config.scale * stats.amax_q * ds_bound * fan_in, fg),
        dv=scale_for(amax_do * fan_in * BOUND_MARGIN, fg))


# ---- delayed scaling -------------------------------------------------------------------
class DelayedScaling(NamedTuple):
    """Amax history per tensor, TransformerEngine's delayed-scaling recipe as data.

    ``history`` maps each `Fp8Scales` field to a ``[history_len]`` fp32 array,
    newest first. Pure functions of it (`scales`, `update`) compose with jit and
    optax-style state.
    """
    history: Fp8Scales

    @classmethod
    def init(cls, history_len: int = 16) -> "DelayedScaling":
        if not isinstance(history_len, int) or history_len < 1:
            raise ValueError(f"history_len must be a positive int, got {history_len!r}")
        return cls(Fp8Scales(*(jnp.zeros((history_len,), jnp.float32)
                               for _ in Fp8Scales._fields)))

    def scales(self, margin: int = 0, d_out_format: str = "e5m2") -> Fp8Scales:
        """Scale per tensor: format max / (max of the history) / 2^margin. The
        probabilities (s) keep 448; d_out, dp and the gradients use `d_out_format`'s
        range except dq, dk, dv, which are E4M3 (q's dtype) in `attention`."""
        fmt = {"do": d_out_format, "dp": d_out_format}
        out = {}
        for field, hist in zip(Fp8Scales._fields, self.history):
            out[field] = scale_for(jnp.max(hist), fmt.get(field, "e4m3")) / (2.0 ** margin)
        out["s"] = jnp.float32(FP8_MAX["e4m3"])
        return Fp8Scales(**out)

    def update(self, forward: ForwardAmax, backward: BackwardAmax,
               q_amax, k_amax, v_amax, do_amax) -> "DelayedScaling":
        """Push this step's amaxes (newest first)."""
        new = dict(q=q_amax, k=k_amax, v=v_amax, s=forward.s, o=forward.o, do=do_amax,
                   dp=backward.dp, dq=backward.dq, dk=backward.dk, dv=backward.dv)
        return DelayedScaling(Fp8Scales(*(
            jnp.concatenate([jnp.reshape(new[f], (1,)).astype(jnp.float32), h[:-1]])
            for f, h in zip(Fp8Scales._fields, self.history))))
