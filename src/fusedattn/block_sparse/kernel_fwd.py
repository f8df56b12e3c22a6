"""Block-sparse attention forward as a Pallas Mosaic GPU kernel (Hopper).

Persistent: one CTA per SM walks its share of the (batch, head, 128-query)
tiles (`kernel_parts.Items`) with two compute warpgroups of 64 rows and one TMA
warpgroup that streams each tile's Q and the K/V blocks its lists name, running
ahead into the next tile while the compute warpgroups finish one (Q is double
buffered; a tile's output leaves through its Q buffer). Empty blocks
are never loaded; full blocks skip the mask; partial blocks evaluate the exact
element mask from positions and small per-row / per-block arrays. The two
compute warpgroups take turns on the tensor cores (a schedule barrier), so one's
softmax overlaps the other's matmuls.

Returns out and the base-2 log-sum-exp (-inf on rows with no visible key, whose
output is 0, or `fill`: jax.nn's rule is the mean of all values).
"""
from __future__ import annotations


import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .kernel_diagonal import Diagonal, diagonal_scratch, diagonal_words
from .kernel_mask import KernelMask
from .kernel_parts import (BLOCK, F32, NSTAGE, NWG, ROWS, WORD, Items, Lists, bh_index as _bh,
                           batch_tokens, col_vector, cols_of, copy_partial, copy_side, counts,
                           dense_tile, drain, logits, matmul_acc, matmul_t, load_words,
                           persistent_programs, rendezvous, row_vector, rows_of, smem_tiled,
                           tile_fns, tokens, value_scratch)


