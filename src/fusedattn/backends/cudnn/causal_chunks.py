"""Causal (and sliding-window) attention with a score_mod, in query chunks that skip
the keys the mask hides: for a cuDNN that computes every tile of a lowered causal
program (cuDNN 9.19 did, until the program took the frontend's own mask form; see
below). In n query chunks of c rows, chunk i's rows only see keys
``[kv_start_i, kv_end_i)``; each chunk is an ordinary call of its own shapes, with:

* the chunk's causal mask in bottom-right alignment, which in the chunk's own
  coordinates is exactly the global mask (top-left or bottom-right, s_kv >= s_q);
* the score_mod (and mask_mod) shifted by the chunk's first query and key position
  (`Offsets`), constants of the chunk's lowered program;
* the call's window, if any, which also trims the chunk's first keys.

Every chunk's output and LSE are complete for its rows, so they are concatenated, not
merged; the key / value gradients of the chunks add up through JAX's autodiff of
the slices. The chunks compute (n + 1) / (2n) of the tiles (5/8 at n = 4), at the
price of n smaller calls and the copies of their key / value prefixes.

Which calls are chunked: none by default. A lowered causal program has the
frontend's own mask form (`lowering.lower`: the select after the score_mod, its
indices generated from the value it masks), and cuDNN 9.19 then skips the hidden
tiles of one call itself, and one call ran faster than chunks (docs/decisions.md,
benchmarks/tune/flex_mask_speed.py). FUSEDATTN_FLEX_CAUSAL_CHUNKS=n still splits a call into n
chunks (for a cuDNN that computes every tile of such a program).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Callable, Optional, Tuple

import jax
import jax.numpy as jnp

from ...config import AttnConfig
from ...score_mods import reindexed

ENV_CHUNKS = "FUSEDATTN_FLEX_CAUSAL_CHUNKS"
MIN_CHUNK_ROWS = 1024  # mask_chunks' smallest chunk (smaller grids run slower)


@dataclasses.dataclass(frozen=True)
class Offsets:
    """Indices of a chunk whose first query / key are these positions of the call."""
    q_offset: int
    kv_offset: int
    n_extra = 0  # constants of the chunk's program, no extra arguments (score_mods.Reindexed)

    def __call__(self, batch, head, q_idx, kv_idx):
        return batch, head, q_idx + self.q_offset, kv_idx + self.kv_offset

    def __str__(self) -> str:
        return f"q+{self.q_offset},kv+{self.kv_offset}"


def shifted(score_mod, q_offset: int, kv_offset: int):
    """`score_mod` for a chunk whose first query / key are these positions of the call."""
    return reindexed(score_mod, Offsets(q_offset, kv_offset))


@dataclasses.dataclass(frozen=True)
class Chunk:
    config: AttnConfig        # the chunk's own call
    q_rows: Tuple[int, int]   # [start, end) of the call's queries
    kv_rows: Tuple[int, int]  # [start, end) of the call's keys


def count(config: AttnConfig) -> int:
    """How many query chunks `config` runs in (1: one call, the default)."""
    value = os.environ.get(ENV_CHUNKS, "")
    if not value:
        return 1
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{ENV_CHUNKS} must be an int >= 1, got {value!r}")
    return n


def reason(config: AttnConfig, n: int) -> Optional[str]:
    """Why `config` is not run in `n` query chunks (None: it can be)."""
    checks = (
        (n > 1, f"not chunked: one call, whose hidden tiles cuDNN skips ({ENV_CHUNKS}=n "
                f"splits it)"),
        (config.causal, "no causal mask: every key is visible to every query"),
        (config.s_kv >= config.s_q, "s_kv < s_q"),
        (config.s_q % n == 0, f"s_q={config.s_q} is not a multiple of {n} chunks"),
    )
    for ok, why in checks:
        if not ok:
            return why
    return call_reason(config)


def call_reason(config: AttnConfig) -> Optional[str]:
    """Why no config of this kind splits into calls of its rows (None: it can)."""
    checks = (
        (config.qkv_packing == "separate", "packed qkv / kv"),
        (config.sequence == "dense", f"{config.sequence} sequences"),
        (not config.has_dropout, "dropout: the chunks would draw other masks than one call"),
        (not config.has_bias, "bias"),
        (config.softmax == "vanilla", f"softmax {config.softmax!r}"),
        (not config.is_fp8, "FP8"),
    )
    for ok, why in checks:
        if not ok:
            return why
    return None


def chunks(config: AttnConfig, n: int) -> Tuple[Chunk, ...]:
    """The chunks of `config` (for which `reason(config, n)` is None)."""
    c = config.s_q // n
    shift = config.s_kv - config.s_q if config.bottom_right else 0
    left, _ = config.window_bounds()
    out = []
    for i in range(n):
        q0, q1 = i * c, (i + 1) * c
        kv1 = q1 + shift                          # the chunk's last row sees up to kv1 - 1
        kv0 = max(0, q0 + shift - left) if left >= 0 else 0
        mod = config.score_mod
        chunk_config = dataclasses.replace(
            config, s_q=c, s_kv=kv1 - kv0, mask="causal_bottom_right",
            score_mod=None if mod is None else shifted(mod, q0, kv0))
        out.append(Chunk(chunk_config, (q0, q1), (kv0, kv1)))
    return tuple(out)


def tile_fraction(config: AttnConfig, parts: Tuple[Chunk, ...]) -> float:
    """The share of the whole call's score tiles the chunks compute."""
    return sum(ch.config.s_q * ch.config.s_kv for ch in parts) / (config.s_q * config.s_kv)


def attention(config: AttnConfig, inputs, parts: Tuple[Chunk, ...],
              run: Callable) -> Tuple[jax.Array, Optional[jax.Array]]:
    """(out, lse) of the whole call from `run(chunk_config, chunk_inputs) -> (out, lse)`
    on each chunk; lse None if `run` gives none."""
    seq_axis = 0 if config.layout == "sbhd" else 1

    def take(x, rows):
        return jax.lax.slice_in_dim(x, rows[0], rows[1], axis=seq_axis)
    outs, lses = [], []
    for ch in parts:
        out, lse = run(ch.config, inputs._replace(q=take(inputs.q, ch.q_rows),
                                                  k=take(inputs.k, ch.kv_rows),
                                                  v=take(inputs.v, ch.kv_rows)))
        outs.append(out)
        lses.append(lse)
    out = jnp.concatenate(outs, axis=seq_axis)
    lse = None if lses[0] is None else jnp.concatenate(lses, axis=2)
    return out, lse


def describe(config: AttnConfig, parts: Tuple[Chunk, ...]) -> str:
    return (f"causal score_mod in {len(parts)} query chunks of {parts[0].config.s_q} rows: "
            f"{tile_fraction(config, parts):.0%} of the tiles ({ENV_CHUNKS})")
