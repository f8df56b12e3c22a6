"""The cuDNN backend: our own cuDNN fused attention (BF16/FP16; FP8 kernels in
`fp8`) through XLA FFI.

The C++ side (csrc/cuda/cudnn_*.{h,cc}; cudnn_graph.h maps the files) builds
cudnn-frontend graphs (inference forward, training forward, backward) for a
config *key* and caches them per device and cuDNN version. `supports` asks it to build them, so the
reason for an unsupported config is cudnn-frontend's own message, and the
workspace sizes the FFI calls need are known at trace time. The arrays go in
as the user laid them out: bshd / sbhd and packed qkv / kv through strides,
packed (THD) rows through ragged offsets computed here with JAX, so nothing
in lowering needs a GPU (see `assume_supported` for lowering on a CPU host).
The per-device `forward` / `backward` below are differentiated and partitioned
by `native_op`: under a batch / head split each device builds and runs the
graphs of its own shard's config.

score_mods: every JAX score_mod / mask_mod, the built-in ALiBi and softcap of
`fusedattn.score_mods` included, is lowered to pointwise graph operations by
`flex` (with the config's masks composed in), or refused with the reason. The
lowered ALiBi and softcap were measured at least as fast as cuDNN's dedicated forms
(docs/decisions.md) and take masks and windows those refused. ALiBi keeps cuDNN's own form where a program
cannot run and that form can (padding lengths, packed sequences, bias:
`flex.uses_cudnn_alibi`).

The probe (`graphs`) persists plans across processes (`fusedattn.plan_cache`)
and bounds the in-process graph cache (`set_graph_cache_size`).

Graphs with cuDNN's ALiBi copy their slopes from host memory into the workspace on
every execute; they run through FFI targets that do not declare XLA's
command-buffer trait (csrc/cuda/cudnn_ffi.cc explains why), chosen from
the probe's `host_copies`.
"""
from __future__ import annotations

from typing import Optional, Tuple

import jax

from ...config import AttnConfig
from ...inputs import AttnInputs
from .. import native_op
from . import causal_chunks, flex, fp8, graphs, kernels, mask_chunks, support
from .graphs import GRAPHS, Probe  # noqa: F401 - the backend's public surface
from .support import (TARGET_BWD, TARGET_BWD_NOCMDBUF, TARGET_FWD, TARGET_FWD_NOCMDBUF,  # noqa: F401
                      config_reason, graph_key, probe, version_reason)

# The probe's switches, as the cudnn backend's public surface.
assume_supported = graphs.assume_supported
set_graph_cache_size = graphs.set_graph_cache_size
graph_cache_stats = graphs.graph_cache_stats
set_autotune = graphs.set_autotune


class CudnnBackend:
    name = "cudnn"
    platforms = ("cuda",)
    fp8 = True  # FP8 kernels in fp8.py

    def supports(self, config: AttnConfig) -> Optional[str]:
        return support.supports(config)

    def attention(self, config: AttnConfig, inputs: AttnInputs) -> jax.Array:
        return attention_with_lse(config, inputs, need_lse=False)[0]

    def details(self, config: AttnConfig) -> str:
        """For explain(): a lowered score_mod's programs, its query chunks (causal, or a
        mask_mod that hides blocks), and the execution plan each graph runs and how it
        was picked."""
        parts = flex_chunks(config)
        lines = [flex.describe(config)] if flex.is_flex(config) else []
        lines += [_chunking(config).describe(config, parts)] if parts else []
        if config.is_fp8:
            lines.append(fp8.backward_split(config)[1])
        if graphs.assumed() is None:
            lines += [probe(support.graphs_config(c)).describe() for c in
                      [ch.config for ch in parts[:1]] or [config]]
        return "\n".join(filter(None, lines))


BACKEND = CudnnBackend()
native_op.register("cudnn", native_op.Kernels(kernels.forward, kernels.backward, flex.per_entry),
                   native_op.Kernels(fp8.fp8_forward, fp8.fp8_backward))


def attention_with_lse(config: AttnConfig, inputs: AttnInputs, *, need_lse: bool = True):
    """(out, lse): out in the config's layout and q's dtype, lse fp32 ``[b, h_q, s_q]``
    (None unless `need_lse`). Differentiable in q, k, v, bias and softmax_offset, and
    partitioned over batch and head splits (`native_op`)."""
    why = support.supports(config)
    if why is not None:
        raise ValueError(f"cudnn backend cannot run {config.short()}: {why}")
    if not flex.is_flex(config):
        return native_op.attention("cudnn", config, inputs, need_lse=need_lse)
    parts = flex_chunks(config)

    def call(c: AttnConfig, ci: AttnInputs):
        return native_op.attention("cudnn", c, ci, need_lse=need_lse)

    def native(i):
        return _chunking(config).attention(config, i, parts, call) if parts else call(config, i)
    if flex.float_args(config):
        out, lse = flex.with_arg_gradients(native, config, inputs)
    else:
        out, lse = native(inputs)
    return flex.zero_padded_rows(config, inputs, out, lse)


def _chunking(config: AttnConfig):
    """The module whose chunks `flex_chunks` gives (a mask_mod's are never causal)."""
    return causal_chunks if config.causal else mask_chunks


def flex_chunks(config: AttnConfig) -> Tuple[causal_chunks.Chunk, ...]:
    """The query chunks a lowered score_mod runs in: causal (`causal_chunks`)
    or a mask_mod's blocks (`mask_chunks`); none unless chunking is on and
    cuDNN runs every chunk's config."""
    if not flex.is_flex(config):
        return ()
    n = causal_chunks.count(config)
    if causal_chunks.reason(config, n) is None:
        parts = causal_chunks.chunks(config, n)
    elif mask_chunks.reason(config) is None:
        parts = mask_chunks.chunks(config)
    else:
        return ()
    if any(support.supports(ch.config) is not None for ch in parts):
        return ()
    return parts
