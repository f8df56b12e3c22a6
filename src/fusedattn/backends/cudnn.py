"""The cuDNN backend: our own cuDNN fused attention (BF16/FP16) through XLA FFI.

The C++ side (csrc/cuda/cudnn_attention.cc) builds cudnn-frontend graphs
(inference forward, training forward, backward) for a config *key* and caches
them per device and cuDNN version. `supports` asks it to build them, so the
reason for an unsupported config is cudnn-frontend's own message, and the
workspace sizes the FFI calls need are known at trace time. The arrays go in
as the user laid them out: bshd / sbhd and packed qkv / kv through strides,
packed (THD) rows through ragged offsets computed here with JAX, so nothing
in lowering needs a GPU (see `assume_supported` for lowering on a CPU host).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from typing import Dict, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from ..config import AttnConfig
from . import native
from .base import AttnInputs

TARGET_FWD = "fusedattn_cudnn_fwd"
TARGET_BWD = "fusedattn_cudnn_bwd"
DTYPES = ("bfloat16", "float16")
_INT32_MAX = 2**31 - 1

# cuDNN version gates that cudnn-frontend does not enforce itself, in one place:
# (predicate on the config, minimum runtime cuDNN version, what needs it).
VERSION_GATES = (
    (lambda c: c.softmax != "vanilla", 91300,
     "off-by-one / learnable softmax (cuDNN sink tokens)"),
)

_CODES = {
    "layout": {"bshd": 0, "sbhd": 1},
    "qkv_packing": {"separate": 0, "qkv": 1, "kv": 2},
    "mask": {"none": 0, "causal": 1, "causal_bottom_right": 2},
    "softmax": {"vanilla": 0, "off_by_one": 1, "learnable": 2},
    "sequence": {"dense": 0, "padding": 1, "packed": 2},
}


def graph_key(config: AttnConfig) -> str:
    """The string that names this config's graphs (parsed by csrc/cuda/cudnn_params.h)."""
    left, right = config.window_bounds() if (config.window is not None or config.causal) \
        else (-1, -1)
    bias = config.bias_shape or (0, 0, 0, 0)
    fields = (
        ("b", config.batch), ("sq", config.s_q), ("skv", config.s_kv),
        ("hq", config.h_q), ("hkv", config.h_kv), ("dqk", config.d_qk), ("dv", config.d_v),
        ("bf16", int(config.dtype == "bfloat16")),
        ("layout", _CODES["layout"][config.layout]),
        ("packing", _CODES["qkv_packing"][config.qkv_packing]),
        ("mask", _CODES["mask"][config.mask]),
        ("wl", left), ("wr", right),
        ("bias_b", bias[0]), ("bias_h", bias[1]), ("bias_sq", bias[2]), ("bias_skv", bias[3]),
        ("scale", repr(float(config.scale))),
        ("softmax", _CODES["softmax"][config.softmax]),
        ("dropout", repr(float(config.dropout))),
        ("seq", _CODES["sequence"][config.sequence]),
        ("segs", config.max_segments if config.is_packed else 1),
        ("det", int(config.deterministic)),
    )
    return ";".join(f"{name}={value}" for name, value in fields)


def config_reason(config: AttnConfig) -> Optional[str]:
    """What this backend cannot do, decided from the config alone (None: ask cuDNN)."""
    if config.dtype not in DTYPES:
        return f"dtype {config.dtype}: cuDNN fused attention here is {'/'.join(DTYPES)} only"
    if config.score_mod is not None:
        return "score_mod is not lowered to cuDNN graph operations (the XLA backend runs it)"
    if config.sequence not in _CODES["sequence"]:
        return f"sequence kind {config.sequence!r} is served by the small_seq backend"
    if config.is_packed and config.layout != "bshd":
        return "packed (THD) sequences need the bshd layout (cuDNN ragged offsets address rows)"
    if config.is_packed and config.has_bias:
        return "bias with packed (THD) sequences is not supported by cuDNN's ragged layout"
    if config.is_packed:
        width = (3 if config.qkv_packing == "qkv" else 2 if config.qkv_packing == "kv" else 1) \
            * max(config.h_q, config.h_kv) * max(config.d_qk, config.d_v)
        if config.batch * max(config.s_q, config.s_kv) * width > _INT32_MAX:
            return "packed tensors beyond 2^31 elements (int32 ragged offsets)"
    if config.mask != "none" and config.window is not None and config.window[1] not in (0, -1):
        return f"window right side {config.window[1]} with a causal mask"
    return None


