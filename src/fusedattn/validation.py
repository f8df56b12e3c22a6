"""The one validation path: user arguments -> (AttnConfig, AttnInputs).

Every rule raises `ValueError` (bad value or shape) or `TypeError` (bad type or
dtype) naming the argument, before any kernel is traced. Checks that need
values (lengths in range, sorted segment ids, back-to-back offsets) run when those
arrays are concrete; under `jit` they are traced and the backends treat
out-of-range values as documented (clamped by masking), never reading out of
bounds. With ``FUSEDATTN_CHECK_TRACED=1`` (checked mode) the same checks also run
on traced values, as the compiled program runs (a host callback: slower, for
debugging), and raise there.
"""
from __future__ import annotations

import math
import os
from typing import Any, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from .inputs import AttnInputs
from .config import DTYPES, MASKS, PRECISIONS, SOFTMAX_TYPES, AttnConfig
from .score_mods import Alibi, Masked
from .sequence import SequenceDescriptor

# layout argument -> (tensor layout, qkv packing)
LAYOUT_ARGS = {
    "bshd": ("bshd", "separate"),
    "sbhd": ("sbhd", "separate"),
    "bs3hd": ("bshd", "qkv"),
    "sb3hd": ("sbhd", "qkv"),
    "bshd_bs2hd": ("bshd", "kv"),
    "sbhd_sb2hd": ("sbhd", "kv"),
}


def _shape(x, name: str) -> Tuple[int, ...]:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array (jax.Array, numpy array or ShapeDtypeStruct), "
                        f"got {type(x).__name__}")
    return tuple(x.shape)


def check_rank(x, name: str, rank: int, what: str) -> Tuple[int, ...]:
    shape = _shape(x, name)
    if len(shape) != rank:
        raise ValueError(f"{name} must have rank {rank} ({what}), got shape {shape}")
    return shape


def check_attention_dtypes(**arrays) -> str:
    """All given arrays share one dtype among DTYPES; returns its name."""
    names = list(arrays)
    dtypes = {n: jnp.dtype(a.dtype).name for n, a in arrays.items()}
    first = dtypes[names[0]]
    for n in names[1:]:
        if dtypes[n] != first:
            raise TypeError(f"{names[0]}, {n} must have the same dtype, got {first} and {dtypes[n]}")
    if first not in DTYPES:
        raise TypeError(f"{names[0]} dtype must be one of {DTYPES}, got {first}")
    return first


def concrete(x) -> Optional[np.ndarray]:
    """The value of `x` as NumPy if it is known now (not a tracer / abstract), else None."""
    if x is None or isinstance(x, (jax.core.Tracer, jax.ShapeDtypeStruct)):
        return None
    try:
        return np.asarray(x)
    except Exception:
        return None


def _check_int_array(x, name: str, shape: Tuple[int, ...]) -> None:
    got = _shape(x, name)
    if got != shape:
        raise ValueError(f"{name} must have shape {shape}, got {got}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array, got {jnp.dtype(x.dtype).name}")


def checked_mode() -> bool:
    """FUSEDATTN_CHECK_TRACED=1: value checks also run on traced arrays, when the program runs."""
    return os.environ.get("FUSEDATTN_CHECK_TRACED", "0") == "1"


def check_now_or_when_run(check, *arrays) -> None:
    """Run `check` (NumPy arrays in, raises ValueError) now if every array is concrete;
    else, in checked mode, when the compiled program runs."""
    values = [concrete(a) for a in arrays]
    if all(v is not None for v in values):
        check(*values)
    elif checked_mode() and not any(isinstance(a, jax.ShapeDtypeStruct) for a in arrays):
        jax.debug.callback(lambda *a: check(*map(np.asarray, a)), *arrays)


