"""FP8 attention on cuDNN: the per-device FP8 kernels of `fusedattn.fp8`.

The graphs (csrc/cuda/cudnn_fp8_graph.cc) are cudnn-frontend's sdpa_fp8 and
sdpa_fp8_backward; the config key is the BF16 backend's with ``fp8=1`` and the
d_out / gradient formats, so the support probe, graph cache and workspace
handling are `backends.cudnn`'s. Scales travel as one fp32 ``[13, 4]`` device
array (scalar i in row i: 16-byte aligned pointers for cuDNN), amaxes come back
the same way (csrc/cuda/cudnn_graph.h, kFp8Scales and the amax orders).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Tuple

import jax
import jax.numpy as jnp
import numpy as np

from ... import fp8_scaling
from ...config import AttnConfig
from ...sequence import SequenceDescriptor
from . import kernels
from .support import supports
from ...inputs import AttnInputs

_SLOT = 4  # floats per scalar row (kFp8SlotFloats)

# cuDNN's FP8 backward on Hopper skips the tiles a causal mask hides only in calls of
# few (batch, head) pairs (measured: docs/decisions.md, benchmarks/tune/fp8_kernels.py).
# So a causal FP8 backward runs in calls of at most this many pairs (0: one call).
ENV_CAUSAL_PAIRS = "FUSEDATTN_FP8_CAUSAL_BWD_PAIRS"
CAUSAL_BACKWARD_PAIRS = 32
_FORMATS = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}


def scale_rows(s: fp8_scaling.Fp8Scales) -> jax.Array:
    """The kernels' scalar buffer, in kFp8Scales order (descales are 1 / scale)."""
    values = [1 / s.q, 1 / s.k, 1 / s.v, 1 / s.s, s.s, s.o, 1 / s.o, 1 / s.do, 1 / s.dp,
              s.dq, s.dk, s.dv, s.dp]
    column = jnp.stack([jnp.asarray(x, jnp.float32).reshape(()) for x in values])
    return jnp.broadcast_to(column[:, None], (len(values), _SLOT))


def _amaxes(rows, n: int):
    return tuple(rows[i, 0] for i in range(n))


def fp8_forward(config: AttnConfig, q8, k8, v8, sequence, scales: fp8_scaling.Fp8Scales,
                training: bool):
    """(o8 E4M3, fp32 lse [b, h_q, s_q] or None, amax of S, amax of o)."""
    static = kernels.static_call(config)
    aux = kernels.aux_arrays(config, AttnInputs(q8, k8, v8, sequence=sequence))
    results = [jax.ShapeDtypeStruct(kernels.out_shape(config), jnp.float8_e4m3fn)]
    if training:
        results.append(jax.ShapeDtypeStruct(kernels.stats_shape(config), jnp.float32))
    results += [jax.ShapeDtypeStruct((2, _SLOT), jnp.float32),
                kernels.workspace_shape(static.workspace[1 if training else 0])]
    outs = jax.ffi.ffi_call(static.targets[1 if training else 0], tuple(results),
                            vmap_method="sequential")(
        q8, k8, v8, *aux, scale_rows(scales), key=static.key, training=np.int64(training))
    o8 = outs[0]
    lse = kernels.lse_from_stats(config, outs[1]) if training else None
    return (o8, lse) + _amaxes(outs[-2], 2)


def _pair_limit() -> int:
    value = os.environ.get(ENV_CAUSAL_PAIRS, "")
    if not value:
        return CAUSAL_BACKWARD_PAIRS
    if not value.isdigit():
        raise ValueError(f"{ENV_CAUSAL_PAIRS} must be an int >= 0, got {value!r}")
    return int(value)


Group = Tuple[Tuple[int, int], Tuple[int, int]]  # [start, stop) of batch rows, kv heads