def version_reason(config: AttnConfig, cudnn_version: Optional[int]) -> Optional[str]:
    """The first VERSION_GATES entry the runtime cuDNN fails for this config."""
    if cudnn_version is None:
        return None
    for needs, minimum, what in VERSION_GATES:
        if needs(config) and cudnn_version < minimum:
            return (f"{what} needs cuDNN >= {minimum // 10000}.{minimum % 10000 // 100}, "
                    f"runtime is {cudnn_version}")
    return None


# ---- the support probe --------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Probe:
    ok: bool
    message: str
    workspace: Tuple[int, int, int] = (0, 0, 0)  # inference forward, training forward, backward
    build_seconds: float = 0.0


_probe_lock = threading.Lock()
_probes: Dict[str, Probe] = {}
_assumed: Optional[Probe] = None  # set by assume_supported()


@contextlib.contextmanager
def assume_supported(workspace_bytes: int = 0):
    """Skip the native probe: every config passing `config_reason` counts as supported,
    with this workspace size. For lowering / `jax.export` on a host without a GPU;
    a call run with too small a workspace fails with an FFI error saying so."""
    global _assumed
    previous = _assumed
    _assumed = Probe(True, "assumed", (workspace_bytes,) * 3)
    try:
        yield
    finally:
        _assumed = previous


def probe(config: AttnConfig) -> Probe:
    """Build (or find) the config's three cuDNN graphs; cached per key."""
    if _assumed is not None:
        return _assumed
    key = graph_key(config)
    found = _probes.get(key)
    if found is not None:
        return found
    with _probe_lock:
        found = _probes.get(key)
        if found is None:
            why = native.ensure_targets((TARGET_FWD, TARGET_BWD), "cuda")
            if why is not None:  # not cached: the extension may load later
                return Probe(False, why)
            r = native.module("cuda").cudnn_check_support(key)
            ws = r.get("workspace", {})
            found = Probe(bool(r["ok"]), r["message"],
                          (ws.get("forward_inference", 0), ws.get("forward_training", 0),
                           ws.get("backward", 0)),
                          float(sum(r.get("build_seconds", {}).values())))
            _probes[key] = found
    return found


class _CudnnBackend:
    name = "cudnn"
    platforms = ("cuda",)

    def supports(self, config: AttnConfig) -> Optional[str]:
        why = config_reason(config)
        if why is None and _assumed is None:
            why = native.reason("cuda") or version_reason(config, native.cudnn_version())
        if why is None:
            result = probe(config)
            why = None if result.ok else f"cuDNN: {result.message}"
        return why

    def attention(self, config: AttnConfig, inputs: AttnInputs) -> jax.Array:
        return attention_with_lse(config, inputs, need_lse=False)[0]


BACKEND = _CudnnBackend()


# ---- the call -----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything static about one call (hashable: custom_vjp's nondiff argument)."""
    config: AttnConfig
    key: str
    workspace: Tuple[int, int, int]


