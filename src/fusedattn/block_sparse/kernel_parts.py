"""Pieces shared by the Mosaic GPU block-sparse kernels (forward, dq, dkv).

Every kernel walks one tile's list of blocks: first its partial blocks, then its
full ones (two lists of the `BlockMap`, read as scalars from GMEM, so no merged
list is built per call). With ``interpret`` set the matrix products become
``jnp.dot`` and vector loads plain reads, because the GPU interpreter on CPU has
no wgmma with a transposed or register operand and no layout casts.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .kernel_score import apply
from .mosaic_ops import evaluate

LOG2E = math.log2(math.e)
F32 = jnp.float32
# Two compute warpgroups of 64 rows own a 128-row tile: the map's block size.
BLOCK, ROWS, NWG, NSTAGE = 128, 64, 2, 2
# A dense mask travels as bits: word w of query row q holds keys 32w .. 32w + 31
# (bit k: key 32w + k), word-major, so a tile's words are a few row (or column)
# vectors in either kernel orientation: no transposed copy for the backward, and
# 1/16 of the bytes of an int16 mask.
WORD = 32


def whole(s: int) -> int:
    """`s` positions padded to whole blocks."""
    return -(-s // BLOCK) * BLOCK


def smem_tiled(shape, dtype):
    """SMEM that wgmma and TMA read without bank conflicts (128-byte rows)."""
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, 64)),
                                                 plgpu.SwizzleTransform(128)))


def matmul_t(a_ref, b_ref, shape, interpret, between=None):
    """a @ b.T (both SMEM refs) as an f32 value; `between` runs while the wgmma is in flight."""
    if interpret:
        return jnp.dot(a_ref[...], b_ref[...].T, preferred_element_type=F32)

    def run(acc):
        plgpu.wgmma(acc, a_ref, b_ref.T)
        if between is not None:
            between()
        return acc[...]
    return pl.run_scoped(run, plgpu.ACC(shape, F32))


def matmul_acc(acc, a, b_ref, interpret):
    """acc + a @ b (a: registers, b: SMEM ref)."""
    if interpret:
        return acc + jnp.dot(a, b_ref[...], preferred_element_type=F32)
    return pl.run_state(lambda r: plgpu.wgmma(r, a, b_ref))(plgpu.ACC.init(acc))


def matmul_t2(a1, b1, a2, b2, shape, interpret, between=None):
    """(a1 @ b1.T, a2 @ b2.T) with both wgmmas in flight at once (one wait, not two);
    `between` runs while they are in flight."""
    if interpret:
        return tuple(jnp.dot(a[...], b[...].T, preferred_element_type=F32)
                     for a, b in ((a1, b1), (a2, b2)))

    def run(x, y):
        plgpu.wgmma(x, a1, b1.T)
        plgpu.wgmma(y, a2, b2.T)
        if between is not None:
            between()
        return x[...], y[...]
    return pl.run_scoped(run, plgpu.ACC(shape, F32), plgpu.ACC(shape, F32))


def matmul_acc2(acc1, a1, b1, acc2, a2, b2, interpret):
    """(acc1 + a1 @ b1, acc2 + a2 @ b2) with both wgmmas in flight at once."""
    if interpret:
        return (matmul_acc(acc1, a1, b1, interpret), matmul_acc(acc2, a2, b2, interpret))

    def run(refs):
        plgpu.wgmma(refs[0], a1, b1)
        plgpu.wgmma(refs[1], a2, b2)
    return pl.run_state(run)((plgpu.ACC.init(acc1), plgpu.ACC.init(acc2)))


def rendezvous(barrier):
    """Both compute warpgroups meet at `barrier` (NWG arrivals): the turn-taking on
    the tensor cores, each warpgroup's products issued while the other computes."""
    plgpu.barrier_arrive(barrier)
    plgpu.barrier_wait(barrier)


