"""`fused_attn_small_seq`: one query token attending to at most 16 keys.

Recommender inference: each query token attends to its user's short history.
Keys come padded (``k, v [n, s_kv <= 16, h_kv, d]``) or packed
(``k, v [total_kv_tokens, h_kv, d]`` with kv offsets ``[n + 1]``).

Dispatch sees the padded form (an ordinary padding config that every backend
understands); when the small-seq kernels are not chosen, packed keys are
gathered into a padded ``[n, 16, h_kv, d]`` view for the chosen backend.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from . import dispatch
from .inputs import AttnInputs
from .backends.small_seq import MAX_KV
from .config import AttnConfig
from .sequence import SequenceDescriptor
from .validation import build_call, check_rank, concrete

# Options of fused_attn that small-seq attention does not have: name -> (neutral value, rule).
_NOT_SUPPORTED = {
    "bias": (None, "small-seq attention has no bias"),
    "dropout": (0.0, "small-seq attention has no dropout (it is an inference kernel)"),
    "mask": ("none", "small-seq attention has no causal mask: a single query sees all its keys"),
    "window": (None, "small-seq attention has no sliding window"),
    "softmax": ("vanilla", "small-seq attention uses the vanilla softmax only"),
    "score_mod": (None, "small-seq attention has no score_mod"),
    "layout": ("bshd", "small-seq attention takes q [n, 1, h_q, d] (bshd) only"),
}


@dataclasses.dataclass(frozen=True)
class SmallSeqCall:
    """A validated call: the config the kernels run and the padded view dispatch sees."""
    config: AttnConfig         # sequence "dense", "padding" or "ragged"
    padded_config: AttnConfig  # the same call with padded keys
    inputs: AttnInputs

    @property
    def packed(self) -> bool:
        return self.config.sequence == "ragged"


def fused_attn_small_seq(q: jax.Array, k: jax.Array, v: jax.Array, *,
                         sequence: Any = None, scale: Optional[float] = None,
                         backend: str = "auto", **options) -> jax.Array:
    """Attention of one query token per sequence over at most 16 keys.

    Args:
      q: ``[n, 1, h_q, d]``.
      k, v: padded ``[n, s_kv, h_kv, d]`` with ``s_kv <= 16``, or packed
        ``[total_kv_tokens, h_kv, d]``. ``h_q % h_kv == 0`` (GQA / MQA).
      sequence: padded keys: None (all keys valid), kv lengths ``[n]``, or a
        `SequenceDescriptor.from_lengths(q_lengths, kv_lengths)` (q_lengths 0 or 1;
        0 gives output 0). Packed keys: kv offsets ``[n + 1]`` (sequence b owns rows
        ``offsets[b]:offsets[b+1]``, at most 16) or
        `SequenceDescriptor.from_kv_offsets(offsets)`.
      scale: logit scale, default ``1/sqrt(d)``.
      backend: ``"auto"`` (the small-seq kernels on CUDA/ROCm when they fit, else
        the next backend), ``"small_seq"``, ``"cudnn"``, ``"ck"`` or ``"xla"``.

    A sequence with no keys gives output 0. Bias, dropout, causal masks, windows
    and longer sequences are not part of small-seq attention and raise ValueError.
    Returns ``[n, 1, h_q, d]`` in q's dtype; differentiable in q, k, v.
    """
    call = build_small_seq_call(q, k, v, sequence=sequence, scale=scale, **options)
    plan = dispatch.plan(call.padded_config, backend)
    if plan.chosen == "small_seq":
        return plan.backend.attention(call.config, call.inputs)
    out = plan.run(padded_inputs(call))  # UnsupportedError with every reason if none fits
    if call.packed:  # as the kernels do: a malformed range gives NaN, never a silent clamp
        bad = malformed_ranges(call.inputs.sequence.kv_offsets, call.inputs.k.shape[0])
        out = jnp.where(bad[:, None, None, None], jnp.nan, out).astype(out.dtype)
    return out


def plan_small_seq(q, k, v, *, backend: str = "auto", **options) -> dispatch.Plan:
    """The plan `fused_attn_small_seq(q, k, v, **options)` would follow (arrays may be
    `jax.ShapeDtypeStruct`s)."""
    return dispatch.plan(build_small_seq_call(q, k, v, **options).padded_config, backend)


def build_small_seq_call(q, k, v, *, sequence: Any = None, scale: Optional[float] = None,
                         **options) -> SmallSeqCall:
    """Validate the arguments (through `validation.build_call`) plus the small-seq rules."""
    _reject_options(options)
    q_shape = check_rank(q, "q", 4, "[n, 1, h_q, d]")
    if q_shape[1] != 1:
        raise ValueError(f"q must be [n, 1, h_q, d]: small-seq attention has one query token per "
                         f"sequence, got shape {q_shape}")
    n = q_shape[0]
    k_rank = len(getattr(k, "shape", ()))
    if k_rank == 3:
        return _packed_call(q, k, v, n, sequence, scale)
    if k_rank != 4:
        raise ValueError(f"k must be padded [n, s_kv, h_kv, d] or packed [total_kv_tokens, h_kv, d], "
                         f"got shape {getattr(k, 'shape', None)}")
    s_kv = k.shape[1]
    if s_kv > MAX_KV:
        raise ValueError(f"k has {s_kv} keys per sequence: small-seq attention takes at most "
                         f"{MAX_KV} (use fused_attn for longer sequences)")
    seq = _padded_descriptor(sequence, n)
    config, inputs = build_call(q, k, v, sequence=seq, scale=scale, api="small_seq")
    return SmallSeqCall(config, config, inputs)


def _reject_options(options) -> None:
    for name, value in options.items():
        if name not in _NOT_SUPPORTED:
            raise TypeError(f"fused_attn_small_seq() got an unexpected keyword argument {name!r}")
        neutral, rule = _NOT_SUPPORTED[name]
        if not (value is neutral or (isinstance(value, (str, int, float)) and value == neutral)):
            raise ValueError(f"{name}={value!r}: {rule}")


def _padded_descriptor(sequence, n: int) -> Optional[SequenceDescriptor]:
    if sequence is None:
        return None
    if isinstance(sequence, SequenceDescriptor):
        if sequence.kind != "padding":
            raise ValueError(f"padded k, v [n, s_kv, h_kv, d] take sequence=kv lengths [n] or "
                             f"SequenceDescriptor.from_lengths(...), got kind {sequence.kind!r} "
                             f"(packed keys are k, v [total_kv_tokens, h_kv, d])")
        q_len = concrete(sequence.q_lengths)
        if q_len is not None and q_len.size and q_len.max() > 1:
            raise ValueError("sequence.q_lengths must be 0 or 1: small-seq attention has one query "
                             "token per sequence")
        return sequence
    lengths = _int_vector(sequence, "sequence (kv lengths)", n)
    return SequenceDescriptor.from_lengths(jnp.ones((n,), jnp.int32), lengths)


def _int_vector(x, name: str, size: int) -> jax.Array:
    x = jnp.asarray(x) if not isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) else x
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array, got {jnp.dtype(x.dtype).name}")
    if tuple(x.shape) != (size,):
        raise ValueError(f"{name} must have shape ({size},), got {tuple(x.shape)}")
    return x


def _packed_call(q, k, v, n: int, sequence, scale) -> SmallSeqCall:
    for name, x in (("k", k), ("v", v)):
        check_rank(x, name, 3, "packed [total_kv_tokens, h_kv, d]")
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"packed k and v must have the same tokens and heads, got {k.shape} and {v.shape}")
    if sequence is None:
        raise ValueError("packed k, v [total_kv_tokens, h_kv, d] need sequence: kv offsets [n + 1] "
                         "or SequenceDescriptor.from_kv_offsets(...)")
    if isinstance(sequence, SequenceDescriptor):
        if sequence.kind != "ragged":
            raise ValueError(f"packed k, v take SequenceDescriptor.from_kv_offsets(...), got kind "
                             f"{sequence.kind!r}")
        seq = sequence
    else:
        seq = SequenceDescriptor.from_kv_offsets(_int_vector(sequence, "sequence (kv offsets)", n + 1))
    if tuple(seq.kv_offsets.shape) != (n + 1,):
        raise ValueError(f"sequence.kv_offsets must have shape ({n + 1},) for q with n={n}, got "
                         f"{tuple(seq.kv_offsets.shape)}")
    _check_offsets(concrete(seq.kv_offsets), k.shape[0])
    # The shared validation, on a padded stand-in of the keys (dtypes, heads, GQA, scale).
    stand_in = [jax.ShapeDtypeStruct((n, MAX_KV) + tuple(x.shape[1:]), x.dtype) for x in (k, v)]
    padded, _ = build_call(q, *stand_in, scale=scale, api="small_seq")
    padded = dataclasses.replace(padded, sequence="padding")
    config = dataclasses.replace(padded, sequence="ragged")
    return SmallSeqCall(config, padded, AttnInputs(q=q, k=k, v=v, sequence=seq))


def _check_offsets(offsets: Optional[np.ndarray], total: int) -> None:
    """Rules for concrete kv offsets (traced ones are checked by the kernels: NaN rows)."""
    if offsets is None:
        return
    lengths = np.diff(offsets)
    if offsets[0] < 0 or offsets[-1] > total or np.any(lengths < 0):
        raise ValueError(f"kv offsets must be non-decreasing within [0, {total}] (the rows of k), "
                         f"got {offsets.tolist() if offsets.size <= 20 else 'values out of range'}")
    if lengths.size and lengths.max() > MAX_KV:
        raise ValueError(f"sequence {int(lengths.argmax())} has {int(lengths.max())} keys: small-seq "
                         f"attention takes at most {MAX_KV} (use fused_attn for longer sequences)")


def padded_keys(k: jax.Array, offsets: jax.Array, bound: int = MAX_KV) -> Tuple[jax.Array, jax.Array]:
    """Packed ``[total, h, d]`` -> padded ``[n, bound, h, d]`` (zeros past each length) and
    the lengths ``[n]`` clamped to ``[0, bound]``."""
    total = k.shape[0]
    lengths = offsets[1:] - offsets[:-1]
    slot = jnp.arange(bound, dtype=jnp.int32)[None, :]
    rows = offsets[:-1, None] + slot
    inside = (slot < lengths[:, None]) & (rows >= 0) & (rows < total)
    rows = jnp.where(inside, rows, total)  # `total` is out of range: filled with 0
    return jnp.take(k, rows, axis=0, mode="fill", fill_value=0), jnp.clip(lengths, 0, bound)


def malformed_ranges(offsets: jax.Array, total: int) -> jax.Array:
    """[n] bool: packed ranges the kernels reject (out of bounds or longer than 16)."""
    start, end = offsets[:-1], offsets[1:]
    return (start < 0) | (end < start) | (end > total) | (end - start > MAX_KV)


def padded_inputs(call: SmallSeqCall) -> AttnInputs:
    """The inputs in the padded form `call.padded_config` describes."""
    if not call.packed:
        return call.inputs
    offsets = call.inputs.sequence.kv_offsets
    k, lengths = padded_keys(call.inputs.k, offsets)
    v, _ = padded_keys(call.inputs.v, offsets)
    seq = SequenceDescriptor.from_lengths(jnp.ones_like(lengths), lengths)
    return AttnInputs(q=call.inputs.q, k=k, v=v, sequence=seq)
