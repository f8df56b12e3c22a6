"""The cuDNN backend: our own cuDNN fused attention (BF16/FP16; FP8 kernels in
`cudnn_fp8`) through XLA FFI.

The C++ side (csrc/cuda/cudnn_*.{h,cc}; cudnn_graph.h maps the files) builds
cudnn-frontend graphs (inference forward, training forward, backward) for a
config *key* and caches them per device and cuDNN version. `supports` asks it to build them, so the
reason for an unsupported config is cudnn-frontend's own message, and the
workspace sizes the FFI calls need are known at trace time. The arrays go in
as the user laid them out: bshd / sbhd and packed qkv / kv through strides,
packed (THD) rows through ragged offsets computed here with JAX, so nothing
in lowering needs a GPU (see `assume_supported` for lowering on a CPU host).
The per-device `forward` / `backward` below are differentiated and partitioned
by `native_call`: under a batch / head split each device builds and runs the
graphs of its own shard's config.

score_mods: every JAX score_mod / mask_mod, the built-in ALiBi and softcap of
`fusedattn.score_mods` included, is lowered to pointwise graph operations by
`cudnn_flex` (with the config's masks composed in), or refused with the reason. On
H100 with cuDNN 9.19 the lowered ALiBi ran faster than cuDNN's ALiBi mask (causal 440
/ 445 against 416 / 422 TFLOP/s forward / training), the lowered softcap as fast as
the frontend's softcap functor (440 / 439 against 432 / 422, within the 2% that two
runs of one program differ by: benchmarks/results/SUMMARY.md), and both take masks
and windows the dedicated forms refused. ALiBi keeps cuDNN's own form where a program
cannot run and that form can (padding lengths, packed sequences, bias:
`cudnn_flex.uses_cudnn_alibi`).

The probe (`cudnn_probe`) persists plans across processes (`fusedattn.plan_cache`)
and bounds the in-process graph cache (`set_graph_cache_size`).

Graphs with cuDNN's ALiBi copy their slopes from host memory into the workspace on
every execute; they run through FFI targets that do not declare XLA's
command-buffer trait (csrc/cuda/cudnn_ffi.cc explains why), chosen from
the probe's `host_copies`.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from .. import causal_chunks, fp8, mask_chunks
from ..config import AttnConfig
from ..score_mods import Alibi
from . import cudnn_flex, cudnn_probe, native, native_call
from .cudnn_probe import GRAPHS, Probe

# The probe's switches, as the cudnn backend's public surface.
assume_supported = cudnn_probe.assume_supported
set_graph_cache_size = cudnn_probe.set_graph_cache_size
graph_cache_stats = cudnn_probe.graph_cache_stats
set_autotune = cudnn_probe.set_autotune
from .base import AttnInputs

TARGET_FWD = "fusedattn_cudnn_fwd"
TARGET_BWD = "fusedattn_cudnn_bwd"
# The same handlers without the command-buffer trait, for graphs whose execute
# copies from host memory (ALiBi slopes): XLA never captures them.
TARGET_FWD_NOCMDBUF = "fusedattn_cudnn_fwd_nocmdbuf"
TARGET_BWD_NOCMDBUF = "fusedattn_cudnn_bwd_nocmdbuf"
# FP8 graphs (backends/cudnn_fp8.py) copy nothing from the host: command-buffer safe.
TARGET_FP8_FWD = "fusedattn_cudnn_fp8_fwd"
TARGET_FP8_BWD = "fusedattn_cudnn_fp8_bwd"
TARGETS = (TARGET_FWD, TARGET_BWD, TARGET_FWD_NOCMDBUF, TARGET_BWD_NOCMDBUF, TARGET_FP8_FWD,
           TARGET_FP8_BWD)
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
        ("alibi", int(cudnn_flex.uses_cudnn_alibi(config))),
        ("fp8", int(config.is_fp8)),
        ("fp8_do", int(config.is_fp8 and config.fp8_do == "e5m2")),
        ("fp8_grad", int(config.is_fp8 and config.fp8_grad == "e5m2")),
        ("flex", ""), ("flexb", ""), ("flexin", ""),
    )
    if cudnn_flex.is_flex(config):  # the programs hold the masks: none for cuDNN
        overrides = cudnn_flex.key_fields(config)
        fields = tuple((name, overrides.get(name, value)) for name, value in fields)
    return ";".join(f"{name}={value}" for name, value in fields)


def config_reason(config: AttnConfig) -> Optional[str]:
    """What this backend cannot do, decided from the config alone (None: ask cuDNN)."""
    if config.dtype not in DTYPES:
        return f"dtype {config.dtype}: cuDNN fused attention here is {'/'.join(DTYPES)} only"
    if config.is_fp8:
        why = fp8.config_reason(config)
        if why is not None:
            return why
    why = score_mod_reason(config)
    if why is not None:
        return why
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


def score_mod_reason(config: AttnConfig) -> Optional[str]:
    """Why cuDNN cannot run this config's score_mod (None: no score_mod, or one it runs)."""
    if config.score_mod is None:
        return None
    lowered = cudnn_flex.reason(config)
    if lowered is None or not isinstance(config.score_mod, Alibi):
        return lowered
    dedicated = cudnn_flex.alibi_reason(config)
    return None if dedicated is None else f"{lowered}; and cuDNN's own ALiBi: {dedicated}"