def _check_range(x, name: str, hi: int) -> None:
    def check(value):
        if value.size and (value.min() < 0 or value.max() > hi):
            raise ValueError(f"{name} must lie in [0, {hi}], got values in [{value.min()}, "
                             f"{value.max()}]")
    check_now_or_when_run(check, x)


def check_sequence(seq: Any, batch: int, s_q: int, s_kv: int) -> str:
    """Validates a SequenceDescriptor against the shapes; returns the sequence kind."""
    if seq is None:
        return "dense"
    if not isinstance(seq, SequenceDescriptor):
        raise TypeError(f"sequence must be a fusedattn.SequenceDescriptor or None, got {type(seq).__name__}")
    if seq.kind == "padding":
        _check_int_array(seq.q_lengths, "sequence.q_lengths", (batch,))
        _check_int_array(seq.kv_lengths, "sequence.kv_lengths", (batch,))
        _check_range(seq.q_lengths, "sequence.q_lengths", s_q)
        _check_range(seq.kv_lengths, "sequence.kv_lengths", s_kv)
        return "padding"
    if seq.kind == "packed":
        S = seq.max_segments
        for side, s in (("q", s_q), ("kv", s_kv)):
            ids = getattr(seq, f"{side}_segment_ids")
            _check_int_array(ids, f"sequence.{side}_segment_ids", (batch, s))
            _check_int_array(getattr(seq, f"{side}_lengths"), f"sequence.{side}_seqlens", (batch, S))
            _check_int_array(getattr(seq, f"{side}_offsets"), f"sequence.{side}_offsets", (batch, S))
            _check_packing_values(seq, side, s)
        return "packed"
    raise ValueError(f"sequence.kind must be 'padding' or 'packed', got {seq.kind!r}")


def _check_packing_values(seq: SequenceDescriptor, side: str, s: int) -> None:
    def check_offsets(lengths, offsets):
        if lengths.min() < 0 or offsets.min() < 0:
            raise ValueError(f"sequence.{side}_seqlens and {side}_offsets must be non-negative")
        if (offsets + lengths).max() > s:
            raise ValueError(f"sequence.{side}_offsets + {side}_seqlens must not exceed the "
                             f"sequence length {s}")
        # Segments must be back to back in order (ragged offsets address them that way).
        used = lengths > 0
        expected = np.cumsum(lengths, axis=1) - lengths
        if np.any(used & (offsets != expected)):
            raise ValueError(f"sequence.{side}_offsets must place segments back to back from "
                             f"the start of each row (offset[n] = sum of earlier seqlens)")

    def check_ids(ids):
        if ids.min() < 0 or ids.max() > seq.max_segments:
            raise ValueError(f"sequence.{side}_segment_ids must lie in [0, max_segments="
                             f"{seq.max_segments}] (0 = padding), got [{ids.min()}, {ids.max()}]")
        nonzero_then_zero = np.all(np.diff((ids == 0).astype(np.int8), axis=1) >= 0)
        real = np.where(ids == 0, np.iinfo(np.int32).max, ids)
        if not nonzero_then_zero or np.any(np.diff(real, axis=1) < 0):
            raise ValueError(f"sequence.{side}_segment_ids must be sorted (non-decreasing) with "
                             f"padding (0) only at the end of each row")

    check_now_or_when_run(check_offsets, getattr(seq, f"{side}_lengths"),
                          getattr(seq, f"{side}_offsets"))
    check_now_or_when_run(check_ids, getattr(seq, f"{side}_segment_ids"))
    ids = concrete(getattr(seq, f"{side}_segment_ids"))
    given = seq._given_positions[0 if side == "q" else 1]
    given_value = concrete(given)
    if given_value is not None:
        derived = concrete(getattr(seq, f"{side}_positions"))
        if given_value.shape != derived.shape or np.any((ids > 0) & (given_value != derived)):
            raise ValueError(f"{side}_positions must count 0, 1, 2, ... inside each segment")