def attention_with_lse(config: AttnConfig, inputs: AttnInputs, *, need_lse: bool = True):
    """(out, lse): out in the config's layout and q's dtype, lse fp32 ``[b, h_q, s_q]``
    (None unless `need_lse`). Differentiable in q, k, v, bias and softmax_offset."""
    why = BACKEND.supports(config)
    if why is not None:
        raise ValueError(f"cudnn backend cannot run {config.short()}: {why}")
    static = _Static(config, graph_key(config), probe(config).workspace)
    q, k, v = inputs.q, inputs.k, inputs.v  # raw buffers: packing handled by strides
    dtype = q.dtype
    bias = None if inputs.bias is None else inputs.bias.astype(dtype)
    sink = None
    if config.softmax == "learnable":
        sink = inputs.softmax_offset.astype(jnp.float32).reshape(config.h_q)
    elif config.softmax == "off_by_one":
        sink = jnp.zeros((config.h_q,), jnp.float32)
    diff = (q, k, v, bias, sink)
    aux = _aux_arrays(config, inputs)
    if need_lse:
        # The LSE is a saved statistic: gradients flow through `out` only.
        out, stats = _attend_with_lse(static, diff, aux)
        return out, _lse(config, jax.lax.stop_gradient(stats))
    return _attend(static, diff, aux), None


def _aux_arrays(config: AttnConfig, inputs: AttnInputs) -> Tuple[jax.Array, ...]:
    """Sequence lengths, ragged offsets and dropout seed/offset, in the handlers' order."""
    aux = []
    seq = inputs.sequence
    if config.is_padded:
        aux += [jnp.clip(seq.q_lengths, 0, config.s_q).astype(jnp.int32).reshape(-1),
                jnp.clip(seq.kv_lengths, 0, config.s_kv).astype(jnp.int32).reshape(-1)]
    elif config.is_packed:
        aux += _packed_arrays(config, seq)
    if config.has_dropout:
        # 64-bit Philox seed and offset, each as two uint32 words (no x64 needed).
        bits = jax.random.bits(inputs.rng, (3,), jnp.uint32)
        aux += [bits[:2], jnp.stack([bits[2], jnp.uint32(0)])]
    return tuple(aux)


def _packed_arrays(config: AttnConfig, seq):
    """THD: per-segment lengths and the element offsets where each segment starts in
    q, k, v, o and the [b, h, s_q] statistics (each [b * segments + 1], int32)."""
    b = config.batch
    kv_pack = {"separate": 1, "kv": 2, "qkv": 3}[config.qkv_packing]
    q_pack = 3 if config.qkv_packing == "qkv" else 1

    def token_starts(lengths, offsets, s):
        # Unused segments (length 0) start where the previous one did: offsets must
        # not decrease, whatever the descriptor holds for them.
        starts = jax.lax.cummax(jnp.where(lengths > 0, offsets, 0).astype(jnp.int32), axis=1)
        row = (jnp.arange(b, dtype=jnp.int32) * s)[:, None]
        return jnp.concatenate([(row + starts).reshape(-1), jnp.array([b * s], jnp.int32)])

    q_len = jnp.clip(seq.q_lengths, 0, config.s_q).astype(jnp.int32)
    kv_len = jnp.clip(seq.kv_lengths, 0, config.s_kv).astype(jnp.int32)
    tq = token_starts(q_len, seq.q_offsets, config.s_q)
    tkv = token_starts(kv_len, seq.kv_offsets, config.s_kv)
    return [q_len.reshape(-1), kv_len.reshape(-1),
            tq * (q_pack * config.h_q * config.d_qk),
            tkv * (kv_pack * config.h_kv * config.d_qk),
            tkv * (kv_pack * config.h_kv * config.d_v),
            tq * (config.h_q * config.d_v),
            tq * config.h_q]  # statistics: token-major [b * s_q, h_q]


def _out_shape(config: AttnConfig):
    if config.layout == "sbhd":
        return (config.s_q, config.batch, config.h_q, config.d_v)
    return (config.batch, config.s_q, config.h_q, config.d_v)


def _stats_shape(config: AttnConfig):
    """cuDNN's statistics buffer: [b, h, s_q], or token-major [b, s_q, h] when packed
    (the layout cudnn-frontend sizes its THD backward workspace for)."""
    if config.is_packed:
        return (config.batch, config.s_q, config.h_q)
    return (config.batch, config.h_q, config.s_q)


