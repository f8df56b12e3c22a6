"""The XLA backend: every feature of `AttnConfig` in plain JAX, on any platform.

It is the ground truth for the native backends and the fallback everywhere.
Memory stays O(tile) beyond inputs and outputs (see `tiles`), so long
sequences run without an s_q x s_kv score matrix; short ones run as a single
tile with no loop.

Gradients flow to q, k, v, bias (summed over its broadcast dimensions),
softmax_offset, and to floating-point score_mod arguments (summed over tiles);
integer score_mod arguments, sequence descriptors and the dropout key get none.

score_mod is called once per tile as
``score_mod(score, batch, head, q_idx, kv_idx, *score_mod_args)`` with ``score``
the fp32 ``[b, h_q, bq, bk]`` tile of scaled (and biased) logits, ``batch``
``[b, 1, 1, 1]``, ``head`` ``[1, h_q, 1, 1]``, ``q_idx`` ``[b|1, 1, bq, 1]`` and
``kv_idx`` ``[b|1, 1, 1, bk]`` int32 (positions inside the sequence/segment).
It must be elementwise in those arguments; its backward is JAX's derivative of it.
"""
from __future__ import annotations

from typing import Optional

import jax

from ... import fp8_scaling
from ...config import DTYPES, LAYOUTS, MASKS, QKV_PACKINGS, SEQUENCE_KINDS, SOFTMAX_TYPES, AttnConfig
from ...inputs import AttnInputs
from .. import native_op
from . import fp8
from .attention import attention, attention_with_lse, backward, forward  # noqa: F401
from .masks import dropout_keep_mask


class XlaBackend:
    name = "xla"
    platforms = ("cpu", "cuda", "rocm")
    fp8 = True  # the emulation in fp8.py

    def supports(self, config: AttnConfig) -> Optional[str]:
        """Everything `AttnConfig` describes; a reason only for values it does not know."""
        for field, allowed in (("mask", MASKS), ("softmax", SOFTMAX_TYPES), ("layout", LAYOUTS),
                               ("qkv_packing", QKV_PACKINGS), ("sequence", SEQUENCE_KINDS),
                               ("dtype", DTYPES)):
            value = getattr(config, field)
            if value not in allowed:
                return f"{field}={value!r} is not one of {allowed}"
        if config.sequence == "ragged":
            return ("ragged (packed small-seq) keys are read by the small_seq kernels only; "
                    "fused_attn_small_seq gives other backends a padded view")
        if config.h_q % config.h_kv:
            return f"h_q={config.h_q} is not a multiple of h_kv={config.h_kv}"
        if config.is_fp8:
            return fp8_scaling.config_reason(config)
        return None

    def attention(self, config: AttnConfig, inputs: AttnInputs) -> jax.Array:
        return attention(config, inputs)

    dropout_keep_mask = staticmethod(dropout_keep_mask)


BACKEND = XlaBackend()
# FP8 calls go through native_op (partitioned like the native kernels); plain ones do not.
native_op.register("xla", native_op.Kernels(forward, backward),
                  native_op.Kernels(fp8.fp8_forward, fp8.fp8_backward))
