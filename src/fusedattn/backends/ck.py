"""The CK backend: Composable Kernel's fused attention (ck_tile FMHA) on AMD GPUs.

Forward and backward are XLA FFI calls into `fusedattn._rocm` (csrc/rocm/
ck_fmha_{fwd,bwd}.cpp) on platform ROCM, exposed as the per-device `forward` /
`backward` that `native_op` differentiates and partitions. The kernel
instances are the ones CK's own generator emits for the configurations below
(cmake/fusedattn_rocm.cmake); `supports` states exactly those limits.

How the config maps onto CK:
* dense and padding: CK's batch mode on the tensors as they are (bshd or sbhd
  by strides); padding passes cumulative true lengths.
* packed (THD): CK's group mode on the flattened token axis, one CK "batch"
  per segment, addressed by start token and true length.
* masks: causal top-left / bottom-right and windows are CK's (left, right)
  windows, which follow the same convention as `AttnConfig.window_bounds`.
* bias: post-scale elementwise bias in q's dtype, broadcast by zero strides.
* dropout: CK's philox stream from a seed and offset drawn from the JAX key
  (so the dropped positions differ from the XLA backend's, as between vendors).
* GQA: CK returns dk / dv per query head; they are summed per kv head here.

Nothing here has run on AMD hardware yet (see docs/ROCM.md): the C++ side is
compile-checked in CI and this module's lowering is tested on CPU.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from ..config import AttnConfig
from . import extension, native_op
from ..inputs import AttnInputs, pack_like_inputs, unpack_qkv
from .xla.masks import token_info

TARGET_FWD = "fusedattn_ck_fwd"
TARGET_BWD = "fusedattn_ck_bwd"

DTYPES = ("float16", "bfloat16")
MAX_HEAD_DIM = 256
HEAD_DIM_MULTIPLE = 8
_INT32_MAX = 2**31 - 1

# Attribute values shared with csrc/rocm/ck_fmha_common.h.
_LAYOUT = {"bshd": 0, "sbhd": 1}
_SEQUENCE = {"dense": 0, "padding": 1, "packed": 2}
_NO_MASK, _TOP_LEFT, _BOTTOM_RIGHT = 0, 1, 2


# ---- what CK can run ---------------------------------------------------------
def config_reason(config: AttnConfig) -> Optional[str]:
    """Why the generated CK kernels cannot serve `config` (None: they can)."""
    if config.sequence not in _SEQUENCE:
        return f"CK does not take {config.sequence!r} sequences (small-seq serves them)"
    if config.dtype not in DTYPES:
        return f"CK kernels are built for float16/bfloat16 only, not {config.dtype}"
    big = max(config.d_qk, config.d_v)
    if big > MAX_HEAD_DIM:
        return (f"head dim {big} > {MAX_HEAD_DIM}: CK's FMHA instances stop at "
                f"{MAX_HEAD_DIM} (small-seq or XLA serve it)")
    for name, d in (("d_qk", config.d_qk), ("d_v", config.d_v)):
        if d % HEAD_DIM_MULTIPLE:
            return f"{name}={d} is not a multiple of {HEAD_DIM_MULTIPLE} (CK loads 8 elements at a time)"
    if config.softmax != "vanilla":
        return f"CK has no softmax sink (softmax={config.softmax!r})"
    if config.score_mod is not None:
        return "score_mod is not supported by CK (XLA or cuDNN run it)"
    if config.deterministic:
        return ("the CK backward kernels built here accumulate dq with atomics "
                "(deterministic=True goes elsewhere)")
    if config.is_packed and config.has_bias:
        return "bias with packed sequences is not supported by CK's group mode here"
    for what, count in (("q", config.batch * config.s_q * config.h_q * config.d_qk),
                        ("k", config.batch * config.s_kv * config.h_kv * config.d_qk),
                        ("v", config.batch * config.s_kv * config.h_kv * config.d_v),
                        ("bias/dbias", config.batch * config.h_q * config.s_q * config.s_kv
                         if config.has_bias else 0)):
        if count > _INT32_MAX:
            return f"{what} has {count} elements, beyond CK's 32-bit indexing"
    return None


def extension_reason() -> Optional[str]:
    """Why the CK FFI targets are unavailable (None: registered with JAX for ROCM)."""
    return extension.ensure_targets((TARGET_FWD, TARGET_BWD), "rocm")


def supports(config: AttnConfig) -> Optional[str]:
    return config_reason(config) or extension_reason()


# ---- the call's static and traced parts --------------------------------------
class _Static(NamedTuple):
    """Everything the FFI calls need that is static."""
    attrs: tuple            # sorted (name, value) pairs of FFI attributes
    grouped: bool           # packed: tensors flattened to [1, tokens, h, d] bshd
    batch: int
    s_q: int
    s_kv: int
    h_kv: int
    bias_shape: Optional[tuple]  # the prepared bias' shape (None without bias)

    def kwargs(self):
        return dict(self.attrs)


def _mask_attrs(config: AttnConfig):
    left, right = config.window_bounds()
    if config.bottom_right:
        kind = _BOTTOM_RIGHT
    elif config.causal or left >= 0 or right >= 0:
        kind = _TOP_LEFT
    else:
        kind = _NO_MASK
    return kind, left, right


def _seq_array(config: AttnConfig, seq) -> jax.Array:
    """The int32 [4, G + 1] array of ck_fmha_common.h (see SeqPointers there)."""
    i32 = jnp.int32
    if config.sequence == "dense" or seq is None:
        return jnp.zeros((4, 1), i32)
    zero = jnp.zeros((1,), i32)
    if config.is_padded:
        cu_q = jnp.concatenate([zero, jnp.cumsum(seq.q_lengths.astype(i32))])
        cu_k = jnp.concatenate([zero, jnp.cumsum(seq.kv_lengths.astype(i32))])
        blank = jnp.zeros_like(cu_q)
        return jnp.stack([cu_q, cu_k, blank, blank]).astype(i32)
    b = config.batch
    row_q = (jnp.arange(b, dtype=i32) * config.s_q)[:, None]
    row_k = (jnp.arange(b, dtype=i32) * config.s_kv)[:, None]
    start_q = (row_q + seq.q_offsets.astype(i32)).reshape(-1)
    start_k = (row_k + seq.kv_offsets.astype(i32)).reshape(-1)
    len_q = seq.q_lengths.astype(i32).reshape(-1)
    len_k = seq.kv_lengths.astype(i32).reshape(-1)
    end = lambda total: jnp.full((1,), total, i32)  # noqa: E731
    return jnp.stack([jnp.concatenate([start_q, end(b * config.s_q)]),
                      jnp.concatenate([start_k, end(b * config.s_kv)]),
                      jnp.concatenate([len_q, zero]),
                      jnp.concatenate([len_k, zero])])


def _keep_masks(config: AttnConfig, seq):
    """([b, s_q] queries that are real and see at least one key, [b, s_kv] real keys).

    CK leaves padded positions unwritten; these masks make them exactly 0 (and
    rows with no visible key 0) whatever the kernels do there.
    """
    info = token_info(config, seq)
    b = config.batch
    if config.sequence == "dense" or seq is None:
        q_real = jnp.ones((b, config.s_q), bool)
        kv_real = jnp.ones((b, config.s_kv), bool)
        len_kv = jnp.full((b, config.s_q), config.s_kv, jnp.int32)
    elif config.is_padded:
        q_real, kv_real = info.q_seg > 0, info.kv_seg > 0
        len_kv = jnp.broadcast_to(seq.kv_lengths.astype(jnp.int32)[:, None], (b, config.s_q))
    else:
        q_real, kv_real = info.q_seg > 0, info.kv_seg > 0
        index = jnp.clip(seq.q_segment_ids.astype(jnp.int32) - 1, 0, config.max_segments - 1)
        len_kv = jnp.take_along_axis(seq.kv_lengths.astype(jnp.int32), index, axis=1)
    left, right = config.window_bounds()
    centre = jnp.broadcast_to(info.q_pos, (b, config.s_q))
    if config.bottom_right:
        centre = centre + info.q_offset
    first = jnp.maximum(centre - left, 0) if left >= 0 else jnp.zeros_like(centre)
    last = jnp.minimum(centre + right, len_kv - 1) if right >= 0 else len_kv - 1
    return q_real & (first <= last), kv_real


def _prepare_bias(config: AttnConfig, bias, dtype):
    """Bias as [b|1, h|1, s_q, s_kv] in q's dtype, and its element strides."""
    if bias is None:
        return jnp.zeros((0,), dtype), None, (0, 0, 0)
    bb, hb = bias.shape[0], bias.shape[1]
    full = jnp.broadcast_to(bias, (bb, hb, config.s_q, config.s_kv)).astype(dtype)
    plane = config.s_q * config.s_kv
    strides = (0 if bb == 1 else hb * plane, 0 if hb == 1 else plane, config.s_kv)
    return full, full.shape, strides


