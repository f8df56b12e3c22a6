"""What every backend provides.

A backend is an object (each module under `fusedattn.backends` exposes one as
`BACKEND`; `dispatch.registry` lists them) with:

* ``name``: the string users pass as ``backend=``.
* ``platforms``: the JAX platforms it can run on (``"cpu"``, ``"cuda"``, ``"rocm"``).
* ``supports(config) -> None | str``: None when it can run this config, else
  the reason it cannot (shown by ``explain()`` and in errors). Must not run
  kernels on the device data; may build and cache native plans.
* ``attention(config, inputs) -> out``: the output ``[b, s_q, h_q, d_v]`` in the
  config's layout (``[s_q, b, h_q, d_v]`` for sbhd) and q's dtype,
  differentiable (through a custom_vjp) with respect to q, k, v, bias and
  softmax_offset.

Native backends (cudnn, small_seq, ck, flash, block_sparse) also give per-device
kernels to `native_op` (``native_op.register``), which partitions and differentiates
them.
"""
from __future__ import annotations

from typing import Optional, Protocol, Tuple

import jax

from ..config import AttnConfig
from ..inputs import AttnInputs


class Backend(Protocol):
    name: str
    platforms: Tuple[str, ...]

    def supports(self, config: AttnConfig) -> Optional[str]: ...

    def attention(self, config: AttnConfig, inputs: AttnInputs) -> jax.Array: ...
