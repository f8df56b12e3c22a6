"""score_mods and mask_mods shared by the CPU tests (lowering, the NumPy interpreter,
the XLA backend) and the GPU tests (cuDNN against the float64 oracle).

Each entry: name -> (score_mod or None, mask_mod or None, args(h_q, b, s) -> tuple,
reason fragment if cuDNN cannot express it, else None).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fusedattn import score_mods

from support import flex_interpreter


def _slopes(h, b, s):
    return (jnp.asarray(score_mods.alibi_slopes(h)),)


def _head_scale(h, b, s):
    return (jnp.linspace(0.5, 1.5, h, dtype=jnp.float32),)


def _head_ints(h, b, s):
    return (jnp.arange(1, h + 1, dtype=jnp.int32),)


def _batch_scale(h, b, s):
    return (jnp.linspace(0.5, 1.5, b, dtype=jnp.float32),)


def _buckets(h, b, s):
    return (jnp.linspace(-1.0, 1.0, 8 * h, dtype=jnp.float32).reshape(h, 8),)


def _segments(h, b, s):
    ids = np.repeat(np.arange(4), -(-s // 4))[:s]
    return (jnp.asarray(np.tile(ids, (b, 1)), jnp.int32),)


def _none(h, b, s):
    return ()


def _t5_bucket(s, b, h, q, k, table):
    bucket = jnp.minimum(jnp.log1p(jnp.abs(q - k).astype(jnp.float32)).astype(jnp.int32), 7)
    return s + table[h, bucket]


MODS = {
    # score_mods
    "relative_position": (lambda s, b, h, q, k: s + 0.05 * (q - k), None, _none, None),
    "softcap_scaled": (lambda s, b, h, q, k: 30.0 * jnp.tanh(0.8 * s / 30.0), None, _none, None),
    "alibi_lambda": (lambda s, b, h, q, k, sl: s + sl[h] * (k - q), None, _slopes, None),
    "per_head_scale": (lambda s, b, h, q, k, w: s * w[h], None, _head_scale, None),
    "sigmoid_gate": (lambda s, b, h, q, k: s * jax.nn.sigmoid(s), None, _none, None),
    "log_distance": (lambda s, b, h, q, k: s - 0.3 * jnp.log1p(jnp.abs(q - k).astype(jnp.float32)),
                     None, _none, None),
    "quadratic_distance": (lambda s, b, h, q, k: s - 1e-3 * (q - k) ** 2, None, _none, None),
    "clip": (lambda s, b, h, q, k: jnp.clip(s, -2.0, 2.0), None, _none, None),
    # floor division of a signed distance: the fp32 quotient's floor
    "bucketed_distance": (lambda s, b, h, q, k: s - 0.1 * ((q - k) // 16), None, _none, None),
    # a mask written inside the score_mod itself, not as a mask_mod
    "masked_inside": (lambda s, b, h, q, k: jnp.where(k <= q, s + 0.05 * (q - k), -jnp.inf),
                      None, _none, None),
    # (a per-batch *shift* has a zero gradient: softmax ignores it; a scale does not)
    "per_batch_scale": (lambda s, b, h, q, k, sc: s * sc[b], None, _batch_scale, None),
    "t5_bucket_table": (_t5_bucket, None, _buckets, "gather"),
    # a function of positions written before the score: cuDNN's dQ / dK went wrong
    # with that operand order (the lowering puts the score first)
    "position_term_first": (lambda s, b, h, q, k, w: jnp.tanh((q // 16).astype(jnp.float32))
                            + w[h] * s, None, _head_scale, None),
    # the same, the score unscaled: its derivative 1 leaves the bprop the gradient alone
    "key_term_first": (lambda s, b, h, q, k: jnp.sin(k.astype(jnp.float32)) + s, None, _none,
                       None),
    # the bprop's product of two per-head values: multiplied in after the gradient (cuDNN's
    # backward crashed, a misaligned address, on the product of the small values)
    # (int values: a float one's gradient here is a sum that cancels, too ill-conditioned
    # for bf16 inputs)
    "gate_times_head_values": (lambda s, b, h, q, k, n: jax.nn.sigmoid(s) * n[h].astype(
        jnp.float32) * jnp.exp(0.25 * n[h].astype(jnp.float32)), None, _head_ints, None),
    # mask_mods
    "causal_mask_mod": (None, lambda b, h, q, k: k <= q, _none, None),
    "prefix_lm": (None, lambda b, h, q, k: (k <= q) | (k < 16), _none, None),
    "window_plus_sink": (None, lambda b, h, q, k: ((k <= q) & (q - k < 24)) | (k < 4), _none, None),
    "strided": (None, lambda b, h, q, k: (q - k) % 3 == 0, _none, None),
    # documents of 64 positions: int32 division of the indices
    "document_blocks": (None, lambda b, h, q, k: q // 64 == k // 64, _none, None),
    "document": (None, lambda b, h, q, k, seg: seg[b, q] == seg[b, k], _segments, "gather"),
    # both
    "relpos_documents": (lambda s, b, h, q, k: s + 0.05 * (q - k),
                         lambda b, h, q, k: q // 64 == k // 64, _none, None),
    "softcap_prefix_lm": (lambda s, b, h, q, k: 20.0 * jnp.tanh(s / 20.0),
                          lambda b, h, q, k: (k <= q) | (k < 8), _none, None),
}
LOWERED = sorted(n for n, m in MODS.items() if m[3] is None)


def program_scores(low, score, q_idx, kv_idx, inputs, args):
    """What a lowered forward program computes, plus the query-only terms it leaves out
    (lowering.hoist; the LSE gets them back): the score_mod's own values, float64."""
    got = flex_interpreter.interpret(low.forward, score, q_idx, kv_idx,
                                     [np.asarray(x) for x in inputs])
    shift = low.row_shift(args, ())
    return got + (0.0 if shift is None else np.asarray(shift, np.float64))