def check_rng(rng) -> None:
    """A PRNG key: typed (jax.random.key) or raw uint32[2] (jax.random.PRNGKey)."""
    dtype = getattr(rng, "dtype", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        if tuple(rng.shape) != ():
            raise ValueError(f"rng must be a single PRNG key (shape ()), got shape {rng.shape}")
        return
    if dtype is None or jnp.dtype(dtype) != jnp.uint32 or tuple(rng.shape) != (2,):
        got = (f"{jnp.dtype(dtype).name} array of shape {tuple(rng.shape)}" if dtype is not None
               else f"{type(rng).__name__} {rng!r}")
        raise TypeError(f"rng must be a JAX PRNG key (jax.random.key(seed) or "
                        f"jax.random.PRNGKey(seed)), got {got}")


def _check_window(window, mask: str) -> Optional[Tuple[int, int]]:
    if window is None:
        return None
    if (not isinstance(window, (tuple, list)) or len(window) != 2
            or not all(isinstance(w, (int, np.integer)) and not isinstance(w, bool) for w in window)):
        raise TypeError(f"window must be a (left, right) pair of ints, got {window!r}")
    left, right = int(window[0]), int(window[1])
    if left < -1 or right < -1:
        raise ValueError(f"window sides must be >= 0, or -1 for unbounded, got {window!r}")
    if mask != "none":
        if right not in (0, -1):
            raise ValueError(f"window right side must be 0 (or -1) with mask={mask!r}: a causal "
                             f"mask allows no keys to the right, got window={window!r}")
        right = 0
    if left == -1 and right == -1:
        return None
    return left, right


def _check_broadcast(x, name: str, batch: int, h_q: int, s_q: int, s_kv: int):
    """The shape of `x` when it broadcasts to [b, h_q, s_q, s_kv] over batch and heads."""
    shape = _shape(x, name)
    if len(shape) != 4:
        raise ValueError(f"{name} must have rank 4 [1|b, 1|h, s_q, s_kv], got shape {shape}")
    want = (batch, h_q, s_q, s_kv)
    for i, (got, full) in enumerate(zip(shape, want)):
        if got != full and not (i < 2 and got == 1):
            raise ValueError(f"{name} shape {shape} does not broadcast to [1|b, 1|h, s_q, s_kv] = "
                             f"{list(want)}: dimension {i} must be {full}" + (" or 1" if i < 2 else ""))
    return shape


def _check_bias(bias, batch: int, h_q: int, s_q: int, s_kv: int):
    if bias is None:
        return None
    shape = _check_broadcast(bias, "bias", batch, h_q, s_q, s_kv)
    if not jnp.issubdtype(bias.dtype, jnp.floating):
        raise TypeError(f"bias must be a floating-point array, got {jnp.dtype(bias.dtype).name}")
    return shape


def _check_dense_mask(mask, batch: int, h_q: int, s_q: int, s_kv: int):
    """A boolean [1|b, 1|h_q, s_q, s_kv] mask (True: visible) -> its shape."""
    if mask is None:
        return None
    shape = _check_broadcast(mask, "dense_mask", batch, h_q, s_q, s_kv)
    if jnp.dtype(mask.dtype) != jnp.bool_:
        raise TypeError(f"dense_mask must be boolean (True: visible), got "
                        f"{jnp.dtype(mask.dtype).name}")
    return shape


def _check_score_mod(score_mod, args, batch: int, h_q: int) -> None:
    """Trace score_mod on abstract tiles shaped as the backends call it (nothing runs), so a
    function that fails or returns the wrong shape or dtype is named here, not deep in a
    backend (a bool or int result would otherwise be cast to scores of 0 / 1)."""
    inner = score_mod.score_mod if isinstance(score_mod, Masked) else score_mod
    if isinstance(inner, Alibi) and inner.num_heads != h_q:
        raise ValueError(f"score_mods.alibi({inner.num_heads}) on a call with {h_q} query heads: "
                         f"its slopes are per query head, so num_heads must equal h_q "
                         f"(score_mods.alibi({h_q}))")
    if inner is None:
        return
    i32 = jnp.int32
    score = jax.ShapeDtypeStruct((batch, h_q, 2, 3), jnp.float32)
    indices = [jax.ShapeDtypeStruct(shape, i32) for shape in
               ((batch, 1, 1, 1), (1, h_q, 1, 1), (batch, 1, 2, 1), (batch, 1, 1, 3))]
    where = (f"score_mod(score, batch, head, q_idx, kv_idx, *score_mod_args) on a score of "
             f"shape {score.shape} (batch {indices[0].shape}, head {indices[1].shape}, q_idx "
             f"{indices[2].shape}, kv_idx {indices[3].shape})")
    try:
        out = jax.eval_shape(inner, score, *indices, *args)
    except Exception as e:
        raise ValueError(f"{where} failed: {type(e).__name__}: {e}") from e
    shape = getattr(out, "shape", None)
    try:
        ok = shape is not None and np.broadcast_shapes(shape, score.shape) == score.shape
    except ValueError:
        ok = False
    if not ok:
        got = f"shape {shape}" if shape is not None else repr(out)
        raise ValueError(f"{where} returned {got}: score_mod must be elementwise, returning an "
                         f"array shaped like score")
    dtype = jnp.dtype(out.dtype)
    if dtype == jnp.bool_:
        raise TypeError(f"{where} returned booleans: a score_mod returns the new scores (a "
                        f"floating dtype). To keep or drop pairs, pass the function as "
                        f"mask_mod=lambda batch, head, q_idx, kv_idx: ... (True: kept)")
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"{where} returned {dtype.name}: score_mod must return a floating dtype "
                        f"(the scores); cast with .astype(score.dtype)"
                        + (" (a complex result has no order to softmax over)"
                           if jnp.issubdtype(dtype, jnp.complexfloating) else ""))


