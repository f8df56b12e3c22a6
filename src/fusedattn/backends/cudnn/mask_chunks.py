"""A mask_mod that hides whole blocks (documents, block-diagonal or banded
patterns), in query chunks that skip them.

cuDNN computes every tile of a lowered program, masked or not: a document mask
``q // 1024 == k // 1024`` over 4096 positions costs a full call, of which 3/4 is
thrown away (PyTorch's flex_attention skips those blocks). When the mask_mod reads
the positions alone (not the batch, the head or score_mod_args) it is the same for
every batch row and head, so fusedattn evaluates it once at trace time, over the
whole ``s_q x s_kv`` grid, and runs each chunk of query rows as a call of its own on
the keys ``[first, last]`` that any of its rows sees (`causal_chunks.attention`:
rows are complete per chunk, so outputs and LSEs are concatenated). The chunk count
is the one whose chunks compute the fewest tiles (ties: fewer calls), among chunks
of at least `causal_chunks.MIN_CHUNK_ROWS` rows; a split that saves under a quarter
of the tiles is not worth its calls (`MAX_TILE_FRACTION`). The chunks keep the mask
(shifted to their positions), so pairs inside a chunk's range stay exact; a chunk
that sees every pair of its rectangle runs without it, and equal diagonal blocks
(documents of one length, no score_mod) run as one call with the documents as its
batch: no mask program and no call per document (small calls run their tiles at a
lower rate: docs/decisions.md).
"""
from __future__ import annotations

import dataclasses
import functools
import os
from typing import Callable, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from . import causal_chunks
from .causal_chunks import Chunk
from ...config import AttnConfig
from ...score_mods import Masked

MAX_SCAN = 1 << 26          # grid points evaluated at trace time (64 Mi booleans)
MAX_TILE_FRACTION = 0.75


def reason(config: AttnConfig) -> Optional[str]:
    """Why `config`'s mask_mod is not run in chunks (None: `chunks` gives them)."""
    if not isinstance(config.score_mod, Masked):
        return "no mask_mod"
    if config.causal or config.window_bounds() != (-1, -1):
        return "a causal mask or window: the causal chunks apply"
    if os.environ.get(causal_chunks.ENV_CHUNKS) == "1":
        return f"{causal_chunks.ENV_CHUNKS}=1"
    if config.s_q * config.s_kv > MAX_SCAN:
        return f"s_q x s_kv over {MAX_SCAN} positions to scan at trace time"
    why = causal_chunks.call_reason(config)
    if why is None and _visibility(config) is None:
        why = "the mask_mod reads the batch, the head or score_mod_args"
    return why or (None if chunks(config) else
                   f"no split into chunks of >= {causal_chunks.MIN_CHUNK_ROWS} rows computes "
                   f"under {MAX_TILE_FRACTION:.0%} of the tiles")


def chunks(config: AttnConfig) -> Tuple[Chunk, ...]:
    """The chunks of `config` (for which `reason(config)` is None)."""
    return _best(config, causal_chunks.MIN_CHUNK_ROWS)


def describe(config: AttnConfig, parts: Tuple[Chunk, ...]) -> str:
    how = ("one call of the equal diagonal blocks as a batch, unmasked"
           if _diagonal(config, parts) else
           f"{sum(not isinstance(ch.config.score_mod, Masked) for ch in parts)} of them see "
           f"every pair of their keys and run without the mask")
    return (f"mask_mod in {len(parts)} query chunks of {parts[0].config.s_q} rows on the keys "
            f"their rows see: {causal_chunks.tile_fraction(config, parts):.0%} of the tiles; "
            f"{how}")


@functools.lru_cache(maxsize=64)
def _visibility(config: AttnConfig) -> Optional[np.ndarray]:
    """The ``[s_q, s_kv]`` mask (True: visible), or None if it reads more than positions."""
    mask_mod = config.score_mod.mask_mod
    i32 = jnp.int32
    specs = [jax.ShapeDtypeStruct((1, 1, 1, 1), i32)] * 2 + [
        jax.ShapeDtypeStruct((1, 1, config.s_q, 1), i32),
        jax.ShapeDtypeStruct((1, 1, 1, config.s_kv), i32)] + [
        jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in config.score_mod_arg_specs]
    try:
        jaxpr = jax.make_jaxpr(mask_mod)(*specs).jaxpr
    except Exception:  # (the lowering names what does not trace)
        return None
    read = {id(v) for eqn in jaxpr.eqns for v in eqn.invars} | {id(v) for v in jaxpr.outvars}
    if any(id(v) in read for i, v in enumerate(jaxpr.invars) if i not in (2, 3)):
        return None
    with jax.ensure_compile_time_eval():
        keep = mask_mod(*(jnp.zeros(s.shape, s.dtype) for s in specs[:2]),
                        jnp.arange(config.s_q, dtype=i32).reshape(specs[2].shape),
                        jnp.arange(config.s_kv, dtype=i32).reshape(specs[3].shape),
                        *(jnp.zeros(s.shape, s.dtype) for s in specs[4:]))
        return np.broadcast_to(np.asarray(keep, bool), (1, 1, config.s_q, config.s_kv))[0, 0]


