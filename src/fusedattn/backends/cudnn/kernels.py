"""The per-device cuDNN kernels: the FFI calls of the three graphs (inference forward,
training forward, backward), their operands and auxiliary arrays. `native_op`
differentiates and partitions them; under a batch / head split each device builds and
runs the graphs of its own shard's config."""
from __future__ import annotations

import dataclasses
from typing import Tuple

import jax
import jax.numpy as jnp
import numpy as np

from ...config import AttnConfig
from ...inputs import AttnInputs
from . import flex
from .graphs import GRAPHS, Probe
from .support import (TARGET_BWD, TARGET_BWD_NOCMDBUF, TARGET_FP8_BWD, TARGET_FP8_FWD, TARGET_FWD,
                      TARGET_FWD_NOCMDBUF, graph_key, probe, register_targets, supports)


@dataclasses.dataclass(frozen=True)
class Static:
    """Everything static about one call of the FFI handlers."""
    config: AttnConfig
    key: str
    workspace: Tuple[int, int, int]
    # FFI target per graph (inference forward, training forward, backward).
    targets: Tuple[str, str, str] = (TARGET_FWD, TARGET_FWD, TARGET_BWD)


def host_copies(config: AttnConfig, found: Probe) -> Tuple[bool, bool, bool]:
    """Per graph: does its execute copy from host memory? The probe's answer, and
    always for cuDNN's ALiBi (whose slopes are copied), so an assumed probe errs safe."""
    alibi = flex.uses_cudnn_alibi(config)
    return tuple(bool(c) or alibi for c in found.host_copies)


def static_call(config: AttnConfig) -> Static:
    """The graphs of `config` (built, or found in the cache) and the targets to call."""
    why = supports(config)
    if why is not None:
        raise ValueError(f"cudnn backend cannot run {config.short()}: {why}")
    found = probe(config)
    register_targets()
    if config.is_fp8:
        targets = (TARGET_FP8_FWD, TARGET_FP8_FWD, TARGET_FP8_BWD)
    else:
        targets = tuple(
            (TARGET_BWD_NOCMDBUF if copy else TARGET_BWD) if graph == "backward"
            else (TARGET_FWD_NOCMDBUF if copy else TARGET_FWD)
            for graph, copy in zip(GRAPHS, host_copies(config, found)))
    return Static(config, graph_key(config), found.workspace, targets)


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
    return out, row_shifted(config, inputs, lse_from_stats(config, stats), 1.0)


def backward(config: AttnConfig, inputs: AttnInputs, out, lse, d_out) -> AttnInputs:
    """Gradients of q, k, v (as packed as the inputs), bias and softmax_offset."""
    lse = row_shifted(config, inputs, lse, -1.0)  # the program's own, as cuDNN recomputes
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


def row_shifted(config: AttnConfig, inputs: AttnInputs, lse, sign: float):
    if not flex.is_flex(config):
        return lse
    shift = flex.row_shift(config, inputs, lse.shape)
    return lse if shift is None else lse + sign * shift


def _flex_inputs(config: AttnConfig, inputs: AttnInputs) -> Tuple[jax.Array, ...]:
    """A lowered score_mod's static inputs (after the sink, as the handlers bind them)."""
    return flex.static_inputs(config, inputs) if flex.is_flex(config) else ()


def aux_arrays(config: AttnConfig, inputs: AttnInputs) -> Tuple[jax.Array, ...]:
    """Sequence lengths, ragged offsets and dropout seed/offset, in the handlers' order."""
    aux = []
    seq = inputs.sequence
    if config.is_padded and not flex.is_flex(config):  # else the programs hold them
        aux += [jnp.clip(seq.q_lengths, 0, config.s_q).astype(jnp.int32).reshape(-1),
                jnp.clip(seq.kv_lengths, 0, config.s_kv).astype(jnp.int32).reshape(-1)]
    elif config.is_packed:
        aux += packed_arrays(config, seq)
    if config.has_dropout:
        # 64-bit Philox seed and offset, each as two uint32 words (no x64 needed), from
        # the raw bits native_op draws from the key.
        bits = inputs.rng
        aux += [bits[:2], jnp.stack([bits[2], jnp.uint32(0)])]
    return tuple(aux)


def packed_arrays(config: AttnConfig, seq):
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


def _forward_call(static: Static, diff, aux, training: bool, flex=()):
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


def _backward_call(static: Static, diff, aux, o, lse, d_o, flex=()):
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
