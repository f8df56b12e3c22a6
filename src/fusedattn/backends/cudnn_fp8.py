"""FP8 attention on cuDNN: the per-device FP8 kernels of `fusedattn.fp8`.

The graphs (csrc/cuda/cudnn_fp8_graph.cc) are cudnn-frontend's sdpa_fp8 and
sdpa_fp8_backward; the config key is the BF16 backend's with ``fp8=1`` and the
d_out / gradient formats, so the support probe, graph cache and workspace
handling are `backends.cudnn`'s. Scales travel as one fp32 ``[13, 4]`` device
array (scalar i in row i: 16-byte aligned pointers for cuDNN), amaxes come back
the same way (csrc/cuda/cudnn_graph.h, kFp8Scales and the amax orders).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .. import fp8
from ..config import AttnConfig
from . import cudnn
from .base import AttnInputs

_SLOT = 4  # floats per scalar row (kFp8SlotFloats)
_FORMATS = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}


def scale_rows(s: fp8.Fp8Scales) -> jax.Array:
    """The kernels' scalar buffer, in kFp8Scales order (descales are 1 / scale)."""
    values = [1 / s.q, 1 / s.k, 1 / s.v, 1 / s.s, s.s, s.o, 1 / s.o, 1 / s.do, 1 / s.dp,
              s.dq, s.dk, s.dv, s.dp]
    column = jnp.stack([jnp.asarray(x, jnp.float32).reshape(()) for x in values])
    return jnp.broadcast_to(column[:, None], (len(values), _SLOT))


def _amaxes(rows, n: int):
    return tuple(rows[i, 0] for i in range(n))


def fp8_forward(config: AttnConfig, q8, k8, v8, sequence, scales: fp8.Fp8Scales,
                training: bool):
    """(o8 E4M3, fp32 lse [b, h_q, s_q] or None, amax of S, amax of o)."""
    static = cudnn.static_call(config)
    aux = cudnn.aux_arrays(config, AttnInputs(q8, k8, v8, sequence=sequence))
    results = [jax.ShapeDtypeStruct(cudnn.out_shape(config), jnp.float8_e4m3fn)]
    if training:
        results.append(jax.ShapeDtypeStruct(cudnn.stats_shape(config), jnp.float32))
    results += [jax.ShapeDtypeStruct((2, _SLOT), jnp.float32),
                cudnn.workspace_shape(static.workspace[1 if training else 0])]
    outs = jax.ffi.ffi_call(static.targets[1 if training else 0], tuple(results),
                            vmap_method="sequential")(
        q8, k8, v8, *aux, scale_rows(scales), key=static.key, training=np.int64(training))
    o8 = outs[0]
    lse = cudnn.lse_from_stats(config, outs[1]) if training else None
    return (o8, lse) + _amaxes(outs[-2], 2)


def fp8_backward(config: AttnConfig, q8, k8, v8, o8, do8, lse, sequence,
                 scales: fp8.Fp8Scales):
    """(dq8, dk8, dv8 in config.fp8_grad, (amax dq, dk, dv, dP))."""
    static = cudnn.static_call(config)
    aux = cudnn.aux_arrays(config, AttnInputs(q8, k8, v8, sequence=sequence))
    grad = _FORMATS[config.fp8_grad]
    results = [jax.ShapeDtypeStruct(x.shape, grad) for x in (q8, k8, v8)]
    results += [jax.ShapeDtypeStruct((4, _SLOT), jnp.float32),
                cudnn.workspace_shape(static.workspace[2])]
    outs = jax.ffi.ffi_call(static.targets[2], tuple(results), vmap_method="sequential")(
        q8, k8, v8, o8, do8.astype(_FORMATS[config.fp8_do]), lse, *aux, scale_rows(scales),
        key=static.key)
    return outs[0], outs[1], outs[2], _amaxes(outs[3], 4)