@functools.lru_cache(maxsize=64)
def _best(config: AttnConfig, min_rows: int) -> Tuple[Chunk, ...]:
    keep = _visibility(config)
    best, best_fraction = (), MAX_TILE_FRACTION
    for n in range(2, config.s_q // min_rows + 1):
        if config.s_q % n:
            continue
        parts = _split(config, keep, n)
        fraction = causal_chunks.tile_fraction(config, parts) if parts else 1.0
        if fraction < best_fraction - 1e-9:
            best, best_fraction = parts, fraction
    return best


def _split(config: AttnConfig, keep: np.ndarray, n: int) -> Tuple[Chunk, ...]:
    """n chunks of rows on the keys they see; () if a chunk sees none (its rows are
    fully masked: one call gives them their zeros). A chunk that sees every pair of
    its rectangle (a document) drops the mask: a plain call, or the score_mod alone."""
    c = config.s_q // n
    out = []
    for i in range(n):
        q0, q1 = i * c, (i + 1) * c
        seen = np.flatnonzero(keep[q0:q1].any(axis=0))
        if seen.size == 0:
            return ()
        kv0, kv1 = int(seen[0]), int(seen[-1]) + 1
        mod = config.score_mod.score_mod if keep[q0:q1, kv0:kv1].all() else config.score_mod
        chunk_config = dataclasses.replace(
            config, s_q=c, s_kv=kv1 - kv0,
            score_mod=None if mod is None else causal_chunks.shifted(mod, q0, kv0),
            score_mod_arg_specs=config.score_mod_arg_specs if mod is not None else ())
        out.append(Chunk(chunk_config, (q0, q1), (kv0, kv1)))
    return tuple(out)


def _diagonal(config: AttnConfig, parts: Tuple[Chunk, ...]) -> Optional[AttnConfig]:
    """The one call of all chunks, batched, when they are equal plain diagonal blocks
    (documents of one length, no score_mod): ``[b, n*c, ...]`` is ``[b*n, c, ...]``
    in bshd without a copy. None otherwise."""
    c = parts[0].config.s_q
    if config.layout != "bshd" or config.s_kv != config.s_q or any(
            ch.config.score_mod is not None or ch.q_rows != ch.kv_rows or
            ch.q_rows[1] - ch.q_rows[0] != c for ch in parts):
        return None
    return dataclasses.replace(parts[0].config, batch=config.batch * len(parts), s_kv=c)


def attention(config: AttnConfig, inputs, parts: Tuple[Chunk, ...], run: Callable):
    """(out, lse) of the whole call from `run(config, inputs) -> (out, lse)` on the
    chunks (`causal_chunks.attention`), or on one batched call of equal diagonal
    blocks."""
    merged = _diagonal(config, parts)
    if merged is None:
        def run_chunk(c: AttnConfig, i):
            return run(c, i if c.score_mod is not None else i._replace(score_mod_args=()))
        return causal_chunks.attention(config, inputs, parts, run_chunk)
    n, b, s = len(parts), config.batch, config.s_q

    def blocks(x):  # [b, n*c, h, d] -> [b*n, c, h, d]
        return x.reshape(b * n, s // n, *x.shape[2:])
    out, lse = run(merged, inputs._replace(q=blocks(inputs.q), k=blocks(inputs.k),
                                           v=blocks(inputs.v), score_mod_args=()))
    out = out.reshape(b, s, *out.shape[2:])
    if lse is not None:  # [b*n, h, c] -> [b, h, n*c]
        lse = lse.reshape(b, n, lse.shape[1], -1).transpose(0, 2, 1, 3).reshape(b, -1, s)
    return out, lse
