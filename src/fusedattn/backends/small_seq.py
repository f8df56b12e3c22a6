"""The small-seq backend: one query token attending to at most 16 keys.

Fused CUDA/HIP kernels (csrc/common/small_seq_kernels.cuh) behind two XLA FFI
targets, ``fusedattn_small_seq_fwd`` and ``fusedattn_small_seq_bwd``, exposed as
the per-device `forward` / `backward` that `native_op` differentiates and
partitions (tokens split over devices with no collective; packed keys are read
whole and their gradients summed). The forward saves fp32 log-sum-exp
``[n, h_q, 1]``; the backward recomputes the probabilities from it.

It serves `fused_attn_small_seq` (padded keys, or packed keys with offsets:
sequence kind ``ragged``) and `fused_attn` configs of the same shape (s_q == 1,
s_kv <= 16, no bias / dropout / mask / window / score_mod, vanilla softmax).
Per-sequence key counts are read by the kernels on the device: padded lengths
are clamped to ``[0, s_kv]``; a packed range that is out of bounds or longer
than 16 gives NaN outputs (and gradients) for that sequence.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from ..config import AttnConfig
from . import extension, native_op
from ..inputs import AttnInputs

HEAD_DIMS = (64, 128, 256, 512)
DTYPES = ("bfloat16", "float16")
MAX_KV = 16
# The backward keeps P and dS of every (query head of a group, key) in shared
# memory; this many query heads per kv head fit for every head dim.
MAX_GROUP = 32
TARGETS = ("fusedattn_small_seq_fwd", "fusedattn_small_seq_bwd")


def config_reason(config: AttnConfig) -> Optional[str]:
    """Why the kernels cannot run `config` (None if they can), from the config alone."""
    rules = (
        (config.s_q != 1, f"needs one query per sequence (s_q == 1), got s_q={config.s_q}"),
        (config.s_kv > MAX_KV, f"needs at most {MAX_KV} keys per sequence, got s_kv={config.s_kv}"),
        (config.dtype not in DTYPES, f"dtype {config.dtype} not in {DTYPES}"),
        (config.d_qk != config.d_v or config.d_qk not in HEAD_DIMS,
         f"head dim {config.d_qk}/{config.d_v} not in {HEAD_DIMS} (q, k, v alike)"),
        (config.group_size > MAX_GROUP,
         f"{config.group_size} query heads per kv head (at most {MAX_GROUP})"),
        (config.layout != "bshd", f"layout {config.layout} (bshd only)"),
        (config.qkv_packing != "separate", f"packed {config.qkv_packing} inputs (separate q, k, v only)"),
        (config.has_bias, "no bias"),
        (config.has_dropout, "no dropout"),
        (config.mask != "none" or config.window is not None, "no causal mask or window"),
        (config.softmax != "vanilla", f"softmax {config.softmax!r} (vanilla only)"),
        (config.score_mod is not None, "no score_mod"),
        (config.sequence not in ("dense", "padding", "ragged"),
         f"sequence kind {config.sequence!r} (dense, padding or small-seq packed keys)"),
    )
    return next((why for broken, why in rules if broken), None)


def _native_reason() -> Optional[str]:
    """None when the extension is loaded and both FFI targets are registered."""
    return extension.ensure_targets(TARGETS)


class _SmallSeqBackend(native_op.NativeBackend):
    name = "small_seq"
    platforms = ("cuda", "rocm")

    def supports(self, config: AttnConfig) -> Optional[str]:
        return config_reason(config) or _native_reason()


def kv_index(config: AttnConfig, inputs: AttnInputs) -> jax.Array:
    """The kernels' int32 key index: kv lengths ``[n]`` (padded) or kv offsets ``[n + 1]``.

    A padded query (q_length 0) gets no keys, so its output is 0.
    """
    seq = inputs.sequence
    if config.sequence == "ragged":
        return seq.kv_offsets.astype(jnp.int32)
    if config.sequence == "dense" or seq is None:
        return jnp.full((config.batch,), config.s_kv, jnp.int32)
    return jnp.where(seq.q_lengths > 0, seq.kv_lengths, 0).astype(jnp.int32)


def _max_kv(config: AttnConfig) -> np.int32:
    return np.int32(MAX_KV if config.sequence == "ragged" else config.s_kv)


# ---- the per-device kernels (native_op partitions and differentiates them) ---------------
def forward(config: AttnConfig, inputs: AttnInputs, training: bool = True):
    """(out, fp32 lse [n, h_q, 1]); the kernel always writes the LSE."""
    _native_reason()  # registers the FFI targets where the extension is loaded
    q = inputs.q
    out, lse = jax.ffi.ffi_call(
        "fusedattn_small_seq_fwd",
        (jax.ShapeDtypeStruct(q.shape, q.dtype),
         jax.ShapeDtypeStruct((q.shape[0], q.shape[2], 1), jnp.float32)),
        vmap_method="sequential",
    )(q, inputs.k, inputs.v, kv_index(config, inputs), scale=np.float32(config.scale),
      max_kv=_max_kv(config))
    return out, (lse if training else None)


def backward(config: AttnConfig, inputs: AttnInputs, out, lse, d_out) -> AttnInputs:
    """Gradients of q, k, v (the backward recomputes P from the LSE)."""
    q, k, v = inputs.q, inputs.k, inputs.v
    dq, dk, dv = jax.ffi.ffi_call(
        "fusedattn_small_seq_bwd",
        tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)),
        vmap_method="sequential",
    )(q, k, v, out, lse, d_out.astype(out.dtype), kv_index(config, inputs),
      scale=np.float32(config.scale), max_kv=_max_kv(config))
    return AttnInputs(q=dq, k=dk, v=dv)


def forward_with_lse(config: AttnConfig, inputs: AttnInputs):
    """(out, fp32 lse ``[n, h_q, 1]``) straight from the forward kernel (tests, benchmarks)."""
    return forward(config, inputs, training=True)


BACKEND = _SmallSeqBackend()


native_op.register("small_seq", native_op.Kernels(forward, backward))