def backward_groups(config: AttnConfig) -> Tuple[Group, ...]:
    """The (batch rows, kv heads) of each call `config`'s FP8 backward runs in: one call,
    or for a causal mask calls of at most `CAUSAL_BACKWARD_PAIRS` (batch, query head)
    pairs, whole kv-head groups each (see above)."""
    limit = _pair_limit()
    b, h_q, h_kv, g = config.batch, config.h_q, config.h_kv, config.group_size
    if not config.causal or limit == 0 or b * h_q <= limit:
        return (((0, b), (0, h_kv)),)
    if h_q <= limit:
        rows = limit // h_q
        return tuple(((i, min(i + rows, b)), (0, h_kv)) for i in range(0, b, rows))
    heads = max(1, limit // g)
    return tuple(((i, i + 1), (j, min(j + heads, h_kv)))
                 for i in range(b) for j in range(0, h_kv, heads))


def group_config(config: AttnConfig, group: Group) -> AttnConfig:
    (b0, b1), (k0, k1) = group
    g = config.group_size
    return dataclasses.replace(config, batch=b1 - b0, h_q=(k1 - k0) * g, h_kv=k1 - k0)


def backward_split(config: AttnConfig) -> Tuple[Tuple[Group, ...], str]:
    """The groups `config`'s FP8 backward runs in (`backward_groups`, unless cuDNN
    refuses a group's config: then one call), and what explain() says of them."""
    groups = backward_groups(config)
    if len(groups) == 1:
        return groups, ""
    limit = _pair_limit()
    for group in groups:
        why = supports(group_config(config, group))
        if why is not None:
            return ((((0, config.batch), (0, config.h_kv)),),
                    f"FP8 backward in one call: cuDNN refuses the calls of at most {limit} "
                    f"(batch, head) pairs it would run in ({why})")
    return groups, (f"FP8 backward in {len(groups)} calls of at most {limit} (batch, head) "
                    f"pairs each: cuDNN's FP8 backward skips the tiles a causal mask hides "
                    f"only in calls that small ({ENV_CAUSAL_PAIRS})")


def fp8_backward(config: AttnConfig, q8, k8, v8, o8, do8, lse, sequence,
                 scales: fp8_scaling.Fp8Scales):
    """(dq8, dk8, dv8 in config.fp8_grad, (amax dq, dk, dv, dP)), from one call or, for
    a causal mask, from calls over groups of batch rows / kv heads (`backward_split`)."""
    groups, _ = backward_split(config)
    if len(groups) == 1:
        return _backward_call(config, q8, k8, v8, o8, do8, lse, sequence, scales)
    b_axis = 1 if config.layout == "sbhd" else 0
    g = config.group_size

    def take(x, axis, start, stop):
        return jax.lax.slice_in_dim(x, start, stop, axis=axis)
    rows = {}  # batch range -> [(dq8, dk8, dv8)] of its head groups
    amaxes = []
    for group in groups:
        (b0, b1), (k0, k1) = group

        def part(x, heads):
            return take(take(x, b_axis, b0, b1), 2, heads[0], heads[1])
        q_heads, kv_heads = (k0 * g, k1 * g), (k0, k1)
        seq = sequence
        if config.is_padded:
            seq = SequenceDescriptor.from_lengths(sequence.q_lengths[b0:b1],
                                                  sequence.kv_lengths[b0:b1])
        dq8, dk8, dv8, amax = _backward_call(
            group_config(config, group), part(q8, q_heads), part(k8, kv_heads),
            part(v8, kv_heads), part(o8, q_heads), part(do8, q_heads),
            take(take(lse, 0, b0, b1), 1, *q_heads), seq, scales)
        rows.setdefault((b0, b1), []).append((dq8, dk8, dv8))
        amaxes.append(jnp.stack(amax))
    grads = [jnp.concatenate([jnp.concatenate([parts[i] for parts in row], axis=2)
                              for row in rows.values()], axis=b_axis) for i in range(3)]
    return (*grads, tuple(jnp.max(jnp.stack(amaxes), axis=0)))


def _backward_call(config: AttnConfig, q8, k8, v8, o8, do8, lse, sequence,
                   scales: fp8_scaling.Fp8Scales):
    static = kernels.static_call(config)
    aux = kernels.aux_arrays(config, AttnInputs(q8, k8, v8, sequence=sequence))
    grad = _FORMATS[config.fp8_grad]
    results = [jax.ShapeDtypeStruct(x.shape, grad) for x in (q8, k8, v8)]
    results += [jax.ShapeDtypeStruct((4, _SLOT), jnp.float32),
                kernels.workspace_shape(static.workspace[2])]
    outs = jax.ffi.ffi_call(static.targets[2], tuple(results), vmap_method="sequential")(
        q8, k8, v8, o8, do8.astype(_FORMATS[config.fp8_do]), lse, *aux, scale_rows(scales),
        key=static.key)
    return outs[0], outs[1], outs[2], _amaxes(outs[3], 4)