def _lse(config: AttnConfig, stats):
    """The contract's fp32 LSE [b, h_q, s_q] from cuDNN's statistics buffer."""
    return jnp.swapaxes(stats, 1, 2) if config.is_packed else stats


def _workspace(nbytes: int):
    return jax.ShapeDtypeStruct((max(int(nbytes), 1),), jnp.uint8)


def _forward_call(static: _Static, diff, aux, training: bool):
    cfg = static.config
    q, k, v, bias, sink = diff
    args = [x for x in (q, k, v) if x is not None]
    args += [bias] if bias is not None else []
    args += list(aux)
    args += [sink] if sink is not None else []
    results = [jax.ShapeDtypeStruct(_out_shape(cfg), q.dtype)]
    if training:
        results.append(jax.ShapeDtypeStruct(_stats_shape(cfg), jnp.float32))
    results.append(_workspace(static.workspace[1 if training else 0]))
    outs = jax.ffi.ffi_call(TARGET_FWD, tuple(results), vmap_method="sequential")(
        *args, key=static.key, training=np.int64(training))
    return outs[0], (outs[1] if training else None)


def _backward_call(static: _Static, diff, aux, o, lse, d_o):
    cfg = static.config
    q, k, v, bias, sink = diff
    buffers = [x for x in (q, k, v) if x is not None]
    args = buffers + [o, d_o.astype(o.dtype), lse]
    args += [bias] if bias is not None else []
    args += list(aux)
    args += [sink] if sink is not None else []
    results = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in buffers]
    if bias is not None:
        results.append(jax.ShapeDtypeStruct(bias.shape, bias.dtype))
    if cfg.softmax == "learnable":
        results.append(jax.ShapeDtypeStruct((cfg.h_q,), jnp.float32))
    results.append(_workspace(static.workspace[2]))
    outs = list(jax.ffi.ffi_call(TARGET_BWD, tuple(results), vmap_method="sequential")(
        *args, key=static.key))
    grads = iter(outs[:len(buffers)])
    d_q, d_k, d_v = (next(grads) if x is not None else None for x in (q, k, v))
    rest = outs[len(buffers):-1]
    d_bias = rest.pop(0) if bias is not None else None
    if sink is None:
        d_sink = None
    elif cfg.softmax == "learnable":
        d_sink = rest.pop(0)
    else:  # off_by_one: the sink is a constant 0
        d_sink = jnp.zeros_like(sink)
    return d_q, d_k, d_v, d_bias, d_sink


def _register():
    """FFI targets on first use; on a host without the extension (lowering only) a no-op."""
    if native.gpu_platform() == "cuda":
        native.ensure_targets((TARGET_FWD, TARGET_BWD), "cuda")


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(static, diff, aux):
    _register()
    return _forward_call(static, diff, aux, training=False)[0]


def _attend_fwd(static, diff, aux):
    _register()
    o, lse = _forward_call(static, diff, aux, training=True)
    return o, (diff, aux, o, lse)


def _attend_bwd(static, res, d_o):
    diff, aux, o, lse = res
    return _backward_call(static, diff, aux, o, lse, d_o), None


_attend.defvjp(_attend_fwd, _attend_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend_with_lse(static, diff, aux):
    _register()
    return _forward_call(static, diff, aux, training=True)


def _attend_with_lse_fwd(static, diff, aux):
    o, lse = _attend_with_lse(static, diff, aux)
    return (o, lse), (diff, aux, o, lse)


def _attend_with_lse_bwd(static, res, cotangents):
    # The caller stops the LSE's gradient, so only the output's cotangent is non-zero.
    diff, aux, o, lse = res
    return _backward_call(static, diff, aux, o, lse, cotangents[0]), None


_attend_with_lse.defvjp(_attend_with_lse_fwd, _attend_with_lse_bwd)