def version_reason(config: AttnConfig, cudnn_version: Optional[int]) -> Optional[str]:
    """The first VERSION_GATES entry the runtime cuDNN fails for this config."""
    if cudnn_version is None:
        return None
    for needs, minimum, what in VERSION_GATES:
        if needs(config) and cudnn_version < minimum:
            return (f"{what} needs cuDNN >= {minimum // 10000}.{minimum % 10000 // 100}, "
                    f"runtime is {cudnn_version}")
    return None


def probe(config: AttnConfig) -> Probe:
    """Build (or find) the config's three cuDNN graphs, concurrently; cached per key."""
    return cudnn_probe.probe(graph_key(config), TARGETS)


class _CudnnBackend:
    name = "cudnn"
    platforms = ("cuda",)
    fp8 = True  # FP8 kernels in backends/cudnn_fp8.py

    def supports(self, config: AttnConfig) -> Optional[str]:
        why = config_reason(config)
        if why is None and cudnn_probe.assumed() is None:
            why = native.reason("cuda") or version_reason(config, native.cudnn_version())
        if why is None:
            result = probe(config)
            why = None if result.ok else f"cuDNN: {result.message}"
            if why is not None and cudnn_flex.is_flex(config):
                why = (f"cuDNN: the score_mod lowered to pointwise operations has no engine on "
                       f"this GPU / cuDNN (tests/gpu/test_flex_gpu.py lists what runs): "
                       f"{result.message}")
        return why

    def attention(self, config: AttnConfig, inputs: AttnInputs) -> jax.Array:
        return attention_with_lse(config, inputs, need_lse=False)[0]

    def details(self, config: AttnConfig) -> str:
        """For explain(): a lowered score_mod's programs, its query chunks (causal, or a
        mask_mod that hides blocks), and the execution plan each graph runs and how it
        was picked."""
        parts = flex_chunks(config)
        lines = [cudnn_flex.describe(config)] if cudnn_flex.is_flex(config) else []
        lines += [_chunking(config).describe(config, parts)] if parts else []
        if config.is_fp8:
            from . import cudnn_fp8  # noqa: PLC0415 - it imports this module
            lines.append(cudnn_fp8.backward_split(config)[1])
        if cudnn_probe.assumed() is None:
            lines += [probe(ch.config).describe() for ch in parts[:1]] or [probe(config).describe()]
        return "\n".join(filter(None, lines))


BACKEND = _CudnnBackend()


# ---- the per-device kernels (native_call partitions and differentiates them) ---------------
@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything static about one call of the FFI handlers."""
    config: AttnConfig
    key: str
    workspace: Tuple[int, int, int]
    # FFI target per graph (inference forward, training forward, backward).
    targets: Tuple[str, str, str] = (TARGET_FWD, TARGET_FWD, TARGET_BWD)


def host_copies(config: AttnConfig, found: Probe) -> Tuple[bool, bool, bool]:
    """Per graph: does its execute copy from host memory? The probe's answer, and
    always for cuDNN's ALiBi (whose slopes are copied), so an assumed probe errs safe."""
    alibi = cudnn_flex.uses_cudnn_alibi(config)
    return tuple(bool(c) or alibi for c in found.host_copies)


def static_call(config: AttnConfig) -> _Static:
    """The graphs of `config` (built, or found in the cache) and the targets to call."""
    why = BACKEND.supports(config)
    if why is not None:
        raise ValueError(f"cudnn backend cannot run {config.short()}: {why}")
    found = probe(config)
    _register()
    if config.is_fp8:
        targets = (TARGET_FP8_FWD, TARGET_FP8_FWD, TARGET_FP8_BWD)
    else:
        targets = tuple(
            (TARGET_BWD_NOCMDBUF if copy else TARGET_BWD) if graph == "backward"
            else (TARGET_FWD_NOCMDBUF if copy else TARGET_FWD)
            for graph, copy in zip(GRAPHS, host_copies(config, found)))
    return _Static(config, graph_key(config), found.workspace, targets)


