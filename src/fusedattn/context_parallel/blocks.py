"""The per-device algorithm of context parallelism (see `fusedattn.context_parallel`).

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

from .backends.base import AttnInputs
from .config import AttnConfig
from .score_mods import Starts, reindexed_config
from .sequence import SequenceDescriptor

F32 = jnp.float32
NEG_INF = -jnp.inf
# Stands for "no visible key" in the statistics given to a backward kernel:
# exp(s - BIG) is 0 for every finite logit, where -inf would give inf - inf.
_EMPTY_ROW_LSE = 1e30


# ---- the zig-zag order ------------------------------------------------------------------
def _zigzag_home(j: int, n: int) -> Tuple[int, int]:
    """(device, slot) that holds half j of 2n in the zig-zag order."""
    return (j, 0) if j < n else (2 * n - 1 - j, 1)


def _move_halves(x, axis: str, n: int, to_zigzag: bool, seq_axis: int = 1):
    """Natural order (device r holds halves 2r, 2r+1) <-> zig-zag (r holds r, 2n-1-r).

    Two ppermutes. Grouped by the slot the halves leave from (to zig-zag) or arrive
    in (back), each group is a permutation of the devices; a device looks up in a
    static table which slot it stores into (to zig-zag) or sends from (back).
    """
    h = x.shape[seq_axis] // 2
    halves = (jax.lax.slice_in_dim(x, 0, h, axis=seq_axis),
              jax.lax.slice_in_dim(x, h, 2 * h, axis=seq_axis))
    natural = lambda j: (j // 2, j % 2)  # noqa: E731
    zigzag = functools.partial(_zigzag_home, n=n)
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
class _Static:
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


def _kernels(backend: str):
    """(forward, backward) per-device kernels of `backend` (native_call's contract)."""
    if backend == "xla":
        from .backends import xla  # noqa: PLC0415
        return xla.forward, xla.backward
    from .backends import native_call  # noqa: PLC0415
    return (functools.partial(native_call.forward, backend),
            functools.partial(native_call.backward, backend))


def _prefix_len(st: _Static, lengths, device, rows: Tuple[int, int]):
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
class _Block:
    """One kernel call: local query rows against rows of a kv block."""
    q_rows: Tuple[int, int]
    kv_rows: Tuple[int, int]
    mask: str               # "none", "causal", "causal_bottom_right"; "skip": nothing visible


def _ring_cases(st: _Static) -> Tuple[Tuple[_Block, ...], ...]:
    """The blocks for kv from device src, per case of `_ring_case`: src == r, src < r,
    src > r."""
    c = st.config.s_q
    if not st.config.causal:
        return ((_Block((0, c), (0, c), "none"),),)
    if not st.zigzag:
        return ((_Block((0, c), (0, c), "causal"),), (_Block((0, c), (0, c), "none"),),
                (_Block((0, 0), (0, 0), "skip"),))
    h = c // 2
    if st.config.score_mod is None:
        # src < r: both my halves see src's first half only; src > r: my second half
        # sees both.
        return ((_Block((0, c), (0, c), "causal"),), (_Block((0, c), (0, h), "none"),),
                (_Block((h, c), (0, c), "none"),))
    # A score_mod reads the call's positions, and the halves sit apart in the call: each
    # block stays within one half of q and of kv, so one offset places its rows
    # (cuDNN's engines refuse the select a split point would need).
    lo, hi = (0, h), (h, c)
    return ((_Block(lo, lo, "causal"), _Block(hi, lo, "none"), _Block(hi, hi, "causal")),
            (_Block(lo, lo, "none"), _Block(hi, lo, "none")),
            (_Block(hi, lo, "none"), _Block(hi, hi, "none")))


def _ring_case(st: _Static, r, src):
    if not st.config.causal:
        return jnp.int32(0)
    return jnp.where(src == r, 0, jnp.where(src < r, 1, 2)).astype(jnp.int32)


def _block_call(st: _Static, block: _Block, q_len, kv_len, score_args=()):
    """The block's config, and a function making its inputs (padding lengths: the
    [b] valid prefixes of its q and kv rows; a score_mod's arguments, `_score_args`)."""
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
def _position(st: _Static, rows: Tuple[int, int], device):
    """The call's position of local row rows[0] of `device` (rows within one segment)."""
    for i, (a, b) in enumerate(st.segments):
        if a <= rows[0] and rows[1] <= b:
            return st.segment_start(device, i) + rows[0] - a
    raise AssertionError(f"block rows {rows} span local segments {st.segments}")


def _score_args(st: _Static, block: _Block, r, src, extra):
    """A block's score_mod arguments: the user's, then the four of
    `score_mods.Starts(positions=True)`: the device's first batch row and head, the
    call's positions of the block's first query and key (keys of device `src`, or in
    natural order when `src` is None: all gathered). A block's rows lie within one
    zig-zag half (`_ring_cases`), so one offset places them."""
    if st.config.score_mod is None:
        return ()
    user, batch_start, head_start = extra
    kv = 0 if src is None else _position(st, block.kv_rows, src)
    ints = (batch_start, head_start, _position(st, block.q_rows, r), kv)
    return tuple(user) + tuple(jnp.asarray(x, jnp.int32) for x in ints)


def _rows(x, rows, axis=1):
    return jax.lax.slice_in_dim(x, rows[0], rows[1], axis=axis)


def _pad_rows(x, rows, size, axis=1, value=0.0):
    widths = [(0, 0)] * x.ndim
    widths[axis] = (rows[0], size - rows[1])
    return jnp.pad(x, widths, constant_values=value)


def _block_forward(st: _Static, block: _Block, q, k, v, q_len, kv_len, score_args):
    """(out [b, c, h, d_v] in q's dtype, lse fp32 [b, h, c]) over all local rows: 0 / -inf
    on rows that see no key of this block. Kept in q's dtype (the kernel's own output)
    until the merge: an fp32 copy per block would double the memory of every step."""
    c, b = st.config.s_q, q.shape[0]
    if block.mask == "skip":
        return (jnp.zeros(q.shape[:3] + (v.shape[-1],), q.dtype),
                jnp.full((b, q.shape[2], c), NEG_INF, F32))
    cfg, make = _block_call(st, block, q_len, kv_len, score_args)
    out, lse = _kernels(st.backend)[0](
        cfg, make(_rows(q, block.q_rows), _rows(k, block.kv_rows), _rows(v, block.kv_rows)), True)
    rows = block.q_rows[1] - block.q_rows[0]
    seen = (jnp.arange(rows)[None, :] < q_len[:, None]) & (kv_len[:, None] > 0)  # [b, rows]
    out = jnp.where(seen[:, :, None, None], out, jnp.zeros((), out.dtype))
    lse = jnp.where(seen[:, None, :], lse, NEG_INF)
    return _pad_rows(out, block.q_rows, c), _pad_rows(lse, block.q_rows, c, 2, NEG_INF)


def _block_backward(st: _Static, block: _Block, q, k, v, out, lse, d_out, q_len, kv_len,
                    score_args):
    """(dq [b, c, ..], dk, dv [b, c, ..]) of this block given the merged out / lse, in
    the kernels' output dtypes (accumulated in fp32 by the caller)."""
    c = st.config.s_q
    zeros = jnp.zeros_like
    if block.mask == "skip":
        return zeros(q), zeros(k), zeros(v)
    cfg, make = _block_call(st, block, q_len, kv_len, score_args)
    qr, kr = block.q_rows, block.kv_rows
    lse = jnp.where(lse == NEG_INF, _EMPTY_ROW_LSE, lse)
    grads = _kernels(st.backend)[1](
        cfg, make(_rows(q, qr), _rows(k, kr), _rows(v, kr)), _rows(out, qr), _rows(lse, qr, 2),
        _rows(d_out, qr))
    kv_c = k.shape[1]
    return (_pad_rows(grads.q, qr, c), _pad_rows(grads.k, kr, kv_c), _pad_rows(grads.v, kr, kv_c))


def _switch(st: _Static, index, fn, *arrays):
    """fn(blocks, st, *arrays) for the ring case `index` selects."""
    cases = _ring_cases(st)
    if len(cases) == 1:
        return fn(cases[0], st, *arrays)
    return jax.lax.switch(index, [functools.partial(fn, case, st) for case in cases], *arrays)


def _merge(acc, part):
    """Exact merge of two partial softmax results through their LSEs."""
    o_a, l_a = acc
    o_b, l_b = part
    lse = jnp.logaddexp(l_a, l_b)
    safe = jnp.where(lse == NEG_INF, 0.0, lse)
    to_o = lambda w: jnp.swapaxes(w, 1, 2)[..., None]  # noqa: E731 [b, h, c] -> [b, c, h, 1]
    return (o_a.astype(F32) * to_o(jnp.exp(l_a - safe))
            + o_b.astype(F32) * to_o(jnp.exp(l_b - safe))), lse


# ---- ring --------------------------------------------------------------------------------
def _shift(x, st: _Static):
    """Send to the next device of the ring (device r receives from r - 1)."""
    return jax.lax.ppermute(x, st.axis, [(i, (i + 1) % st.n) for i in range(st.n)])


def _ring_forward(st: _Static, q, k, v, q_len, kv_len, extra):
    r = jax.lax.axis_index(st.axis)
    acc = None
    for t in range(st.n):
        # Issue the next block's transfer before this block's kernel: XLA overlaps them.
        nxt = _shift((k, v), st) if t < st.n - 1 else None
        src = (r - t) % st.n
        part = _switch(st, _ring_case(st, r, src), _ring_case_fwd, q, k, v, q_len, kv_len, r, src,
                       extra)
        acc = part if acc is None else _merge(acc, part)
        if nxt is not None:
            k, v = nxt
    return acc


def _ring_block_args(st, block, q_len, kv_len, r, src, extra):
    """A ring block's padding lengths (my rows, src's keys) and score_mod arguments."""
    return (_prefix_len(st, q_len, r, block.q_rows), _prefix_len(st, kv_len, src, block.kv_rows),
            _score_args(st, block, r, src, extra))


def _ring_case_fwd(blocks, st, q, k, v, q_len, kv_len, r, src, extra):
    """(out in q's dtype, lse) of one case's blocks, merged."""
    parts = [_block_forward(st, block, q, k, v,
                            *_ring_block_args(st, block, q_len, kv_len, r, src, extra))
             for block in blocks]
    if len(parts) == 1:
        return parts[0]
    out, lse = functools.reduce(_merge, parts)
    return out.astype(q.dtype), lse


def _ring_case_bwd(blocks, st, q, k, v, out, lse, d_out, q_len, kv_len, r, src, extra):
    """(dq, dk, dv) of one case's blocks, summed."""
    grads = [_block_backward(st, block, q, k, v, out, lse, d_out,
                             *_ring_block_args(st, block, q_len, kv_len, r, src, extra))
             for block in blocks]
    if len(grads) == 1:
        return grads[0]
    return tuple(functools.reduce(lambda a, b: a + b.astype(F32), parts[1:],
                                  parts[0].astype(F32)).astype(parts[0].dtype)
                 for parts in zip(*grads))


def _ring_backward(st: _Static, q, k, v, out, lse, d_out, q_len, kv_len, extra):
    r = jax.lax.axis_index(st.axis)
    dq = jnp.zeros(q.shape, F32)
    dk, dv = jnp.zeros_like(k), jnp.zeros_like(v)
    for t in range(st.n):
        nxt = _shift((k, v), st) if t < st.n - 1 else None
        src = (r - t) % st.n
        g = _switch(st, _ring_case(st, r, src), _ring_case_bwd, q, k, v, out, lse, d_out,
                    q_len, kv_len, r, src, extra)
        dq = dq + g[0].astype(F32)
        # The kv gradients travel with their block, in k's dtype (half the bytes of
        # fp32; one rounding per hop, n in all); after the last step one more hop
        # takes them home (device r holds block r + 1's then).
        dk = (dk.astype(F32) + g[1].astype(F32)).astype(k.dtype)
        dv = (dv.astype(F32) + g[2].astype(F32)).astype(v.dtype)
        dk, dv = _shift((dk, dv), st)
        if nxt is not None:
            k, v = nxt
    return dq, dk, dv


# ---- all-gather ------------------------------------------------------------------------------
def _gather_blocks(st: _Static, r):
    """Per local segment: (rows, its causal kv prefix length or None for no mask)."""
    if not st.config.causal:
        return [((0, st.config.s_q), None)]
    return [((a, b), st.segment_start(r, i) + (b - a)) for i, (a, b) in enumerate(st.segments)]


def _gather_forward(st: _Static, q, k_all, v_all, q_len, kv_len, extra):
    r = jax.lax.axis_index(st.axis)
    outs, lses = [], []
    total = k_all.shape[1]
    for rows, prefix in _gather_blocks(st, r):
        block = _Block(rows, (0, total), "none" if prefix is None else "causal_bottom_right")
        ql = _prefix_len(st, q_len, r, rows)
        kl = jnp.clip(kv_len, 0, total) if prefix is None else jnp.broadcast_to(prefix, ql.shape)
        out, lse = _block_forward(st, block, q, k_all, v_all, ql, kl.astype(jnp.int32),
                                  _score_args(st, block, r, None, extra))
        outs.append(out)
        lses.append(lse)
    return functools.reduce(_merge, zip(outs, lses))


def _gather_backward(st: _Static, q, k_all, v_all, out, lse, d_out, q_len, kv_len, extra):
    r = jax.lax.axis_index(st.axis)
    dq = jnp.zeros(q.shape, F32)
    dk, dv = jnp.zeros(k_all.shape, F32), jnp.zeros(v_all.shape, F32)
    total = k_all.shape[1]
    for rows, prefix in _gather_blocks(st, r):
        block = _Block(rows, (0, total), "none" if prefix is None else "causal_bottom_right")
        ql = _prefix_len(st, q_len, r, rows)
        kl = jnp.clip(kv_len, 0, total) if prefix is None else jnp.broadcast_to(prefix, ql.shape)
        g = _block_backward(st, block, q, k_all, v_all, out, lse, d_out, ql, kl.astype(jnp.int32),
                            _score_args(st, block, r, None, extra))
        dq, dk, dv = dq + g[0], dk + g[1], dv + g[2]
    if st.zigzag and not st.reorder:  # back to the callers' (zig-zag) token order
        order = zigzag_order(k_all.shape[1], st.n)
        dk, dv = jnp.take(dk, order, axis=1), jnp.take(dv, order, axis=1)
    return dq, _reduce_scatter(dk, st, r), _reduce_scatter(dv, st, r)


def _gathered_in_natural_order(st: _Static, x):
    """All-gather along the sequence; tokens given in zig-zag order are put back in
    natural order (a local gather), since the blocks address kv by position."""
    full = jax.lax.all_gather(x, st.axis, axis=1, tiled=True)
    if st.zigzag and not st.reorder:
        full = jnp.take(full, np.argsort(zigzag_order(full.shape[1], st.n)), axis=1)
    return full


def _reduce_scatter(x, st: _Static, r):
    """Sum over the ring of x [b, n * c, ..]; device r keeps chunk r. A ring of n - 1
    ppermutes (the bandwidth of a reduce-scatter; lax.psum_scatter fails to lower
    inside a shard_map over part of an Explicit mesh in JAX 0.10)."""
    c = x.shape[1] // st.n
    chunk = lambda i: jax.lax.dynamic_slice_in_dim(x, (i % st.n) * c, c, axis=1)  # noqa: E731
    buf = chunk(r - 1)
    for t in range(st.n - 1):
        buf = _shift(buf, st) + chunk(r - t - 2)
    return buf


# ---- the differentiable per-device function ------------------------------------------------
def _to_zigzag(st: _Static, x):
    return _move_halves(x, st.axis, st.n, True) if st.zigzag and st.reorder else x


def _from_zigzag(st: _Static, x):
    return _move_halves(x, st.axis, st.n, False) if st.zigzag and st.reorder else x


def zigzag_order(seq_len: int, n: int):
    """Token indices that put a natural-order sequence of `seq_len` into the zig-zag
    order of n devices (``x[:, zigzag_order(s, n)]``, then shard the sequence over
    the axis and pass ``ContextParallel(axis, reorder=False)``); `numpy.argsort` of it
    restores the natural order. Do it once in the data pipeline (with the positions
    that rotary embeddings use) and the ring needs no reordering moves."""
    h = seq_len // (2 * n)
    halves = [j for r in range(n) for j in (r, 2 * n - 1 - r)]
    return np.concatenate([np.arange(j * h, (j + 1) * h) for j in halves])


def _forward(st: _Static, q, k, v, q_len, kv_len, extra):
    """(out in q's dtype, lse [b, h, c]) in natural order, and the residuals."""
    zq = _to_zigzag(st, q)
    if st.strategy == "ring":
        zk, zv = _to_zigzag(st, k), _to_zigzag(st, v)
        out, lse = _ring_forward(st, zq, zk, zv, q_len, kv_len, extra)
    else:
        zk, zv = (_gathered_in_natural_order(st, x) for x in (k, v))
        out, lse = _gather_forward(st, zq, zk, zv, q_len, kv_len, extra)
    out = out.astype(q.dtype)
    return out, lse, (zq, zk, zv, out, lse)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(st: _Static, q, k, v, q_len, kv_len, extra):
    """`extra`: () without a score_mod, else (its integer arguments, this device's first
    batch row, first head); they take no gradient (floating ones are refused)."""
    out, _, _ = _forward(st, q, k, v, q_len, kv_len, extra)
    return _from_zigzag(st, out)


def _attend_fwd(st, q, k, v, q_len, kv_len, extra):
    out, _, res = _forward(st, q, k, v, q_len, kv_len, extra)
    return _from_zigzag(st, out), (res, q_len, kv_len, extra)


def _attend_bwd(st, residuals, d_out):
    (zq, zk, zv, out, lse), q_len, kv_len, extra = residuals
    zd = _to_zigzag(st, d_out.astype(out.dtype))
    if st.strategy == "ring":
        dq, dk, dv = _ring_backward(st, zq, zk, zv, out, lse, zd, q_len, kv_len, extra)
        dk, dv = _from_zigzag(st, dk), _from_zigzag(st, dv)
    else:
        dq, dk, dv = _gather_backward(st, zq, zk, zv, out, lse, zd, q_len, kv_len, extra)
    dq = _from_zigzag(st, dq)
    return (dq.astype(zq.dtype), dk.astype(zk.dtype), dv.astype(zv.dtype), None, None, None)


_attend.defvjp(_attend_fwd, _attend_bwd)