def _check_mask_mod(mask_mod, args, batch: int, h_q: int) -> None:
    """Traced on abstract indices shaped as the backends call it: a failure, a result
    that is not boolean or not shaped like the score is named here."""
    i32 = jnp.int32
    indices = [jax.ShapeDtypeStruct(shape, i32) for shape in
               ((batch, 1, 1, 1), (1, h_q, 1, 1), (batch, 1, 2, 1), (batch, 1, 1, 3))]
    try:
        out = jax.eval_shape(mask_mod, *indices, *args)
    except Exception as e:
        raise ValueError(f"mask_mod(batch, head, q_idx, kv_idx, *score_mod_args) failed: "
                         f"{type(e).__name__}: {e}") from e
    if getattr(out, "dtype", None) != jnp.bool_:
        got = getattr(out, "dtype", type(out).__name__)
        hint = (" (a float result reads as a score_mod: pass it as score_mod)"
                if getattr(out, "dtype", None) is not None
                and jnp.issubdtype(out.dtype, jnp.floating) else "")
        raise TypeError(f"mask_mod must return booleans (True: the pair is kept), got {got}"
                        f"{hint}")
    full = (batch, h_q, 2, 3)
    try:
        ok = np.broadcast_shapes(out.shape, full) == full
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"mask_mod(batch, head, q_idx, kv_idx) on indices of shapes "
                         f"{[i.shape for i in indices]} returned shape {out.shape}: it must be "
                         f"elementwise, broadcasting to [b, h, s_q, s_kv] = {list(full)}")


def _check_precision(precision, dtype: str) -> str:
    if precision is None:
        return "default"
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be None or one of {PRECISIONS}, got {precision!r}")
    if precision == "fp8" and dtype not in ("bfloat16", "float16"):
        raise TypeError(f"precision='fp8' takes bfloat16 or float16 q, k, v (fusedattn quantizes "
                        f"them), got {dtype}; for tensors already in FP8 use fusedattn.fp8.attention")
    return precision