def _to_ck(config: AttnConfig, x, grouped: bool):
    """A [.., h, d] tensor in the config's layout -> what the kernels read."""
    if not grouped:
        return x
    if config.layout == "sbhd":
        x = jnp.swapaxes(x, 0, 1)
    return x.reshape(1, -1, *x.shape[2:])


def _from_ck(config: AttnConfig, x, grouped: bool, s: int):
    if not grouped:
        return x
    x = x.reshape(config.batch, s, *x.shape[2:])
    return jnp.swapaxes(x, 0, 1) if config.layout == "sbhd" else x


def _batch_first(config: AttnConfig, x, grouped: bool):
    """[.., s, ..] per-token mask [b, s] broadcast against a tensor in the config's layout."""
    m = x if config.layout == "bshd" or grouped else x.T
    return m[:, :, None, None]


# ---- the FFI calls ------------------------------------------------------------
def _lse_shape(st: _Static, h_q: int):
    return (h_q, st.batch * st.s_q) if st.grouped else (st.batch, h_q, st.s_q)


def _forward(st: _Static, q, k, v, bias, seq, drop):
    h_q = q.shape[2]
    out_shape = (*q.shape[:3], v.shape[3])
    out, lse = jax.ffi.ffi_call(
        TARGET_FWD,
        (jax.ShapeDtypeStruct(out_shape, q.dtype),
         jax.ShapeDtypeStruct(_lse_shape(st, h_q), jnp.float32)),
    )(q, k, v, bias, seq, drop, **st.kwargs())
    return out, lse