def forward(q, k, v, lists, kmask: KernelMask, *, scale: float, score=None,
            score_values=(None, None, None), fill=None, seq_first=False, interpret=None):
    """q [B, S, H, D], k/v [B, S_kv, H_kv, D] (`seq_first`: [S, B, H, D], the output
    too); `lists` = (kv_num_blocks, kv_indices,
    full_kv_num_blocks, full_kv_indices) of a 128x128 map; `score` a
    `kernel_score.ScoreFn` or None, `score_values` its (q, kv, diagonal) value words or
    None;
    `fill` f32 [B, H, D]: the output of rows with no visible key (None: 0).
    -> (out, lse2 [B, H, S])."""
    (B, S), H, D = batch_tokens(q, seq_first), q.shape[2], q.shape[3]
    H_kv = k.shape[2]
    group = H // H_kv
    dt = q.dtype
    n_tiles = S // BLOCK
    mb, mh = lists[0].shape[0] > 1, lists[0].shape[1] > 1
    qa, ka, dense = kmask.q_arrays, kmask.kv_arrays, kmask.dense
    sq, skv, sd = score_values
    n_qa, n_ka, n_sq, n_skv, n_sd = counts(kmask, score_values)
    sd = diagonal_words(score, sd) if n_sd else None
    extra = [x for x in (qa, ka, dense, sq, skv, sd, fill) if x is not None]
    hw = interpret is None
    # Arrays beside K (a dense mask's words too): K's slot is freed after the mask.
    per_block = n_ka or n_skv or dense is not None

    items = B * H * n_tiles
    programs = persistent_programs(items, interpret)

    def body(*refs):
        q_ref, k_ref, v_ref, *refs = refs
        list_refs, refs = refs[:4], refs[4:]
        qa_ref = refs.pop(0) if n_qa else None
        ka_ref = refs.pop(0) if n_ka else None
        d_ref = refs.pop(0) if dense is not None else None
        sq_ref = refs.pop(0) if n_sq else None
        skv_ref = refs.pop(0) if n_skv else None
        sd_ref = refs.pop(0) if n_sd else None
        f_ref = refs.pop(0) if fill is not None else None
        o_ref, lse_ref, q_smem, k_smem, v_smem, lse_smem, *refs = refs
        qa_smem = refs.pop(0) if n_qa else None
        ka_smem = refs.pop(0) if n_ka else None
        d_smem = refs.pop(0) if dense is not None else None
        sq_smem = refs.pop(0) if n_sq else None
        skv_smem = refs.pop(0) if n_skv else None
        f_smem, f_ready = (refs.pop(0), refs.pop(0)) if fill is not None else (None, None)
        if n_sd:   # (last in the scratch)
            *refs, sd_smem, sd_ready = refs
        (q_ready, k_ready, v_ready, k_free, v_free, sched, a_ready, ka_ready, d_ready,
         s_ready, skv_ready, q_free) = refs

        wg = lax.axis_index("wg")
        mine = Items(items, programs, n_tiles, H)

        def at(k):
            """Item k of this program: its (b, h, t), list walk and Q buffer."""
            b, h, t = mine.tile(k)
            return b, h, t, Lists(list_refs, b, h, t, mb, mh), lax.rem(k, 2)

        sched_sync = lambda: rendezvous(sched)

        @pl.when(wg < NWG)
        def _compute():
            if hw:
                plgpu.set_max_registers(232, action="increase")

            def one(item, base):
                b, h, t, walk, buf = at(item)
                n = walk.count
                q0 = t * BLOCK + wg * ROWS
                qw = q_smem.at[buf, wg]
                if fill is not None:   # waited for in the epilogue
                    plgpu.copy_gmem_to_smem(f_ref.at[b, h], f_smem.at[wg], f_ready.at[wg])
                copy_side(b, h, pl.ds(q0, ROWS), n_qa and (qa_ref, qa_smem.at[wg], a_ready.at[wg]),
                          n_sq and (sq_ref, sq_smem.at[wg], s_ready.at[wg]))
                diag = n_sd and Diagonal.load(sd_ref, sd_smem, sd_ready, b, h, wg,
                                              score.runs, interpret)
                if n_qa:
                    plgpu.barrier_wait(a_ready.at[wg])
                if n_sq:
                    plgpu.barrier_wait(s_ready.at[wg])
                plgpu.barrier_wait(q_ready.at[buf * NWG + wg])
                shape = (ROWS, BLOCK)
                q_vals = [row_vector(qa_smem.at[wg, r], interpret) for r in range(n_qa)]
                q_words = [row_vector(sq_smem.at[wg, r], interpret) for r in range(n_sq)]
                if hw:
                    pl.when(wg == 1)(sched_sync)

                def step(i, carry):
                    acc, m, l = carry
                    slot = lax.rem(base + i, NSTAGE)
                    j, partial = walk.entry(i)
                    plgpu.barrier_wait(k_ready.at[slot])
                    if n_skv:
                        plgpu.barrier_wait(skv_ready.at[slot])
                    s = matmul_t(qw, k_smem.at[slot], shape, interpret, sched_sync if hw else None)
                    if not per_block:
                        plgpu.barrier_arrive(k_free.at[slot])
                    words = None if dense is None else lambda: dense_tile(
                        d_smem, d_ready, slot, wg, 1, shape, interpret)
                    diag_at = diag and (diag, diag.span(q0, j * BLOCK, shape, 0))
                    q_pos, kv_pos, visible, values = tile_fns(
                        kmask, shape, 0, b, h, q0, j * BLOCK, slot, "q", (q_vals, ka_smem),
                        (q_words, skv_smem, diag_at), words, interpret,
                        ka_ready.at[slot] if n_ka else None)

                    s, _ = logits(s, scale=scale, score=score, b=b, h=h, q=q_pos, kv=kv_pos,
                                  values=values, partial=partial, visible=visible)
                    if per_block:
                        plgpu.barrier_arrive(k_free.at[slot])
                    m_new = jnp.maximum(m, s.max(axis=1))
                    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)   # no -inf - -inf
                    alpha = jnp.exp2(m - m_safe)
                    p = jnp.exp2(s - rows_of(m_safe, shape))
                    acc = acc * rows_of(alpha, acc.shape)
                    l = l * alpha + p.sum(axis=1)
                    p = p.astype(dt)
                    if hw:
                        acc, l, m_new, p = lax.optimization_barrier((acc, l, m_new, p))
                        plgpu.barrier_arrive(sched)            # softmax done
                    plgpu.barrier_wait(v_ready.at[slot])
                    if hw:
                        plgpu.barrier_wait(sched)              # tensor cores ours
                    acc = matmul_acc(acc, p, v_smem.at[slot], interpret)
                    plgpu.barrier_arrive(v_free.at[slot])
                    return acc, m_new, l

                init = (jnp.zeros((ROWS, D), F32), jnp.full((ROWS,), -jnp.inf, F32),
                        jnp.zeros((ROWS,), F32))
                acc, m, l = lax.fori_loop(0, n, step, init)
                if hw:
                    pl.when(wg == 0)(sched_sync)
                empty = l == 0.0
                l_safe = jnp.where(empty, 1.0, l)
                out = acc / rows_of(l_safe, acc.shape)
                if fill is not None:
                    plgpu.barrier_wait(f_ready.at[wg])
                    out = jnp.where(rows_of(l, acc.shape) == 0.0,
                                    cols_of(col_vector(f_smem.at[wg], interpret), acc.shape), out)
                qw[...] = out.astype(dt)   # Q's buffer holds O
                lse_smem.at[wg][...] = jnp.where(empty, -jnp.inf, m + jnp.log2(l_safe))
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(qw, tokens(o_ref, b, pl.ds(q0, ROWS), h, seq_first))
                plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[b, h, pl.ds(q0, ROWS)])
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                plgpu.barrier_arrive(q_free.at[buf])   # the buffer may take a later Q
                return base + n

            lax.fori_loop(0, mine.count, one, jnp.int32(0))
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == NWG)
        def _tma():
            if hw:
                plgpu.set_max_registers(40, action="decrease")

            def one(item, base):
                b, h, t, walk, buf = at(item)
                h_kv = h // group
                pl.when(item >= 2)(lambda: plgpu.barrier_wait(q_free.at[buf]))
                for w in range(NWG):
                    plgpu.copy_gmem_to_smem(
                        tokens(q_ref, b, pl.ds(t * BLOCK + w * ROWS, ROWS), h, seq_first),
                        q_smem.at[buf, w], q_ready.at[buf * NWG + w])

                def issue(i, _):
                    g = base + i
                    slot = lax.rem(g, NSTAGE)
                    j, partial = walk.entry(i)
                    rows = pl.ds(j * BLOCK, BLOCK)
                    pl.when(g >= NSTAGE)(lambda: plgpu.barrier_wait(k_free.at[slot]))
                    plgpu.copy_gmem_to_smem(tokens(k_ref, b, rows, h_kv, seq_first),
                                            k_smem.at[slot], k_ready.at[slot])
                    if dense is not None:
                        load_words(d_ref, d_smem, d_ready, _bh(dense, b, h), partial, slot,
                                   lambda w: (pl.ds(j * (BLOCK // WORD), BLOCK // WORD),
                                              pl.ds(t * BLOCK + w * ROWS, ROWS)))
                    copy_partial(partial, b, h, rows,
                                 n_ka and (ka_ref, ka_smem.at[slot], ka_ready.at[slot]))
                    copy_side(b, h, rows, n_skv and (skv_ref, skv_smem.at[slot], skv_ready.at[slot]))
                    pl.when(g >= NSTAGE)(lambda: plgpu.barrier_wait(v_free.at[slot]))
                    plgpu.copy_gmem_to_smem(tokens(v_ref, b, rows, h_kv, seq_first),
                                            v_smem.at[slot], v_ready.at[slot])
                lax.fori_loop(0, walk.count, issue, None)
                return base + walk.count

            drain(k_free, v_free, q_free, lax.fori_loop(0, mine.count, one, jnp.int32(0)),
                  mine.count)

    scratch = [smem_tiled((2, NWG, ROWS, D), dt), smem_tiled((NSTAGE, BLOCK, D), dt),
               smem_tiled((NSTAGE, BLOCK, D), dt), plgpu.SMEM((NWG, ROWS), F32)]
    scratch += value_scratch(kmask, n_qa, n_ka, n_sq, n_skv, (NWG, ROWS), (NSTAGE, BLOCK),
                             (BLOCK // WORD, ROWS))
    if fill is not None:
        scratch += [plgpu.SMEM((NWG, D), F32), plgpu.Barrier(num_barriers=NWG)]
    scratch += [plgpu.Barrier(num_barriers=2 * NWG), plgpu.Barrier(num_barriers=NSTAGE),
                plgpu.Barrier(num_barriers=NSTAGE),
                plgpu.Barrier(num_arrivals=NWG, num_barriers=NSTAGE),
                plgpu.Barrier(num_arrivals=NWG, num_barriers=NSTAGE),
                plgpu.Barrier(num_arrivals=NWG), plgpu.Barrier(num_barriers=NWG),
                plgpu.Barrier(num_barriers=NSTAGE), plgpu.Barrier(num_barriers=NSTAGE * NWG),
                plgpu.Barrier(num_barriers=NWG), plgpu.Barrier(num_barriers=NSTAGE),
                plgpu.Barrier(num_arrivals=NWG, num_barriers=2)]
    scratch += diagonal_scratch(sd)
    kw = {} if interpret is None else {"interpret": interpret}
    return plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct(q.shape, dt), jax.ShapeDtypeStruct((B, H, S), F32)),
        scratch_types=tuple(scratch),
        grid=(programs,), grid_names=("p",),
        num_threads=NWG + 1, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        **kw,
    )(q, k, v, *lists, *extra)