def build_call(q, k, v, *, bias=None, sequence=None, mask="none", window=None, scale=None,
               softmax="vanilla", softmax_offset=None, dropout=0.0, rng=None, score_mod=None,
               score_mod_args=(), mask_mod=None, deterministic=False, layout="bshd",
               precision=None, api="fused_attn",
               dense_mask=None) -> Tuple[AttnConfig, AttnInputs]:
    """Validate `fused_attn` arguments and build the config and the inputs.

    `dense_mask` (the drop-ins' boolean mask, broadcast to ``[1|b, 1|h_q, s_q, s_kv]``)
    travels as a mask: dispatch gives it to backends that take one and folds it into
    the bias for the others (`inputs.mask_as_bias`)."""
    if layout not in LAYOUT_ARGS:
        raise ValueError(f"layout must be one of {tuple(LAYOUT_ARGS)}, got {layout!r}")
    tensor_layout, packing = LAYOUT_ARGS[layout]
    seq_axis = 0 if tensor_layout == "sbhd" else 1
    batch_axis = 1 - seq_axis

    if packing == "qkv":
        qs = check_rank(q, "q", 5, f"packed {layout}")
        if qs[2] != 3:
            raise ValueError(f"q with layout={layout!r} must have 3 at dimension 2, got shape {qs}")
        if k is not None or v is not None:
            raise ValueError(f"k and v must be None with layout={layout!r} (q holds q, k and v)")
        dtype = check_attention_dtypes(q=q)
        qshape = kshape = vshape = qs[:2] + qs[3:]
    else:
        qshape = check_rank(q, "q", 4, tensor_layout)
        if packing == "kv":
            ks = check_rank(k, "k", 5, f"packed kv of {layout}")
            if ks[2] != 2:
                raise ValueError(f"k with layout={layout!r} must have 2 at dimension 2, got shape {ks}")
            if v is not None:
                raise ValueError(f"v must be None with layout={layout!r} (k holds k and v)")
            dtype = check_attention_dtypes(q=q, k=k)
            kshape = vshape = ks[:2] + ks[3:]
        else:
            kshape = check_rank(k, "k", 4, tensor_layout)
            vshape = check_rank(v, "v", 4, tensor_layout)
            dtype = check_attention_dtypes(q=q, k=k, v=v)

    batch, s_q, h_q, d_qk = qshape[batch_axis], qshape[seq_axis], qshape[2], qshape[3]
    s_kv, h_kv = kshape[seq_axis], kshape[2]
    for name, shape in (("k", kshape), ("v", vshape)):
        if shape[batch_axis] != batch:
            raise ValueError(f"{name} batch size {shape[batch_axis]} must equal q's {batch}")
    if vshape[seq_axis] != s_kv:
        raise ValueError(f"k and v must have the same sequence length, got {s_kv} and {vshape[seq_axis]}")
    if vshape[2] != h_kv:
        raise ValueError(f"k and v must have the same number of heads, got {h_kv} and {vshape[2]}")
    if kshape[3] != d_qk:
        raise ValueError(f"k head dim {kshape[3]} must equal q's head dim {d_qk}")
    if h_kv == 0 or h_q % h_kv != 0:
        raise ValueError(f"q heads ({h_q}) must be a multiple of k/v heads ({h_kv}) (GQA/MQA rule "
                         f"h_q % h_kv == 0)")
    if min(batch, s_q, s_kv, h_q, d_qk, vshape[3]) == 0:
        raise ValueError(f"q, k, v must have no empty dimension, got {qshape}, {kshape}, {vshape}")

    if mask not in MASKS:
        raise ValueError(f"mask must be one of {MASKS}, got {mask!r} (padding and packing come "
                         f"from `sequence`)")
    window = _check_window(window, mask)
    bias_shape = _check_bias(bias, batch, h_q, s_q, s_kv)
    dense_mask_shape = _check_dense_mask(dense_mask, batch, h_q, s_q, s_kv)
    if scale is None:
        scale = 1.0 / math.sqrt(d_qk)
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating)) \
            or not math.isfinite(scale):
        raise TypeError(f"scale must be a finite Python float, got {scale!r}")

    if softmax not in SOFTMAX_TYPES:
        raise ValueError(f"softmax must be one of {SOFTMAX_TYPES}, got {softmax!r}")
    if softmax == "learnable":
        if softmax_offset is None:
            raise ValueError("softmax='learnable' needs softmax_offset, a [h_q] array of per-head "
                             "sink logits")
        if _shape(softmax_offset, "softmax_offset") != (h_q,):
            raise ValueError(f"softmax_offset must have shape [h_q] = ({h_q},), got "
                             f"{tuple(softmax_offset.shape)}")
        if not jnp.issubdtype(softmax_offset.dtype, jnp.floating):
            raise TypeError("softmax_offset must be a floating-point array")
    elif softmax_offset is not None:
        raise ValueError(f"softmax_offset is only used with softmax='learnable', got softmax={softmax!r}")

    if isinstance(dropout, bool) or not isinstance(dropout, (int, float, np.floating)) \
            or not 0.0 <= float(dropout) < 1.0:
        raise ValueError(f"dropout must be a float in [0, 1), got {dropout!r}")
    dropout = float(dropout)
    if dropout > 0.0 and rng is None:
        raise ValueError("dropout > 0 needs rng, a JAX PRNG key (jax.random.key or PRNGKey)")
    if dropout > 0.0:
        check_rng(rng)

    if score_mod is not None and not callable(score_mod):
        raise TypeError(f"score_mod must be a function (score, batch, head, q_idx, kv_idx, *args) "
                        f"-> score, got {type(score_mod).__name__}")
    if not isinstance(score_mod_args, (tuple, list)):
        raise TypeError("score_mod_args must be a tuple of arrays")
    if mask_mod is not None:
        if not callable(mask_mod):
            raise TypeError(f"mask_mod must be a function (batch, head, q_idx, kv_idx, *args) -> "
                            f"bool, got {type(mask_mod).__name__}")
        _check_mask_mod(mask_mod, tuple(score_mod_args), batch, h_q)
        score_mod = Masked(score_mod, mask_mod)
    if score_mod_args and score_mod is None:
        raise ValueError("score_mod_args given without score_mod or mask_mod")
    arg_specs = tuple((tuple(_shape(a, f"score_mod_args[{i}]")), jnp.dtype(a.dtype).name)
                      for i, a in enumerate(score_mod_args))
    if score_mod is not None:
        _check_score_mod(score_mod, tuple(score_mod_args), batch, h_q)
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {deterministic!r}")

    precision = _check_precision(precision, dtype)
    kind = check_sequence(sequence, batch, s_q, s_kv)
    config = AttnConfig(
        batch=batch, s_q=s_q, s_kv=s_kv, h_q=h_q, h_kv=h_kv, d_qk=d_qk, d_v=vshape[3],
        dtype=dtype, layout=tensor_layout, qkv_packing=packing, mask=mask, window=window,
        bias_shape=bias_shape, dense_mask_shape=dense_mask_shape, scale=float(scale),
        softmax=softmax, dropout=dropout,
        sequence=kind, max_segments=sequence.max_segments if kind == "packed" else 1,
        shared_segments=kind == "packed" and sequence.shared_segments,
        score_mod=score_mod, score_mod_arg_specs=arg_specs, deterministic=deterministic,
        precision=precision, api=api)
    inputs = AttnInputs(q=q, k=k, v=v, bias=bias, softmax_offset=softmax_offset,
                        sequence=sequence, rng=rng if dropout > 0.0 else None,
                        score_mod_args=tuple(score_mod_args), dense_mask=dense_mask)
    return config, inputs