def row_vector(ref, interpret):
    """A 1-D SMEM vector laid out along the rows of a wgmma tile."""
    return ref[...] if interpret else plgpu.load(ref, layout=plgpu.Layout.WGMMA.reduce(1))


def col_vector(ref, interpret):
    """A 1-D SMEM vector laid out along the columns of a wgmma tile."""
    return ref[...] if interpret else plgpu.load(ref, layout=plgpu.Layout.WGMMA.reduce(0))


def row_zeros(interpret, rows=ROWS):
    """Zeros along a tile's rows in the rows' own layout: a sum that starts as a splat and
    is never added to would reach SMEM as a splat, which the lowering stores only in
    multiples of 128 elements."""
    zero = jnp.zeros((rows,), F32)
    return zero if interpret else plgpu.layout_cast(zero, plgpu.Layout.WGMMA.reduce(1))


def rows_of(x, shape):
    return broadcast_along(x, 0, shape)


def cols_of(x, shape):
    return broadcast_along(x, 1, shape)


def counts(kmask, score_values):
    """How many mask arrays (q, kv) and score value words (q, kv, diagonal) a call has."""
    return tuple(0 if x is None else x.shape[a] for x, a in (
        (kmask.q_arrays, 1), (kmask.kv_arrays, 1), (score_values[0], 2), (score_values[1], 2),
        (score_values[2], 2)))


def value_scratch(kmask, n_qa, n_ka, n_sq, n_skv, q_side, kv_side, dense_words):
    """SMEM for the mask arrays, a dense mask tile's words (`dense_words`: (words,
    queries) per stage and warpgroup, loaded by the TMA warpgroup with the stage's
    blocks) and the score value words: the q side's and kv side's
    (count, positions) buffers per warpgroup or per stage."""
    scratch = []
    if n_qa:
        scratch.append(plgpu.SMEM((q_side[0], n_qa, q_side[1]), jnp.int32))
    if n_ka:
        scratch.append(plgpu.SMEM((kv_side[0], n_ka, kv_side[1]), jnp.int32))
    if kmask.dense is not None:
        scratch.append(plgpu.SMEM((NSTAGE, NWG) + dense_words, jnp.int32))
    if n_sq:
        scratch.append(plgpu.SMEM((q_side[0], n_sq, q_side[1]), F32))
    if n_skv:
        scratch.append(plgpu.SMEM((kv_side[0], n_skv, kv_side[1]), F32))
    return scratch


def tile_fns(kmask, shape, q_axis, b, h, q0, k0, slot, held, mask_vals, score_vals, dense,
             interpret, mask_ready=None):
    """(q_pos, kv_pos, visible, values) of one step's score tile, its queries along
    `q_axis`. `mask_vals` / `score_vals` are (q side, kv side): the `held` side's
    ("q" or "kv": the tile's own rows) as register vectors, the streamed side's as its
    SMEM ref ``[stages, n, positions]`` (read at `slot`), or None; `score_vals` then
    (`Diagonal`, its span over this tile) or None. `dense()` gives the dense mask's
    tile (or `dense` is None). The streamed mask arrays come for partial blocks only
    (`copy_partial`): `visible` waits at `mask_ready` for them. Only what the mask or
    score reads is built."""
    axes = {"q": q_axis, "kv": 1 - q_axis}

    def tiles(vals, side):
        axis = axes[side]
        if side == held:
            return [broadcast_along(x, axis, shape) for x in vals]
        if vals is None:
            return []
        load = row_vector if axis == 0 else col_vector
        return [broadcast_along(load(vals.at[slot, r], interpret), axis, shape)
                for r in range(vals.shape[1])]

    q_pos = lambda: iota(shape, axes["q"], q0)
    kv_pos = lambda: iota(shape, axes["kv"], k0)

    def visible():
        if mask_ready is not None:
            plgpu.barrier_wait(mask_ready)
        return evaluate(kmask.fn, b, h, q_pos(), kv_pos(), tiles(mask_vals[0], "q"),
                        tiles(mask_vals[1], "kv"), None if dense is None else dense())

    def values():
        diag = score_vals[2]   # (a `kernel_diagonal.Diagonal`, its span) or None
        return (tiles(score_vals[0], "q"), tiles(score_vals[1], "kv"),
                diag[0].tiles(diag[1]) if diag else [])
    return q_pos, kv_pos, visible, values