def _operands(config: AttnConfig, inputs: AttnInputs):
    """(q, k, v, bias, sink): raw buffers (packing handled by strides), bias in q's
    dtype, the sink logits as fp32 [h_q]."""
    dtype = inputs.q.dtype
    bias = None if inputs.bias is None else inputs.bias.astype(dtype)
    sink = None
    if config.softmax == "learnable":
        sink = inputs.softmax_offset.astype(jnp.float32).reshape(config.h_q)
    elif config.softmax == "off_by_one":
        sink = jnp.zeros((config.h_q,), jnp.float32)
    return inputs.q, inputs.k, inputs.v, bias, sink


def forward(config: AttnConfig, inputs: AttnInputs, training: bool):
    """(out, fp32 lse [b, h_q, s_q] when training); ``inputs.rng`` is raw bits. The LSE
    is the score_mod's own: query-only terms a lowered program leaves out (`flex_hoist`)
    are added back, so LSEs of calls with other offsets (context-parallel blocks) merge."""
    out, stats = _forward_call(static_call(config), _operands(config, inputs),
                               aux_arrays(config, inputs), training, _flex_inputs(config, inputs))
    if stats is None:
        return out, None
    return out, _row_shifted(config, inputs, lse_from_stats(config, stats), 1.0)


def backward(config: AttnConfig, inputs: AttnInputs, out, lse, d_out) -> AttnInputs:
    """Gradients of q, k, v (as packed as the inputs), bias and softmax_offset."""
    lse = _row_shifted(config, inputs, lse, -1.0)  # the program's own, as cuDNN recomputes
    stats = jnp.swapaxes(lse, 1, 2) if config.is_packed else lse
    d_q, d_k, d_v, d_bias, d_sink = _backward_call(
        static_call(config), _operands(config, inputs), aux_arrays(config, inputs), out, stats, d_out,
        _flex_inputs(config, inputs))
    if d_bias is not None:
        d_bias = d_bias.astype(inputs.bias.dtype)
    d_offset = None
    if config.softmax == "learnable":
        d_offset = d_sink.reshape(inputs.softmax_offset.shape).astype(inputs.softmax_offset.dtype)
    return AttnInputs(q=d_q, k=d_k, v=d_v, bias=d_bias, softmax_offset=d_offset)


def attention_with_lse(config: AttnConfig, inputs: AttnInputs, *, need_lse: bool = True):
    """(out, lse): out in the config's layout and q's dtype, lse fp32 ``[b, h_q, s_q]``
    (None unless `need_lse`). Differentiable in q, k, v, bias and softmax_offset, and
    partitioned over batch and head splits (`native_call`)."""
    why = BACKEND.supports(config)
    if why is not None:
        raise ValueError(f"cudnn backend cannot run {config.short()}: {why}")
    if not cudnn_flex.is_flex(config):
        return native_call.attention("cudnn", config, inputs, need_lse=need_lse)
    parts = flex_chunks(config)

    def call(c: AttnConfig, ci: AttnInputs):
        return native_call.attention("cudnn", c, ci, need_lse=need_lse)

    def native(i):
        return _chunking(config).attention(config, i, parts, call) if parts else call(config, i)
    if cudnn_flex.float_args(config):
        out, lse = cudnn_flex.with_arg_gradients(native, config, inputs)
    else:
        out, lse = native(inputs)
    return cudnn_flex.zero_padded_rows(config, inputs, out, lse)


def _chunking(config: AttnConfig):
    """The module whose chunks `flex_chunks` gives (a mask_mod's are never causal)."""
    return causal_chunks if config.causal else mask_chunks


def flex_chunks(config: AttnConfig) -> Tuple[causal_chunks.Chunk, ...]:
    """The query chunks a lowered score_mod runs in: causal (`fusedattn.causal_chunks`)
    or a mask_mod's blocks (`fusedattn.mask_chunks`); none unless chunking is on and
    cuDNN runs every chunk's config."""
    if not cudnn_flex.is_flex(config):
        return ()
    n = causal_chunks.count(config)
    if causal_chunks.reason(config, n) is None:
        parts = causal_chunks.chunks(config, n)
    elif mask_chunks.reason(config) is None:
        parts = mask_chunks.chunks(config)
    else:
        return ()
    if any(BACKEND.supports(ch.config) is not None for ch in parts):
        return ()
    return parts


