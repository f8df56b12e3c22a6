"""Block-sparse attention backward as two Pallas Mosaic GPU kernels (Hopper).

`dq` walks the query-major lists (per 128-query tile, its key blocks) and `dkv`
the key-major ones (per 128-key tile, its query blocks), both half a block a step:
the two score tiles, the accumulators and a score_mod's tiles fill the register
budget (at whole blocks a score_mod's tiles spilled registers). One CTA per tile: a
persistent form like the forward's balanced long causal rows worse (docs/decisions.md).
Neither needs atomics, so both are deterministic; adding dq from the dkv kernel with
TMA reduce-adds measured slower (docs/decisions.md).
Each step issues its two score products (S and dP) together, with one wait. In dkv
the two warpgroups take turns on the tensor cores, as in the forward; in dq, whose
step is two products then one, taking turns as well measured slower (docs/decisions.md).
`lse_delta` is ``[B, H, 2, S]`` f32: the base-2 lse (+inf on rows with no key,
so their probabilities are 0) and delta = rowsum(dO * O), computed in XLA.
dk / dv come per query head; the caller sums a GQA group.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .kernel_diagonal import Diagonal, diagonal_scratch, diagonal_words
from .kernel_mask import KernelMask
from .kernel_parts import (BLOCK, F32, NSTAGE, NWG, ROWS, WORD, Lists, bh_index as _bh,
                           batch_tokens, col_vector, cols_of, copy_partial, copy_side, counts,
                           dense_tile, load_words, logits, matmul_acc, matmul_acc2, matmul_t2,
                           rendezvous, row_vector, row_zeros, rows_of, smem_tiled, tile_fns,
                           tokens, value_scratch)

HALF = BLOCK // 2


def _unpack(refs, n_qa, n_ka, has_dense, n_sq, n_skv, n_sd):
    head, refs = refs[:5], list(refs[5:])
    lists, refs = refs[:4], refs[4:]
    qa = refs.pop(0) if n_qa else None
    ka = refs.pop(0) if n_ka else None
    dense = refs.pop(0) if has_dense else None
    sq = refs.pop(0) if n_sq else None
    skv = refs.pop(0) if n_skv else None
    sd = refs.pop(0) if n_sd else None
    return head, lists, (qa, ka, dense, sq, skv, sd), refs


def _row_sums(accs, tiles, floats):
    """Add each float value's gradient tile, summed along the tile's rows, to its
    accumulator (non-float values have none)."""
    tiles = iter(tiles)
    return [acc + next(tiles).sum(axis=1) if yes else acc for acc, yes in zip(accs, floats)]


def _run(body, out_type, scratch, grid, args, interpret):
    kw = {} if interpret is None else {"interpret": interpret}
    return plgpu.kernel(body, out_type=out_type, scratch_types=tuple(scratch), grid=grid,
                        grid_names=("b", "h", "t"), num_threads=NWG + 1, thread_name="wg",
                        compiler_params=plgpu.CompilerParams(approx_math=True), **kw)(*args)


def dq(q, k, v, do, lse_delta, lists, kmask: KernelMask, *, scale, score=None,
       score_values=(None, None, None), seq_first=False, interpret=None):
    """dq [B, S, H, D] in q's dtype (`seq_first`: q, k, v, do and dq [S, B, H, D]); with
    a score's float q values their gradient [B, H, n, S] f32 (zeros for non-float
    values), else None; with float diagonal values theirs [B, H, l, K], else None.
    `lists` are the query-major ones of the map. Each step takes half a key block."""
    (B, S), H, D = batch_tokens(q, seq_first), q.shape[2], q.shape[3]
    group = H // k.shape[2]
    dt = q.dtype
    mb, mh = lists[0].shape[0] > 1, lists[0].shape[1] > 1
    qa, ka, dense = kmask.q_arrays, kmask.kv_arrays, kmask.dense
    sq, skv, sd = score_values
    n_qa, n_ka, n_sq, n_skv, n_sd = counts(kmask, score_values)
    q_floats = score.q_floats if n_sq else ()
    d_values = any(q_floats)
    d_floats = score.d_floats if n_sd else ()
    d_diag = any(d_floats)
    runs = sd.shape[3] if n_sd else 0
    hw = interpret is None
    # Half a key block a step: at whole blocks a score_mod's tiles (positions, its
    # derivative, its values' gradients) spill registers; plain masks run alike at both.
    width = HALF
    per = BLOCK // width
    shape = (ROWS, width)

    def body(*refs):
        (q_ref, k_ref, v_ref, do_ref, ld_ref), list_refs, arrays, refs = \
            _unpack(refs, n_qa, n_ka, dense is not None, n_sq, n_skv, n_sd)
        qa_ref, ka_ref, d_ref, sq_ref, skv_ref, sd_ref = arrays
        dq_ref, *refs = refs
        dsq_ref = refs.pop(0) if d_values else None
        dsd_ref = refs.pop(0) if d_diag else None
        q_smem, do_smem, ld_smem, k_smem, v_smem, *refs = refs
        qa_smem = refs.pop(0) if n_qa else None
        ka_smem = refs.pop(0) if n_ka else None
        d_smem = refs.pop(0) if dense is not None else None
        sq_smem = refs.pop(0) if n_sq else None
        skv_smem = refs.pop(0) if n_skv else None
        dsd_smem = refs.pop(0) if d_diag else None
        if n_sd:   # (last in the scratch)
            *refs, sd_smem, sd_ready = refs
        in_ready, k_ready, v_ready, ka_ready, free, d_ready, skv_ready = refs

        b, h, t, wg = (lax.axis_index(a) for a in ("b", "h", "t", "wg"))
        # CTAs launch with "t" fastest: last query tiles first, so that under causal
        # masks the longest rows start early and the short ones fill the tail.
        t = S // BLOCK - 1 - t
        h_kv = h // group
        walk = Lists(list_refs, b, h, t, mb, mh)
        steps = walk.count * per

        @pl.when(wg < NWG)
        def _compute():
            if hw:
                plgpu.set_max_registers(232, action="increase")
            q0 = t * BLOCK + wg * ROWS
            rows = pl.ds(q0, ROWS)
            qw, dow = q_smem.at[wg], do_smem.at[wg]
            plgpu.copy_gmem_to_smem(tokens(q_ref, b, rows, h, seq_first),
                                    qw, in_ready.at[wg * 4 + 0])
            plgpu.copy_gmem_to_smem(tokens(do_ref, b, rows, h, seq_first),
                                    dow, in_ready.at[wg * 4 + 1])
            plgpu.copy_gmem_to_smem(ld_ref.at[b, h, :, rows], ld_smem.at[wg],
                                    in_ready.at[wg * 4 + 2])
            copy_side(b, h, rows, n_qa and (qa_ref, qa_smem.at[wg], in_ready.at[wg * 4 + 3]),
                      n_sq and (sq_ref, sq_smem.at[wg], in_ready.at[NWG * 4 + wg]))
            if n_qa:
                plgpu.barrier_wait(in_ready.at[wg * 4 + 3])
            if n_sq:
                plgpu.barrier_wait(in_ready.at[NWG * 4 + wg])
            for x in range(3):
                plgpu.barrier_wait(in_ready.at[wg * 4 + x])
            lse = row_vector(ld_smem.at[wg, 0], interpret)
            delta = row_vector(ld_smem.at[wg, 1], interpret)
            q_vals = [row_vector(qa_smem.at[wg, r], interpret) for r in range(n_qa)]
            q_words = [row_vector(sq_smem.at[wg, r], interpret) for r in range(n_sq)]
            diag = n_sd and Diagonal.load(sd_ref, sd_smem, sd_ready, b, h, wg, score.runs,
                                          interpret)
            if d_diag:   # the diagonal values' gradient sums, a row of each run
                diag.clear(dsd_smem.at[wg])

            def step(s_i, carry):
                acc, d_sq = carry
                slot = lax.rem(s_i, NSTAGE)
                j, partial = walk.entry(s_i // per)
                k0 = j * BLOCK + lax.rem(s_i, per) * width
                plgpu.barrier_wait(k_ready.at[slot])
                if n_skv:
                    plgpu.barrier_wait(skv_ready.at[slot])
                plgpu.barrier_wait(v_ready.at[slot])
                s, dp = matmul_t2(qw, k_smem.at[slot], dow, v_smem.at[slot], shape, interpret)
                words = None if dense is None else lambda: dense_tile(
                    d_smem, d_ready, slot, wg, 1, shape, interpret)
                diag_at = diag and (diag, diag.span(q0, k0, shape, 0))
                q_pos, kv_pos, visible, values = tile_fns(
                    kmask, shape, 0, b, h, q0, k0, slot, "q", (q_vals, ka_smem),
                    (q_words, skv_smem, diag_at), words, interpret,
                    ka_ready.at[slot] if n_ka else None)

                s, pull = logits(s, scale=scale, score=score, b=b, h=h, q=q_pos, kv=kv_pos,
                                 values=values, partial=partial, visible=visible,
                                 with_grad=True, sides=("q", "d"))
                p = jnp.exp2(s - rows_of(lse, shape))
                ds = p * (dp - rows_of(delta, shape))
                if pull is not None:
                    ds, g_rows, _, g_diag = pull(ds)
                    if d_values:
                        d_sq = _row_sums(d_sq, g_rows, q_floats)
                    if d_diag:
                        diag.add_row_sums(dsd_smem.at[wg], diag_at[1], g_diag, d_floats)
                acc = matmul_acc(acc, ds.astype(dt), k_smem.at[slot], interpret)
                plgpu.barrier_arrive(free.at[slot])
                return acc, d_sq

            zero_rows = [row_zeros(interpret) for _ in q_floats if d_values]
            acc, d_sq = lax.fori_loop(0, steps, step, (jnp.zeros((ROWS, D), F32), zero_rows))
            qw[...] = (acc * scale).astype(dt)
            for r, x in enumerate(d_sq):   # (the values were read into registers above)
                sq_smem.at[wg, r][...] = x
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(qw, tokens(dq_ref, b, rows, h, seq_first))
            if d_values:
                plgpu.copy_smem_to_gmem(sq_smem.at[wg], dsq_ref.at[b, h, :, rows])
            if d_diag:
                plgpu.copy_smem_to_gmem(dsd_smem.at[wg], dsd_ref.at[b, h, :, :, rows])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == NWG)
        def _tma():
            if hw:
                plgpu.set_max_registers(40, action="decrease")

            def issue(s_i, _):
                slot = lax.rem(s_i, NSTAGE)
                j, partial = walk.entry(s_i // per)
                k0 = j * BLOCK + lax.rem(s_i, per) * width
                keys = pl.ds(k0, width)
                pl.when(s_i >= NSTAGE)(lambda: plgpu.barrier_wait(free.at[slot]))
                plgpu.copy_gmem_to_smem(tokens(k_ref, b, keys, h_kv, seq_first),
                                        k_smem.at[slot], k_ready.at[slot])
                if dense is not None:
                    load_words(d_ref, d_smem, d_ready, _bh(dense, b, h), partial, slot,
                               lambda w: (pl.ds(k0 // WORD, width // WORD),
                                          pl.ds(t * BLOCK + w * ROWS, ROWS)))
                copy_partial(partial, b, h, keys,
                             n_ka and (ka_ref, ka_smem.at[slot], ka_ready.at[slot]))
                copy_side(b, h, keys, n_skv and (skv_ref, skv_smem.at[slot], skv_ready.at[slot]))
                plgpu.copy_gmem_to_smem(tokens(v_ref, b, keys, h_kv, seq_first),
                                        v_smem.at[slot], v_ready.at[slot])
            lax.fori_loop(0, steps, issue, None)
            lax.fori_loop(jnp.maximum(steps - NSTAGE, 0), steps,
                          lambda s_i, _: plgpu.barrier_wait(free.at[lax.rem(s_i, NSTAGE)]), None)

    scratch = [smem_tiled((NWG, ROWS, D), dt), smem_tiled((NWG, ROWS, D), dt),
               plgpu.SMEM((NWG, 2, ROWS), F32),
               smem_tiled((NSTAGE, width, D), dt), smem_tiled((NSTAGE, width, D), dt)]
    scratch += value_scratch(kmask, n_qa, n_ka, n_sq, n_skv, (NWG, ROWS), (NSTAGE, width),
                              (width // WORD, ROWS))
    if d_diag:
        scratch.append(plgpu.SMEM((NWG, n_sd, runs, ROWS), F32))
    scratch += [plgpu.Barrier(num_barriers=NWG * 5), plgpu.Barrier(num_barriers=NSTAGE),
                plgpu.Barrier(num_barriers=NSTAGE), plgpu.Barrier(num_barriers=NSTAGE),
                plgpu.Barrier(num_arrivals=NWG, num_barriers=NSTAGE),
                plgpu.Barrier(num_barriers=NSTAGE * NWG), plgpu.Barrier(num_barriers=NSTAGE)]
    sd = diagonal_words(score, sd) if n_sd else None
    scratch += diagonal_scratch(sd)
    extra = [x for x in (qa, ka, dense, sq, skv, sd) if x is not None]
    out = [jax.ShapeDtypeStruct(q.shape, dt)]
    if d_values:
        out.append(jax.ShapeDtypeStruct((B, H, n_sq, S), F32))
    if d_diag:
        out.append(jax.ShapeDtypeStruct((B, H, n_sd, runs, S), F32))
    got = list(_run(body, tuple(out), scratch, (B, H, S // BLOCK),
                    (q, k, v, do, lse_delta, *lists, *extra), interpret))
    dq_ = got.pop(0)
    d_q = got.pop(0) if d_values else None
    return dq_, d_q, (got.pop(0).sum(-1) if d_diag else None)



def dkv(q, k, v, do, lse_delta, lists, kmask: KernelMask, *, scale, score=None,
        score_values=(None, None, None), dv_add=None, seq_first=False, interpret=None):
    """(dk, dv) [B, S_kv, H, D] per query head, in k's dtype (`seq_first`: every array
    of tokens [S, B, H, D]), and with a score's float
    kv values their gradient [B, H, m, S_kv] f32 (else None); `lists` are the
    key-major ones of the map (q_num_blocks, q_indices, full_q_*). A dense mask term
    has the forward's words (`kernel_parts.WORD`). `dv_add` f32 [B, H, D], if given,
    is added to every key's dv (the gradient of a forward `fill`)."""
    (B, S), H, D = batch_tokens(q, seq_first), q.shape[2], q.shape[3]
    S_kv = batch_tokens(k, seq_first)[1]
    group = H // k.shape[2]
    dt = q.dtype
    mb, mh = lists[0].shape[0] > 1, lists[0].shape[1] > 1
    qa, ka, dense = kmask.q_arrays, kmask.kv_arrays, kmask.dense
    sq, skv, sd = score_values
    n_qa, n_ka, n_sq, n_skv, n_sd = counts(kmask, score_values)
    kv_floats = score.kv_floats if n_skv else ()
    d_values = any(kv_floats)
    hw = interpret is None
    shape = (ROWS, HALF)                  # rows: keys, columns: queries

    def body(*refs):
        (q_ref, k_ref, v_ref, do_ref, ld_ref), list_refs, arrays, refs = \
            _unpack(refs, n_qa, n_ka, dense is not None, n_sq, n_skv, n_sd)
        qa_ref, ka_ref, d_ref, sq_ref, skv_ref, sd_ref = arrays
        add_ref = refs.pop(0) if dv_add is not None else None
        dk_ref, dv_ref, *refs = refs
        dskv_ref = refs.pop(0) if d_values else None
        k_smem, v_smem, q_smem, do_smem, ld_smem, *refs = refs
        qa_smem = refs.pop(0) if n_qa else None
        ka_smem = refs.pop(0) if n_ka else None
        d_smem = refs.pop(0) if dense is not None else None
        sq_smem = refs.pop(0) if n_sq else None
        skv_smem = refs.pop(0) if n_skv else None
        add_smem = refs.pop(0) if dv_add is not None else None
        if n_sd:   # (last in the scratch)
            *refs, sd_smem, sd_ready = refs
        in_ready, q_ready, do_ready, ld_ready, qa_ready, free, d_ready, sq_ready, sched = refs

        b, h, t, wg = (lax.axis_index(a) for a in ("b", "h", "t", "wg"))
        h_kv = h // group
        walk = Lists(list_refs, b, h, t, mb, mh)
        steps = 2 * walk.count                      # two query halves per listed block

        @pl.when(wg < NWG)
        def _compute():
            if hw:   # dk, dv and the two score tiles: at 232 ptxas spilled
                plgpu.set_max_registers(240, action="increase")
            k0 = t * BLOCK + wg * ROWS
            keys = pl.ds(k0, ROWS)
            kw_, vw = k_smem.at[wg], v_smem.at[wg]
            plgpu.copy_gmem_to_smem(tokens(k_ref, b, keys, h_kv, seq_first),
                                    kw_, in_ready.at[wg * 4 + 0])
            plgpu.copy_gmem_to_smem(tokens(v_ref, b, keys, h_kv, seq_first),
                                    vw, in_ready.at[wg * 4 + 1])
            copy_side(b, h, keys, n_ka and (ka_ref, ka_smem.at[wg], in_ready.at[wg * 4 + 2]),
                      n_skv and (skv_ref, skv_smem.at[wg], in_ready.at[wg * 4 + 3]))
            if n_ka:
                plgpu.barrier_wait(in_ready.at[wg * 4 + 2])
            if n_skv:
                plgpu.barrier_wait(in_ready.at[wg * 4 + 3])
            if dv_add is not None:   # waited for after the walk
                plgpu.copy_gmem_to_smem(add_ref.at[b, h], add_smem.at[wg],
                                        in_ready.at[NWG * 4 + wg])
            plgpu.barrier_wait(in_ready.at[wg * 4 + 0])
            plgpu.barrier_wait(in_ready.at[wg * 4 + 1])
            kv_vals = [row_vector(ka_smem.at[wg, r], interpret) for r in range(n_ka)]
            kv_words = [row_vector(skv_smem.at[wg, r], interpret) for r in range(n_skv)]
            diag = n_sd and Diagonal.load(sd_ref, sd_smem, sd_ready, b, h, wg, score.runs,
                                          interpret)
            # The two warpgroups take turns on the tensor cores (as in the forward): one's
            # dS overlaps the other's products (docs/decisions.md).
            sync = lambda: rendezvous(sched)
            if hw:
                pl.when(wg == 1)(sync)

            def step(s_i, carry):
                dk, dv, d_skv = carry
                slot = lax.rem(s_i, NSTAGE)
                j, partial = walk.entry(s_i // 2)
                q0 = j * BLOCK + lax.rem(s_i, 2) * HALF
                plgpu.barrier_wait(q_ready.at[slot])
                plgpu.barrier_wait(ld_ready.at[slot])
                if n_sq:
                    plgpu.barrier_wait(sq_ready.at[slot])
                plgpu.barrier_wait(do_ready.at[slot])
                st, dpt = matmul_t2(kw_, q_smem.at[slot], vw, do_smem.at[slot], shape, interpret,
                                    sync if hw else None)
                words = None if dense is None else lambda: dense_tile(
                    d_smem, d_ready, slot, wg, 0, shape, interpret)
                diag_at = diag and (diag, diag.span(q0, k0, shape, 1))
                q_pos, kv_pos, visible, values = tile_fns(
                    kmask, shape, 1, b, h, q0, k0, slot, "kv", (qa_smem, kv_vals),
                    (sq_smem, kv_words, diag_at), words, interpret,
                    qa_ready.at[slot] if n_qa else None)

                st, pull = logits(st, scale=scale, score=score, b=b, h=h, q=q_pos, kv=kv_pos,
                                  values=values, partial=partial, visible=visible,
                                  with_grad=True, sides=("kv",))
                pt = jnp.exp2(st - cols_of(col_vector(ld_smem.at[slot, 0], interpret), shape))
                dst = pt * (dpt - cols_of(col_vector(ld_smem.at[slot, 1], interpret), shape))
                if pull is not None:
                    dst, _, g_cols, _ = pull(dst)
                    if d_values:
                        d_skv = _row_sums(d_skv, g_cols, kv_floats)
                dst, pt = dst.astype(dt), pt.astype(dt)
                if hw:
                    dk, dv, pt, dst, d_skv = lax.optimization_barrier((dk, dv, pt, dst, d_skv))
                    sync()                                   # our turn on the tensor cores
                dv, dk = matmul_acc2(dv, pt, do_smem.at[slot],
                                     dk, dst, q_smem.at[slot], interpret)
                plgpu.barrier_arrive(free.at[slot])
                return dk, dv, d_skv

            zero = jnp.zeros((ROWS, D), F32)
            zero_rows = [row_zeros(interpret) for _ in kv_floats if d_values]
            dk, dv, d_skv = lax.fori_loop(0, steps, step, (zero, zero, zero_rows))
            if hw:
                pl.when(wg == 0)(sync)
            if dv_add is not None:
                plgpu.barrier_wait(in_ready.at[NWG * 4 + wg])
                dv = dv + cols_of(col_vector(add_smem.at[wg], interpret), dv.shape)
            kw_[...] = (dk * scale).astype(dt)
            vw[...] = dv.astype(dt)
            for r, x in enumerate(d_skv):   # (the values were read into registers above)
                skv_smem.at[wg, r][...] = x
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(kw_, tokens(dk_ref, b, keys, h, seq_first))
            plgpu.copy_smem_to_gmem(vw, tokens(dv_ref, b, keys, h, seq_first))
            if d_values:
                plgpu.copy_smem_to_gmem(skv_smem.at[wg], dskv_ref.at[b, h, :, keys])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == NWG)
        def _tma():
            if hw:
                plgpu.set_max_registers(24, action="decrease")

            def issue(s_i, _):
                slot = lax.rem(s_i, NSTAGE)
                j, partial = walk.entry(s_i // 2)
                rows = pl.ds(j * BLOCK + lax.rem(s_i, 2) * HALF, HALF)
                pl.when(s_i >= NSTAGE)(lambda: plgpu.barrier_wait(free.at[slot]))
                plgpu.copy_gmem_to_smem(tokens(q_ref, b, rows, h, seq_first),
                                        q_smem.at[slot], q_ready.at[slot])
                if dense is not None:
                    load_words(d_ref, d_smem, d_ready, _bh(dense, b, h), partial, slot,
                               lambda w: (pl.ds((t * BLOCK + w * ROWS) // WORD, ROWS // WORD),
                                          rows))
                plgpu.copy_gmem_to_smem(ld_ref.at[b, h, :, rows], ld_smem.at[slot],
                                        ld_ready.at[slot])
                copy_partial(partial, b, h, rows,
                             n_qa and (qa_ref, qa_smem.at[slot], qa_ready.at[slot]))
                copy_side(b, h, rows, n_sq and (sq_ref, sq_smem.at[slot], sq_ready.at[slot]))
                plgpu.copy_gmem_to_smem(tokens(do_ref, b, rows, h, seq_first),
                                        do_smem.at[slot], do_ready.at[slot])
            lax.fori_loop(0, steps, issue, None)
            lax.fori_loop(jnp.maximum(steps - NSTAGE, 0), steps,
                          lambda s_i, _: plgpu.barrier_wait(free.at[lax.rem(s_i, NSTAGE)]), None)

    scratch = [smem_tiled((NWG, ROWS, D), dt), smem_tiled((NWG, ROWS, D), dt),
               smem_tiled((NSTAGE, HALF, D), dt), smem_tiled((NSTAGE, HALF, D), dt),
               plgpu.SMEM((NSTAGE, 2, HALF), F32)]
    scratch += value_scratch(kmask, n_qa, n_ka, n_sq, n_skv, (NSTAGE, HALF), (NWG, ROWS),
                              (ROWS // WORD, HALF))
    if dv_add is not None:
        scratch.append(plgpu.SMEM((NWG, D), F32))
    scratch += [plgpu.Barrier(num_barriers=NWG * 5), plgpu.Barrier(num_barriers=NSTAGE),
                plgpu.Barrier(num_barriers=NSTAGE), plgpu.Barrier(num_barriers=NSTAGE),
                plgpu.Barrier(num_barriers=NSTAGE),
                plgpu.Barrier(num_arrivals=NWG, num_barriers=NSTAGE),
                plgpu.Barrier(num_barriers=NSTAGE * NWG), plgpu.Barrier(num_barriers=NSTAGE),
                plgpu.Barrier(num_arrivals=NWG)]
    sd = diagonal_words(score, sd) if n_sd else None
    scratch += diagonal_scratch(sd)
    extra = [x for x in (qa, ka, dense, sq, skv, sd, dv_add) if x is not None]
    out = jax.ShapeDtypeStruct((S_kv, B, H, D) if seq_first else (B, S_kv, H, D), dt)
    outs = (out, out) + ((jax.ShapeDtypeStruct((B, H, n_skv, S_kv), F32),) if d_values else ())
    got = _run(body, outs, scratch, (B, H, S_kv // BLOCK),
               (q, k, v, do, lse_delta, *lists, *extra), interpret)
    return got[0], got[1], (got[2] if d_values else None)
