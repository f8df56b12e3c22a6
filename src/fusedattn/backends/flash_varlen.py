"""FA3's kernels on packed (THD) sequences: each (row, segment) is one of the kernels'
variable-length sequences.

The tokens of a ``[b, s, h, d]`` batch are taken as ``[b * s, h, d]``; segment ``n`` of
row ``r`` starts at token ``r * s + offset`` (segments lie back to back from the start
of each row, as validation demands) and uses ``length`` tokens (FA3's ``seqused``), so
trailing padding is never computed. Each row adds two sequences of its padding: its
padded queries against no key, and no query against its padded keys. FA3 writes a tile
that sees nothing as zeros (out, dq, dk, dv) with lse ``-inf``, which is the contract
for padding, so no pass over the outputs is needed to clear them. FA3 aligns a
segment's causal mask and window to its bottom-right corner, which is the top-left one
only when query and key segments are the same (``shared_segments``).

The calls are the package's registered FFI targets "flash_mha_fwd" / "flash_mha_bwd"
with our own operands: the package's varlen binding takes no ``seqused`` in its
backward, and sizes the scratch rows for 128-row tiles (`flash._BWD_TILE_ROWS`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ..config import AttnConfig
from ..inputs import AttnInputs

_I32, _F32 = jnp.int32, jnp.float32


def _segments(lengths, s: int, side: int):
    """(starts [b * (S + 2) + 1], used [b * (S + 2)]) of one side's sequences in the flat
    tokens: a row's segments, then its padding as queries (side 0: used on the query
    side only) and as keys (side 1)."""
    # (clipped as a running sum: lengths that a traced descriptor gives past the row,
    # which validation checks only on concrete arrays, never reach beyond it)
    ends = jnp.clip(jnp.cumsum(jnp.maximum(lengths, 0), axis=1), 0, s).astype(_I32)
    b = ends.shape[0]
    lengths = ends - jnp.pad(ends[:, :-1], ((0, 0), (1, 0)))   # [b, S]
    pad = s - ends[:, -1:]
    used = jnp.concatenate([lengths] + [pad if side == i else 0 * pad for i in (0, 1)], 1)
    starts = jnp.concatenate([ends - lengths, ends[:, -1:], ends[:, -1:]], 1)
    starts = starts + (jnp.arange(b, dtype=_I32) * s)[:, None]
    return (jnp.concatenate([starts.reshape(-1), jnp.array([b * s], _I32)]),
            used.reshape(-1))


def _flat(x):
    return x.reshape((-1,) + x.shape[2:])


def _operands(config: AttnConfig, inputs: AttnInputs):
    seq = inputs.sequence
    cu_q, used_q = _segments(seq.q_lengths, config.s_q, 0)
    cu_k, used_k = _segments(seq.kv_lengths, config.s_kv, 1)
    return cu_q, cu_k, used_q, used_k


def _lse_shape(config: AttnConfig):
    """The kernels' varlen lse: [h, total query tokens] (the package's binding allocates
    [sequences, h, max_seqlen_q], which is larger by the number of sequences)."""
    return (config.h_q, config.batch * config.s_q)


def _sequences(config: AttnConfig) -> int:
    return config.batch * (config.max_segments + 2)


def forward(config: AttnConfig, inputs: AttnInputs, mask):
    """(out [b, s_q, h_q, d_v], fp32 lse [b, h_q, s_q]); `mask` as `flash._mask_args`."""
    b, s_q, h = config.batch, config.s_q, config.h_q
    q, k, v = _flat(inputs.q), _flat(inputs.k), _flat(inputs.v)
    cu_q, cu_k, used_q, used_k = _operands(config, inputs)
    i32 = jnp.zeros((0,), _I32)
    f32 = jnp.zeros((0,), _F32)
    none = jnp.zeros((0,), q.dtype)
    results = [jax.ShapeDtypeStruct((b * s_q, h, config.d_v), q.dtype),
               jax.ShapeDtypeStruct(_lse_shape(config), _F32),
               jax.ShapeDtypeStruct((1, 1, 1, 1), _F32), jax.ShapeDtypeStruct((1, 1, 1), _F32)]
    out, lse, _, _ = jax.ffi.ffi_call("flash_mha_fwd", results)(
        q, k, v, none, none, none, cu_q, cu_k, i32, used_q, used_k, i32, i32, i32, none,
        none, i32, f32, f32, f32, i32,
        max_seqlen_q=s_q, max_seqlen_q_has_value=True, max_seqlen_k=config.s_kv,
        max_seqlen_k_has_value=True, softmax_scale_val=mask["softmax_scale"],
        softmax_scale_has_value=True, pack_gqa_val=False, pack_gqa_has_value=False,
        is_causal=mask["is_causal"], window_size_left=mask["window_size"][0],
        window_size_right=mask["window_size"][1], attention_chunk=0, softcap=0.0,
        is_rotary_interleaved=False, num_splits=1, sm_margin=0)
    lse = lse.reshape(h, b, s_q).transpose(1, 0, 2)
    return out.reshape(b, s_q, h, -1), lse


def backward(config: AttnConfig, inputs: AttnInputs, out, lse, d_out, mask, scratch_rows):
    """Gradients of q, k, v; `scratch_rows(total)` sizes FA3's fp32 scratch rows."""
    b, s_q, h = config.batch, config.s_q, config.h_q
    q, k, v = _flat(inputs.q), _flat(inputs.k), _flat(inputs.v)
    cu_q, cu_k, used_q, used_k = _operands(config, inputs)
    flat_lse = jnp.transpose(lse, (1, 0, 2)).reshape(_lse_shape(config))
    rows = jax.ShapeDtypeStruct((h, scratch_rows(b * s_q, _sequences(config))), _F32)
    results = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)] + [rows, rows]
    d_q, d_k, d_v, _, _ = jax.ffi.ffi_call("flash_mha_bwd", results)(
        _flat(d_out), q, k, v, _flat(out), flat_lse, cu_q, cu_k, used_q, used_k,
        max_seqlen_q_val=s_q, max_seqlen_q_has_value=True,
        max_seqlen_k_val=config.s_kv, max_seqlen_k_has_value=True,
        softmax_scale_val=mask["softmax_scale"], softmax_scale_has_value=True,
        is_causal=mask["is_causal"], window_size_left=mask["window_size"][0],
        window_size_right=mask["window_size"][1], softcap=0.0, deterministic=False,
        sm_margin=0)
    return (d_q.reshape(inputs.q.shape), d_k.reshape(inputs.k.shape),
            d_v.reshape(inputs.v.shape))