def _backward(st: _Static, q, k, v, bias, seq, drop, out, lse, dout):
    h_q = q.shape[2]
    per_query_head = lambda x: jax.ShapeDtypeStruct((*x.shape[:2], h_q, x.shape[3]), x.dtype)  # noqa: E731
    dbias_shape = (st.batch, h_q, st.s_q, st.s_kv) if st.bias_shape else (0,)
    dq, dk, dv, dbias, _, _ = jax.ffi.ffi_call(
        TARGET_BWD,
        (jax.ShapeDtypeStruct(q.shape, q.dtype), per_query_head(k), per_query_head(v),
         jax.ShapeDtypeStruct(dbias_shape, q.dtype),
         jax.ShapeDtypeStruct(_lse_shape(st, h_q), jnp.float32),   # d = rowsum(dO * O)
         jax.ShapeDtypeStruct(q.shape, jnp.float32)),              # dq accumulator
    )(q, k, v, bias, out, lse, dout, seq, drop, **st.kwargs())
    return dq, dk, dv, dbias


def _sum_groups(x, h_kv: int):
    """[.., s, h_q, d] per query head -> [.., s, h_kv, d] summed over each GQA group."""
    *lead, h_q, d = x.shape
    if h_q == h_kv:
        return x
    return x.astype(jnp.float32).reshape(*lead, h_kv, h_q // h_kv, d).sum(-2).astype(x.dtype)


def _dropout_words(config: AttnConfig, bits) -> jax.Array:
    """Seed and offset for CK's philox stream, two uint64 as uint32[4]: the raw bits
    native_op draws from the key."""
    if not config.has_dropout:
        return jnp.zeros((0,), jnp.uint32)
    return bits


class _Prepared(NamedTuple):
    st: _Static
    q: jax.Array
    k: jax.Array
    v: jax.Array
    bias: jax.Array
    seq: jax.Array
    drop: jax.Array
    q_keep: jax.Array   # queries that are real and see a key, broadcast against q
    kv_keep: jax.Array  # real keys, broadcast against k


def _prepare(config: AttnConfig, inputs: AttnInputs) -> _Prepared:
    """What the kernels read: tensors in CK's view, attributes, masks of real tokens."""
    if extension.gpu_platform() == "rocm":
        extension_reason()  # registers the FFI targets; lowering elsewhere needs none
    q, k, v = unpack_qkv(config, inputs)
    grouped = config.is_packed
    seq = inputs.sequence
    bias, bias_shape, bias_strides = _prepare_bias(config, inputs.bias, q.dtype)
    kind, left, right = _mask_attrs(config)
    attrs = dict(
        layout=np.int64(0 if grouped else _LAYOUT[config.layout]),
        sequence=np.int64(_SEQUENCE[config.sequence]),
        max_seqlen_q=np.int64(config.s_q), max_seqlen_k=np.int64(config.s_kv),
        mask=np.int64(kind), window_left=np.int64(left), window_right=np.int64(right),
        scale=np.float32(config.scale), dropout=np.float32(config.dropout),
        bias_batch_stride=np.int64(bias_strides[0]), bias_head_stride=np.int64(bias_strides[1]),
        bias_row_stride=np.int64(bias_strides[2]))
    st = _Static(tuple(sorted(attrs.items())), grouped, config.batch, config.s_q,
                 config.s_kv, config.h_kv, bias_shape)
    q_keep, kv_keep = _keep_masks(config, seq)
    q_keep = _batch_first(config, q_keep, False)
    kv_keep = _batch_first(config, kv_keep, False)
    if grouped:  # the kernels see [1, tokens, h, d]; masks follow
        q_keep = q_keep.reshape(1, -1, 1, 1)
        kv_keep = kv_keep.reshape(1, -1, 1, 1)
    to_ck = lambda x: _to_ck(config, x, grouped)  # noqa: E731
    return _Prepared(st, to_ck(q), to_ck(k), to_ck(v), bias, _seq_array(config, seq),
                     _dropout_words(config, inputs.rng), q_keep, kv_keep)


def _lse_to_contract(p: _Prepared, lse):
    """CK's LSE ([h, b * s_q] in group mode) -> [b, h, s_q]."""
    if not p.st.grouped:
        return lse
    return jnp.swapaxes(lse.reshape(lse.shape[0], p.st.batch, p.st.s_q), 0, 1)


def _lse_from_contract(p: _Prepared, lse):
    if not p.st.grouped:
        return lse
    return jnp.swapaxes(lse, 0, 1).reshape(lse.shape[1], -1)


# ---- the per-device kernels (native_op partitions and differentiates them) ---------------
def forward(config: AttnConfig, inputs: AttnInputs, training: bool = True):
    """(out, fp32 lse [b, h_q, s_q] when training); padded positions exactly 0."""
    p = _prepare(config, inputs)
    out, lse = _forward(p.st, p.q, p.k, p.v, p.bias, p.seq, p.drop)
    out = jnp.where(p.q_keep, out, jnp.zeros((), out.dtype))
    out = _from_ck(config, out, p.st.grouped, config.s_q)
    return out, (_lse_to_contract(p, lse) if training else None)


def backward(config: AttnConfig, inputs: AttnInputs, out, lse, d_out) -> AttnInputs:
    """Gradients of q, k, v (as packed as the inputs) and bias."""
    p = _prepare(config, inputs)
    to_ck = lambda x: _to_ck(config, x, p.st.grouped)  # noqa: E731
    zero = jnp.zeros((), p.q.dtype)
    d_out = jnp.where(p.q_keep, to_ck(d_out.astype(out.dtype)), zero)
    dq, dk, dv, dbias = _backward(p.st, p.q, p.k, p.v, p.bias, p.seq, p.drop, to_ck(out),
                                  _lse_from_contract(p, lse), d_out)
    dq = jnp.where(p.q_keep, dq, zero)
    dk = jnp.where(p.kv_keep, _sum_groups(dk, p.st.h_kv), zero)
    dv = jnp.where(p.kv_keep, _sum_groups(dv, p.st.h_kv), zero)
    back = lambda x, s: _from_ck(config, x, p.st.grouped, s)  # noqa: E731
    dq, dk, dv = pack_like_inputs(config, back(dq, config.s_q), back(dk, config.s_kv),
                                  back(dv, config.s_kv))
    d_bias = None
    if inputs.bias is not None:
        bb, hb = inputs.bias.shape[:2]
        axes = tuple(a for a, n in ((0, bb), (1, hb)) if n == 1)
        d_bias = dbias.astype(jnp.float32).sum(axes, keepdims=True)
        d_bias = d_bias.reshape(inputs.bias.shape).astype(inputs.bias.dtype)
    return AttnInputs(q=dq, k=dk, v=dv, bias=d_bias)


def attention(config: AttnConfig, inputs: AttnInputs) -> jax.Array:
    """The output, differentiable and partitioned over batch and head splits."""
    return native_op.attention("ck", config, inputs)[0]


class _CkBackend:
    name = "ck"
    platforms = ("rocm",)
    # What CK's FMHA codegen offers for FP8 (the CK tree of amd-aiter 0.1.7, docs/ROCM.md).
    fp8_reason = (
        "no FP8 kernels wrapped: CK's FP8 forward instances (gfx9 incl. gfx942: fp8 / "
        "fp8bf16, head dims 64 / 128 / 256, per-tensor static quantization) take their "
        "scales as host floats in the kernel arguments, so a jitted call would copy the "
        "device scales to the host and wait inside the handler (no host sync, command "
        "buffers); they write no LSE and CK has no FP8 backward")

    def supports(self, config: AttnConfig) -> Optional[str]:
        return supports(config)

    def attention(self, config: AttnConfig, inputs: AttnInputs) -> jax.Array:
        return attention(config, inputs)


BACKEND = _CkBackend()


native_op.register("ck", native_op.Kernels(forward, backward))