def _row_shifted(config: AttnConfig, inputs: AttnInputs, lse, sign: float):
    if not cudnn_flex.is_flex(config):
        return lse
    shift = cudnn_flex.row_shift(config, inputs, lse.shape)
    return lse if shift is None else lse + sign * shift


def _flex_inputs(config: AttnConfig, inputs: AttnInputs) -> Tuple[jax.Array, ...]:
    """A lowered score_mod's static inputs (after the sink, as the handlers bind them)."""
    return cudnn_flex.static_inputs(config, inputs) if cudnn_flex.is_flex(config) else ()


def aux_arrays(config: AttnConfig, inputs: AttnInputs) -> Tuple[jax.Array, ...]:
    """Sequence lengths, ragged offsets and dropout seed/offset, in the handlers' order."""
    aux = []
    seq = inputs.sequence
    if config.is_padded and not cudnn_flex.is_flex(config):  # else the programs hold them
        aux += [jnp.clip(seq.q_lengths, 0, config.s_q).astype(jnp.int32).reshape(-1),
                jnp.clip(seq.kv_lengths, 0, config.s_kv).astype(jnp.int32).reshape(-1)]
    elif config.is_packed:
        aux += _packed_arrays(config, seq)
    if config.has_dropout:
        # 64-bit Philox seed and offset, each as two uint32 words (no x64 needed), from
        # the raw bits native_call draws from the key.
        bits = inputs.rng
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


def out_shape(config: AttnConfig):
    if config.layout == "sbhd":
        return (config.s_q, config.batch, config.h_q, config.d_v)
    return (config.batch, config.s_q, config.h_q, config.d_v)


def stats_shape(config: AttnConfig):
    """cuDNN's statistics buffer: [b, h, s_q], or token-major [b, s_q, h] when packed
    (the layout cudnn-frontend sizes its THD backward workspace for)."""
    if config.is_packed:
        return (config.batch, config.s_q, config.h_q)
    return (config.batch, config.h_q, config.s_q)


def lse_from_stats(config: AttnConfig, stats):
    """The contract's fp32 LSE [b, h_q, s_q] from cuDNN's statistics buffer."""
    return jnp.swapaxes(stats, 1, 2) if config.is_packed else stats


def workspace_shape(nbytes: int):
    """The workspace output: the probe's size, cudnn-frontend's get_workspace_size,
    which counts the frontend's own part too (ALiBi slopes, copied to its start on
    every execute; cuDNN's plan uses what follows)."""
    return jax.ShapeDtypeStruct((max(int(nbytes), 1),), jnp.uint8)


def _forward_call(static: _Static, diff, aux, training: bool, flex=()):
    cfg = static.config
    q, k, v, bias, sink = diff
    args = [x for x in (q, k, v) if x is not None]
    args += [bias] if bias is not None else []
    args += list(aux)
    args += [sink] if sink is not None else []
    args += list(flex)
    results = [jax.ShapeDtypeStruct(out_shape(cfg), q.dtype)]
    if training:
        results.append(jax.ShapeDtypeStruct(stats_shape(cfg), jnp.float32))
    results.append(workspace_shape(static.workspace[1 if training else 0]))
    target = static.targets[1 if training else 0]
    outs = jax.ffi.ffi_call(target, tuple(results), vmap_method="sequential")(
        *args, key=static.key, training=np.int64(training))
    return outs[0], (outs[1] if training else None)


def _backward_call(static: _Static, diff, aux, o, lse, d_o, flex=()):
    cfg = static.config
    q, k, v, bias, sink = diff
    buffers = [x for x in (q, k, v) if x is not None]
    args = buffers + [o, d_o.astype(o.dtype), lse]
    args += [bias] if bias is not None else []
    args += list(aux)
    args += [sink] if sink is not None else []
    args += list(flex)
    results = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in buffers]
    if bias is not None:
        results.append(jax.ShapeDtypeStruct(bias.shape, bias.dtype))
    if cfg.softmax == "learnable":
        results.append(jax.ShapeDtypeStruct((cfg.h_q,), jnp.float32))
    results.append(workspace_shape(static.workspace[2]))
    outs = list(jax.ffi.ffi_call(static.targets[2], tuple(results), vmap_method="sequential")(
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
        native.ensure_targets(TARGETS, "cuda")
