"""The causal FP8 backward in key chunks, for FP8 kernels whose backward computes every
tile a causal mask hides.

cuDNN 9.19's FP8 backward on Hopper does: on H100 (b4 s4096 h16 d128,
benchmarks/tune/fp8_layouts.py, 2026-11-24) it took 2.13 ms with a causal mask and
2.09 ms without, where its BF16 backward took 1.53 / 2.54 ms. Its FP8 forward does
skip them (0.36 / 0.60 ms), so only the backward is split.

In n key chunks of c = s / n keys, chunk j's keys ``[jc, (j+1)c)`` are seen only by
the queries ``[jc, s)``. Counted from jc on both sides, the call's causal mask is
again a top-left causal mask, now with s_q = (n - j) c >= s_kv = c: each chunk is
one FP8 backward of its own shapes, fed the rows' saved o, d_out and LSE (complete
rows, so the softmax of the whole call). A chunk's dk and dv are complete; its dq
covers the rows ``[jc, s)``, and the chunks' dq add up in fp32 from their
dequantized values. The chunks compute (n + 1) / (2n) of the tiles, in n calls.
"""
from __future__ import annotations

import dataclasses
import importlib
import os
from typing import Callable, Optional, Tuple

import jax
import jax.numpy as jnp

from .config import AttnConfig

ENV_CHUNKS = "FUSEDATTN_FP8_CAUSAL_CHUNKS"
MIN_CHUNK_KEYS = 512  # the default split keeps chunks at least this long
DEFAULT_CHUNKS = 4


def computes_hidden_tiles(backend: str) -> bool:
    """Whether `backend`'s FP8 backward computes the tiles a causal mask hides (its
    `<backend>_fp8` module says so, from measurement)."""
    module = importlib.import_module(f"fusedattn.backends.{backend}_fp8")
    return getattr(module, "CAUSAL_BACKWARD_COMPUTES_HIDDEN_TILES", False)


def count(config: AttnConfig, backend: str) -> int:
    """How many key chunks the FP8 backward of `config` runs in on `backend` (1: one call)."""
    value = os.environ.get(ENV_CHUNKS, "")
    if value:
        try:
            n = int(value)
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"{ENV_CHUNKS} must be an int >= 1, got {value!r}")
        return n
    if not (config.is_fp8 and config.causal and computes_hidden_tiles(backend)):
        return 1
    n = DEFAULT_CHUNKS
    while n > 1 and (config.s_kv % n or config.s_kv // n < MIN_CHUNK_KEYS):
        n //= 2
    return n


def plan(config: AttnConfig, backend: str) -> int:
    """The key chunks the FP8 backward of `config` runs in on `backend`: `count`'s, when
    the split applies and `backend` runs every chunk's config, else 1."""
    n = count(config, backend)
    if reason(config, n) is not None:
        return 1
    from .dispatch import load_backend  # noqa: PLC0415 - dispatch imports fp8, which imports this
    chunk_backend = load_backend(backend)
    return n if all(chunk_backend.supports(ch) is None for ch in chunk_configs(config, n)) else 1


def reason(config: AttnConfig, n: int) -> Optional[str]:
    """Why the FP8 backward of `config` does not run in `n` key chunks (None: it can)."""
    checks = (
        (n > 1, "one call"),
        (config.causal, "no causal mask"),
        (config.s_q == config.s_kv, f"s_q={config.s_q} != s_kv={config.s_kv}"),
        (config.window is None, "a window"),
        (config.sequence == "dense", f"{config.sequence} sequences"),
        (config.qkv_packing == "separate", "packed q, k, v"),
        (config.s_kv % max(n, 1) == 0, f"s_kv={config.s_kv} is not a multiple of {n}"),
    )
    for ok, why in checks:
        if not ok:
            return why
    return None


def chunk_configs(config: AttnConfig, n: int) -> Tuple[AttnConfig, ...]:
    """Chunk j's call: queries [jc, s) against keys [jc, (j+1)c), top-left causal."""
    c = config.s_kv // n
    return tuple(dataclasses.replace(config, s_q=(n - j) * c, s_kv=c, mask="causal")
                 for j in range(n))


def backward(run: Callable, config: AttnConfig, n: int, q8, k8, v8, o8, do8, lse, scales):
    """The FP8 backward of a causal `config` in `n` key chunks, from
    ``run(chunk_config, q8, k8, v8, o8, do8, lse, scales) -> (dq8, dk8, dv8, amaxes)``.

    Returns (dq, dk8, dv8, amaxes): dq is the summed gradient in fp32 (real values,
    not quantized), dk8 and dv8 are the chunks' FP8 gradients put together, the
    amaxes (dq, dk, dv, dP) those of these tensors.
    """
    seq_axis = 0 if config.layout == "sbhd" else 1
    c = config.s_kv // n

    def rows(x, start, stop, axis=seq_axis):
        return jax.lax.slice_in_dim(x, start, stop, axis=axis)
    dq, dk8, dv8, amax_dk, amax_dv, amax_dp = None, [], [], [], [], []
    for j, chunk in enumerate(chunk_configs(config, n)):
        first = j * c
        dq8_j, dk8_j, dv8_j, (_, a_dk, a_dv, a_dp) = run(
            chunk, rows(q8, first, config.s_q), rows(k8, first, first + c),
            rows(v8, first, first + c), rows(o8, first, config.s_q),
            rows(do8, first, config.s_q), rows(lse, first, config.s_q, axis=2), scales)
        part = dq8_j.astype(jnp.float32) / scales.dq
        widths = [(0, 0)] * part.ndim
        widths[seq_axis] = (first, 0)
        part = jnp.pad(part, widths)
        dq = part if dq is None else dq + part
        dk8.append(dk8_j)
        dv8.append(dv8_j)
        amax_dk.append(a_dk)
        amax_dv.append(a_dv)
        amax_dp.append(a_dp)
    amaxes = (jnp.max(jnp.abs(dq)), jnp.max(jnp.stack(amax_dk)), jnp.max(jnp.stack(amax_dv)),
              jnp.max(jnp.stack(amax_dp)))
    return (dq, jnp.concatenate(dk8, axis=seq_axis), jnp.concatenate(dv8, axis=seq_axis), amaxes)


def describe(config: AttnConfig, n: int) -> str:
    return (f"FP8 backward in {n} key chunks of {config.s_kv // n} (the FP8 backward computes "
            f"every tile a causal mask hides): {(n + 1) / (2 * n):.0%} of the tiles "
            f"({ENV_CHUNKS})")