def broadcast_along(x, axis, shape):
    """A vector along `axis` of a tile, broadcast to the tile."""
    return lax.broadcast_in_dim(x, shape, [axis])


def tokens(ref, b, rows, h, seq_first: bool):
    """Batch `b`, head `h`'s `rows` of a q / k / v-like GMEM ref ``[B, S, H, D]``, or
    ``[S, B, H, D]`` where `seq_first` (sbhd: TMA takes either stride)."""
    return ref.at[rows, b, h] if seq_first else ref.at[b, rows, h]


def batch_tokens(x, seq_first: bool):
    """(B, S) of a q / k / v-like array (`tokens`)."""
    return (x.shape[1], x.shape[0]) if seq_first else x.shape[:2]


def bh_index(x, b, h):
    """The (batch, head) index into an array ``[B|1, H|1, ...]`` (0 where broadcast)."""
    return (b if x.shape[0] > 1 else 0, h if x.shape[1] > 1 else 0)


def side_index(x, b, h):
    """The leading index at (b, h) of one side's mask arrays ``[B|1, n, s]`` (the batch)
    or score value words ``[B|1, H|1, n, s]`` (batch and head); 0 where broadcast."""
    return bh_index(x, b, h) if len(x.shape) == 4 else (b if x.shape[0] > 1 else 0,)


def copy_side(b, h, positions, *copies):
    """Start the TMA copies of one side's mask arrays and score value words at
    `positions` of (b, h) (`side_index`): each copy is (GMEM ref, SMEM destination,
    barrier), or falsy where the call has no such arrays."""
    for copy in copies:
        if copy:
            src, dst, ready = copy
            plgpu.copy_gmem_to_smem(src.at[side_index(src, b, h) + (slice(None), positions)],
                                    dst, ready)


def copy_partial(partial, b, h, positions, copy):
    """`copy_side` of one side's mask arrays, in a partial block only: full blocks skip
    the mask, so nothing reads them there (`tile_fns` waits for them in `visible`)."""
    if copy:
        pl.when(partial)(lambda: copy_side(b, h, positions, copy))


def load_words(d_ref, d_smem, ready, at, partial, slot, tile):
    """In a partial block, start the TMA copies of each warpgroup's dense mask words
    into stage `slot` (`at`: the (batch, head) index; ``tile(w) -> (word rows,
    queries)`` warpgroup w's slices); `dense_tile` waits for them."""
    @pl.when(partial)   # only partial blocks read the mask
    def _copies():
        for w in range(NWG):
            words, queries = tile(w)
            plgpu.copy_gmem_to_smem(d_ref.at[at + (words, queries)], d_smem.at[slot, w],
                                    ready.at[slot * NWG + w])


def dense_tile(d_smem, ready, slot, wg, key_axis, shape, interpret):
    """A dense mask's tile, visible or not, once warpgroup `wg`'s words of stage `slot`
    (`load_words`) are in SMEM: keys run along the tile's `key_axis`."""
    plgpu.barrier_wait(ready.at[slot * NWG + wg])
    d_smem = d_smem.at[slot, wg]
    if key_axis == 1:
        vecs = [rows_of(row_vector(d_smem.at[w], interpret), shape) for w in range(d_smem.shape[0])]
    else:
        vecs = [cols_of(col_vector(d_smem.at[w], interpret), shape) for w in range(d_smem.shape[0])]
    return unpack_bits(vecs, iota(shape, key_axis, 0))


def unpack_bits(words, key):
    """Whether `key` (offsets from the first word's first key, an int tile) is visible
    in `words` (the tile's words, each broadcast against `key`)."""
    word = words[0]
    for w in range(1, len(words)):
        word = jnp.where((key >> 5) == w, words[w], word)
    return ((word >> (key & (WORD - 1))) & 1) != 0


