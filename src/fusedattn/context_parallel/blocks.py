"""What both strategies of context parallelism share (see `fusedattn.context_parallel`).

Inside a shard_map, each device holds c tokens of every sequence (zig-zag halves
r and 2n-1-r under a causal mask). A *block* is one kernel call: some of my query
rows against some rows of one device's kv. A block returns its output (or
gradients) in the kernels' dtype over all local rows (zeros / -inf elsewhere) and
merges into fp32 accumulators: the output and the LSE in the forward, dq in the
backward; the kv gradients travel with their block in k's dtype (half the bytes of
fp32; one rounding per hop).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Tuple

import jax
import jax.numpy as jnp
import numpy as np

from ..backends import native_op, xla
from ..config import AttnConfig
from ..inputs import AttnInputs
from ..score_mods import Starts, reindexed_config
from ..sequence import SequenceDescriptor

F32 = jnp.float32
NEG_INF = -jnp.inf
# Stands for "no visible key" in the statistics given to a backward kernel:
# exp(s - BIG) is 0 for every finite logit, where -inf would give inf - inf.
EMPTY_ROW_LSE = 1e30


# ---- the zig-zag order ------------------------------------------------------------------
def zigzag_home(j: int, n: int) -> Tuple[int, int]:
    """(device, slot) that holds half j of 2n in the zig-zag order."""
    return (j, 0) if j < n else (2 * n - 1 - j, 1)


def move_halves(x, axis: str, n: int, to_zigzag: bool, seq_axis: int = 1):
    """Natural order (device r holds halves 2r, 2r+1) <-> zig-zag (r holds r, 2n-1-r).

    Two ppermutes. Grouped by the slot the halves leave from (to zig-zag) or arrive
    in (back), each group is a permutation of the devices; a device looks up in a
    static table which slot it stores into (to zig-zag) or sends from (back).
    """
    h = x.shape[seq_axis] // 2
    halves = (jax.lax.slice_in_dim(x, 0, h, axis=seq_axis),
              jax.lax.slice_in_dim(x, h, 2 * h, axis=seq_axis))
    natural = lambda j: (j // 2, j % 2)  # noqa: E731
    zigzag = functools.partial(zigzag_home, n=n)
    src_of, dst_of = (natural, zigzag) if to_zigzag else (zigzag, natural)
    me = jax.lax.axis_index(axis)
    received, other_slot = [], []
    for group in (0, 1):
        moves = [(src_of(j), dst_of(j)) for j in range(2 * n)
                 if (src_of(j) if to_zigzag else dst_of(j))[1] == group]
        # Per device, the slot at the other end of its move in this group.
        table = [0] * n
        for src, dst in moves:
            if to_zigzag:
                table[dst[0]] = dst[1]
            else:
                table[src[0]] = src[1]
        slot = jnp.asarray(table)[me]
        send = halves[group] if to_zigzag else jnp.where(slot == 0, halves[0], halves[1])
        # Halves that stay on their device are not sent (with n = 2, half of them).
        perm = [(src[0], dst[0]) for src, dst in moves if src[0] != dst[0]]
        stays = jnp.asarray([False] * n)
        for src, dst in moves:
            if src[0] == dst[0]:
                stays = stays.at[src[0]].set(True)
        moved = jax.lax.ppermute(send, axis, perm) if perm else send
        received.append(jnp.where(stays[me], send, moved) if perm and len(perm) < n else moved)
        other_slot.append(slot)
    if not to_zigzag:
        return jnp.concatenate(received, axis=seq_axis)
    # To zig-zag: each device got one half per group, bound for different slots.
    first = other_slot[0] == 0
    lo = jnp.where(first, received[0], received[1])
    hi = jnp.where(first, received[1], received[0])
    return jnp.concatenate([lo, hi], axis=seq_axis)


# ---- blocks: my queries against one device's keys ---------------------------------------
@dataclasses.dataclass(frozen=True)
class Static:
    config: AttnConfig     # per device: local batch / heads, s_q = s_kv = local tokens
    axis: str
    n: int
    strategy: str
    zigzag: bool
    backend: str
    reorder: bool = True   # move tokens into zig-zag order and back (else they are)

    @property
    def segments(self) -> Tuple[Tuple[int, int], ...]:
        """Local row ranges that are contiguous in the global sequence."""
        c = self.config.s_q
        return ((0, c // 2), (c // 2, c)) if self.zigzag else ((0, c),)

    def segment_start(self, device, index: int):
        """Global position of local segment `index` on `device`."""
        c = self.config.s_q
        if not self.zigzag:
            return device * c
        h = c // 2
        return device * h if index == 0 else (2 * self.n - 1 - device) * h


def kernels(backend: str):
    """(forward, backward) per-device kernels of `backend` (native_op's contract)."""
    if backend == "xla":
        return xla.forward, xla.backward
    return (functools.partial(native_op.forward, backend),
            functools.partial(native_op.backward, backend))


def prefix_len(st: Static, lengths, device, rows: Tuple[int, int]):
    """Valid tokens among local `rows` of `device`, per batch row: a prefix of them,
    since each local segment starts later in the sequence than the one before."""
    total = 0
    for i, (a, b) in enumerate(st.segments):
        lo, hi = max(a, rows[0]), min(b, rows[1])
        if lo < hi:
            start = st.segment_start(device, i) + (lo - a)
            total = total + jnp.clip(lengths - start, 0, hi - lo)
    return jnp.asarray(total, jnp.int32)


@dataclasses.dataclass(frozen=True)
class Block:
    """One kernel call: local query rows against rows of a kv block."""
    q_rows: Tuple[int, int]
    kv_rows: Tuple[int, int]
    mask: str               # "none", "causal", "causal_bottom_right"; "skip": nothing visible


def ring_cases(st: Static) -> Tuple[Tuple[Block, ...], ...]:
    """The blocks for kv from device src, per case of `ring_case`: src == r, src < r,
    src > r."""
    c = st.config.s_q
    if not st.config.causal:
        return ((Block((0, c), (0, c), "none"),),)
    if not st.zigzag:
        return ((Block((0, c), (0, c), "causal"),), (Block((0, c), (0, c), "none"),),
                (Block((0, 0), (0, 0), "skip"),))
    h = c // 2
    if st.config.score_mod is None:
        # src < r: both my halves see src's first half only; src > r: my second half
        # sees both.
        return ((Block((0, c), (0, c), "causal"),), (Block((0, c), (0, h), "none"),),
                (Block((h, c), (0, c), "none"),))
    # A score_mod reads the call's positions, and the halves sit apart in the call: each
    # block stays within one half of q and of kv, so one offset places its rows
    # (cuDNN's engines refuse the select a split point would need).
    lo, hi = (0, h), (h, c)
    return ((Block(lo, lo, "causal"), Block(hi, lo, "none"), Block(hi, hi, "causal")),
            (Block(lo, lo, "none"), Block(hi, lo, "none")),
            (Block(hi, lo, "none"), Block(hi, hi, "none")))


def ring_case(st: Static, r, src):
    if not st.config.causal:
        return jnp.int32(0)
    return jnp.where(src == r, 0, jnp.where(src < r, 1, 2)).astype(jnp.int32)


def block_call(st: Static, block: Block, q_len, kv_len, score_args=()):
    """The block's config, and a function making its inputs (padding lengths: the
    [b] valid prefixes of its q and kv rows; a score_mod's arguments, `score_args`)."""
    cfg = dataclasses.replace(
        st.config, s_q=block.q_rows[1] - block.q_rows[0], s_kv=block.kv_rows[1] - block.kv_rows[0],
        mask=block.mask, sequence="padding" if (st.config.is_padded or
                                                block.mask == "causal_bottom_right") else "dense")
    if cfg.score_mod is not None:
        cfg = reindexed_config(cfg, Starts(positions=True))

    def inputs(q, k, v):
        seq = SequenceDescriptor.from_lengths(q_len, kv_len) if cfg.is_padded else None
        return AttnInputs(q=q, k=k, v=v, sequence=seq, score_mod_args=tuple(score_args))
    return cfg, inputs


# ---- score_mods: the call's positions inside a block -----------------------------------
def position(st: Static, rows: Tuple[int, int], device):
    """The call's position of local row rows[0] of `device` (rows within one segment)."""
    for i, (a, b) in enumerate(st.segments):
        if a <= rows[0] and rows[1] <= b:
            return st.segment_start(device, i) + rows[0] - a
    raise AssertionError(f"block rows {rows} span local segments {st.segments}")


def score_args(st: Static, block: Block, r, src, extra):
    """A block's score_mod arguments: the user's, then the four of
    `score_mods.Starts(positions=True)`: the device's first batch row and head, the
    call's positions of the block's first query and key (keys of device `src`, or in
    natural order when `src` is None: all gathered). A block's rows lie within one
    zig-zag half (`ring_cases`), so one offset places them."""
    if st.config.score_mod is None:
        return ()
    user, batch_start, head_start = extra
    kv = 0 if src is None else position(st, block.kv_rows, src)
    ints = (batch_start, head_start, position(st, block.q_rows, r), kv)
    return tuple(user) + tuple(jnp.asarray(x, jnp.int32) for x in ints)


def take_rows(x, rows, axis=1):
    return jax.lax.slice_in_dim(x, rows[0], rows[1], axis=axis)


def pad_rows(x, rows, size, axis=1, value=0.0):
    widths = [(0, 0)] * x.ndim
    widths[axis] = (rows[0], size - rows[1])
    return jnp.pad(x, widths, constant_values=value)


def block_forward(st: Static, block: Block, q, k, v, q_len, kv_len, score_args):
    """(out [b, c, h, d_v] in q's dtype, lse fp32 [b, h, c]) over all local rows: 0 / -inf
    on rows that see no key of this block. Kept in q's dtype (the kernel's own output)
    until the merge: an fp32 copy per block would double the memory of every step."""
    c, b = st.config.s_q, q.shape[0]
    if block.mask == "skip":
        return (jnp.zeros(q.shape[:3] + (v.shape[-1],), q.dtype),
                jnp.full((b, q.shape[2], c), NEG_INF, F32))
    cfg, make = block_call(st, block, q_len, kv_len, score_args)
    out, lse = kernels(st.backend)[0](
        cfg, make(take_rows(q, block.q_rows), take_rows(k, block.kv_rows), take_rows(v, block.kv_rows)), True)
    rows = block.q_rows[1] - block.q_rows[0]
    seen = (jnp.arange(rows)[None, :] < q_len[:, None]) & (kv_len[:, None] > 0)  # [b, rows]
    out = jnp.where(seen[:, :, None, None], out, jnp.zeros((), out.dtype))
    lse = jnp.where(seen[:, None, :], lse, NEG_INF)
    return pad_rows(out, block.q_rows, c), pad_rows(lse, block.q_rows, c, 2, NEG_INF)


def block_backward(st: Static, block: Block, q, k, v, out, lse, d_out, q_len, kv_len,
                    score_args):
    """(dq [b, c, ..], dk, dv [b, c, ..]) of this block given the merged out / lse, in
    the kernels' output dtypes (accumulated in fp32 by the caller)."""
    c = st.config.s_q
    zeros = jnp.zeros_like
    if block.mask == "skip":
        return zeros(q), zeros(k), zeros(v)
    cfg, make = block_call(st, block, q_len, kv_len, score_args)
    qr, kr = block.q_rows, block.kv_rows
    lse = jnp.where(lse == NEG_INF, EMPTY_ROW_LSE, lse)
    grads = kernels(st.backend)[1](
        cfg, make(take_rows(q, qr), take_rows(k, kr), take_rows(v, kr)), take_rows(out, qr), take_rows(lse, qr, 2),
        take_rows(d_out, qr))
    kv_c = k.shape[1]
    return (pad_rows(grads.q, qr, c), pad_rows(grads.k, kr, kv_c), pad_rows(grads.v, kr, kv_c))


def merge(acc, part):
    """Exact merge of two partial softmax results through their LSEs."""
    o_a, l_a = acc
    o_b, l_b = part
    lse = jnp.logaddexp(l_a, l_b)
    safe = jnp.where(lse == NEG_INF, 0.0, lse)
    to_o = lambda w: jnp.swapaxes(w, 1, 2)[..., None]  # noqa: E731 [b, h, c] -> [b, c, h, 1]
    return (o_a.astype(F32) * to_o(jnp.exp(l_a - safe))
            + o_b.astype(F32) * to_o(jnp.exp(l_b - safe))), lse


# ---- moving blocks and tokens ------------------------------------------------------
def shift(x, st: Static):
    """Send to the next device of the ring (device r receives from r - 1)."""
    return jax.lax.ppermute(x, st.axis, [(i, (i + 1) % st.n) for i in range(st.n)])


def to_zigzag(st: Static, x):
    return move_halves(x, st.axis, st.n, True) if st.zigzag and st.reorder else x


def from_zigzag(st: Static, x):
    return move_halves(x, st.axis, st.n, False) if st.zigzag and st.reorder else x


def zigzag_order(seq_len: int, n: int):
    """Token indices that put a natural-order sequence of `seq_len` into the zig-zag
    order of n devices (``x[:, zigzag_order(s, n)]``, then shard the sequence over
    the axis and pass ``ContextParallel(axis, reorder=False)``); `numpy.argsort` of it
    restores the natural order. Do it once in the data pipeline (with the positions
    that rotary embeddings use) and the ring needs no reordering moves."""
    h = seq_len // (2 * n)
    halves = [j for r in range(n) for j in (r, 2 * n - 1 - r)]
    return np.concatenate([np.arange(j * h, (j + 1) * h) for j in halves])