def iota(shape, dim, start):
    return start + lax.broadcasted_iota(jnp.int32, shape, dim)


def persistent_programs(items: int, interpret) -> int:
    """How many CTAs a persistent kernel runs: one per SM (each walks several tiles,
    so one tile's epilogue and the next one's first loads overlap), or one per tile
    in the interpreter or where the device does not say its SM count."""
    sms = None if interpret is not None else getattr(jax.local_devices()[0], "core_count", None)
    return max(1, min(items, int(sms))) if sms else items


class Items:
    """The tiles of a persistent kernel's program: tile ``p + k * programs`` of the
    ``B x H x n_tiles`` tiles for k < count, ordered by (batch, head), so programs
    running at once share their (b, h)'s K / V in L2, and within one last tile
    first: late causal rows are the heavy ones."""

    def __init__(self, items: int, programs: int, n_tiles: int, heads: int):
        self.p = lax.axis_index("p")
        self.programs, self.n_tiles, self.heads = programs, n_tiles, heads
        self.count = (items - self.p + programs - 1) // programs

    def tile(self, k):
        """(b, h, t) of this program's k-th tile."""
        idx = self.p + k * self.programs
        bh = idx // self.n_tiles
        return bh // self.heads, lax.rem(bh, self.heads), (self.n_tiles - 1
                                                              - lax.rem(idx, self.n_tiles))


def drain(k_free, v_free, q_free, steps, count):
    """The persistent forward's TMA warpgroup takes the last arrivals of the K / V
    stage barriers and of the Q buffers' `q_free`, so every barrier ends balanced."""
    def stage(g, _):
        plgpu.barrier_wait(k_free.at[lax.rem(g, NSTAGE)])
        plgpu.barrier_wait(v_free.at[lax.rem(g, NSTAGE)])
    lax.fori_loop(jnp.maximum(steps - NSTAGE, 0), steps, stage, None)
    lax.fori_loop(jnp.maximum(count - 2, 0), count,
                  lambda k, _: plgpu.barrier_wait(q_free.at[lax.rem(k, 2)]), None)


class Lists:
    """One tile's walk: entry i < count_partial is partial block idx_p[i], the rest
    full blocks idx_f[i - count_partial]."""

    def __init__(self, refs, b, h, t, mb, mh):
        self.cp_ref, self.ip_ref, self.cf_ref, self.if_ref = refs
        self.at = (b if mb else 0, h if mh else 0, t)
        self.n_partial = self.cp_ref[self.at]
        self.count = self.n_partial + self.cf_ref[self.at]
        self.width = self.ip_ref.shape[-1]

    def entry(self, i):
        """(block index, is_partial) of entry i."""
        partial = i < self.n_partial
        jp = self.ip_ref[self.at + (jnp.minimum(i, self.width - 1),)]
        jf = self.if_ref[self.at + (jnp.clip(i - self.n_partial, 0, self.width - 1),)]
        return jnp.where(partial, jp, jf), partial


def logits(s, *, scale, score, b, h, q, kv, values, partial, visible, with_grad=False,
           sides=()):
    """Raw q.k -> base-2 logits, -inf where masked. `score`: a `kernel_score.ScoreFn` or
    None; `values()` gives its (q, kv) value tiles. `visible()` evaluates the element
    mask; it runs only in partial blocks. With `with_grad`, also the score's pullback
    (`kernel_score.apply`, for the float values of `sides`; None without a score)."""
    pull = None
    if score is None:
        s = s * (scale * LOG2E)
    else:
        y, pull = apply(score, s * scale, b, h, q(), kv(), values(), with_grad, sides)
        s = y * LOG2E
    s = lax.cond(partial, lambda s: jnp.where(visible(), s, -jnp.inf), lambda s: s, s)
    return s, pull
