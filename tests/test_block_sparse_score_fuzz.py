"""Randomly generated score_mods that read arrays, split by `hoisting` (`kernel_score`):
the hoisted values (`split.values`) plus the tile side, on every (b, h) pair, against
the score_mod itself; the pullback `kernel_score.apply` gives the kernels (dx and the
float values' gradients, carried to the args through `split.values`) against
`jax.grad`; and generated score_mods whose reads have no in-kernel form are refused
with the rule named.

The programs come from `support.score_read_fuzz`; every one must split.
Float32 throughout; the tile side must match to a few ulps (it runs the
same primitives), the gradients to float32 summation order.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fusedattn.block_sparse import hoisting, kernel_score
from fusedattn.block_sparse.hoisting import Unsupported
from fusedattn.block_sparse.reference import diagonal_tiles
from support.score_read_fuzz import (ARRAYS, B, F32, H, IDX, L, S_KV, S_Q, SCORE, arg_specs,
                                     difference_program, pick, program, side_int)

N_PROGRAMS, N_GRAD = 150, 40
_FAST = {"xla_backend_optimization_level": 0}  # (the programs are tiny; compiling dominates)


# ---- evaluation ------------------------------------------------------------------------
def _truth(fn, args, score=SCORE):
    return fn(score, *IDX, *args)


def _at(v, bb, hh):
    """A value's words [B|1, H|1, s] at (bb, hh)."""
    return v[bb if v.shape[0] > 1 else 0, hh if v.shape[1] > 1 else 0]


def _tiles(layout, x, r, c):
    """(x, q, kv, row tiles, column tiles) as the kernels see one (b, h) tile.
    "ref": q [S_Q, 1], kv [1, S_KV] with full value tiles (block_sparse.reference);
    "narrow": the same with [S_Q, 1] / [1, S_KV] value tiles; "tile": 2-D tiles with q
    along the rows (forward, dq); "tile_t": q along the columns (the key-major dk/dv)."""
    if layout in ("ref", "narrow"):
        q, kv = jnp.arange(S_Q)[:, None], jnp.arange(S_KV)[None, :]
        if layout == "narrow":
            return x, q, kv, [v[:, None] for v in r], [v[None, :] for v in c]
        full = lambda v: jnp.broadcast_to(v, (S_Q, S_KV))  # noqa: E731
        return x, q, kv, [full(v[:, None]) for v in r], [full(v[None, :]) for v in c]
    shape = (S_Q, S_KV) if layout == "tile" else (S_KV, S_Q)
    qa, ka = (0, 1) if layout == "tile" else (1, 0)
    tile = lambda v, axis: jax.lax.broadcast_in_dim(v, shape, (axis,))  # noqa: E731
    return (x if layout == "tile" else x.T, jax.lax.broadcasted_iota(jnp.int32, shape, qa),
            jax.lax.broadcasted_iota(jnp.int32, shape, ka), [tile(v, qa) for v in r],
            [tile(v, ka) for v in c])


def _q_major(layout, t):
    return t.T if layout == "tile_t" else t


def _kernel_side(split, rows, cols, layout, score=SCORE, diags=None):
    """[B, H, S_Q, S_KV] from the split's tile function, b and h scalars inside."""
    def one(bb, hh):
        x, q, kv, rt, ct = _tiles(layout, score[bb, hh], [_at(v, bb, hh) for v in rows],
                                  [_at(v, bb, hh) for v in cols])
        dt = diagonal_tiles(split.runs, diags, bb, hh, q - kv)
        return _q_major(layout, jnp.broadcast_to(split(x, bb, hh, q, kv, rt, ct, diags=dt),
                                                 x.shape))
    return jax.vmap(jax.vmap(one, (None, 0)), (0, None))(jnp.arange(B), jnp.arange(H))


def _check_values(split, rows, cols):
    assert (len(rows), len(cols)) == (split.n_rows, split.n_cols)
    assert tuple(map(len, split.floats)) == (split.n_rows, split.n_cols)
    for v, n in [(v, S_Q) for v in rows] + [(v, S_KV) for v in cols]:
        assert v.dtype == F32 and v.ndim == 3, (v.dtype, v.shape)
        assert v.shape[0] in (1, B) and v.shape[1] in (1, H) and v.shape[2] == n, v.shape


def _run(make, seeds):
    """Each seed's check: ``make(seed)`` gives (a lowered jit, its args, check(outputs)).
    One compilation per program is most of the time here (op by op is slower still), so
    the compilations run on two threads (XLA releases the GIL) while the next programs
    are traced; the checks run in seed order."""
    with ThreadPoolExecutor(2) as pool:
        jobs = []
        try:
            for seed in seeds:
                try:
                    lowered, args, check = make(seed)
                except (AssertionError, Unsupported) as e:
                    raise AssertionError(f"seed {seed}: {type(e).__name__}: {e}") from None
                jobs.append((seed, pool.submit(lowered.compile, _FAST), args, check))
            for seed, compiled, args, check in jobs:
                try:
                    check(compiled.result()(*args))
                except AssertionError as e:
                    raise AssertionError(f"seed {seed}: {e}") from None
        finally:
            for job in jobs:
                job[1].cancel()


def _forward(seed):
    fn, args = program(seed)
    layouts = ("tile", "tile_t", ("ref", "narrow")[seed % 2])
    split = kernel_score.split(fn, arg_specs(args), B, H, S_Q, S_KV)  # must not raise
    assert split is not None, "the program reads an array: it must split"
    assert hoisting.reason(fn, arg_specs(args), B, H, S_Q, S_KV, hoisting.SCORE) is None
    seen = []

    def run(args):
        rows, cols = split.values(args)
        diags = split.diagonal(args)
        ks = kernel_score.kernel_score(fn, args, B, H, S_Q, S_KV)
        seen.append(ks.fn)
        return (rows, cols, ks.q_values, ks.kv_values, _truth(fn, args),
                [_kernel_side(split, rows, cols, layout, diags=diags) for layout in layouts])

    def check(outputs):
        rows, cols, q_values, kv_values, want, got = outputs
        _check_values(split, rows, cols)
        # kernel_score's own form: the same split, the values stacked per side
        assert seen[0].call is split and (seen[0].q_floats, seen[0].kv_floats) == split.floats
        assert (seen[0].d_floats, seen[0].runs) == (split.d_floats, split.runs)
        for stacked, values in ((q_values, rows), (kv_values, cols)):
            assert (stacked is None) == (not values)
            for i, v in enumerate(values):
                np.testing.assert_array_equal(
                    np.asarray(stacked[:, :, i]).view(np.int32),
                    np.broadcast_to(np.asarray(v), stacked[:, :, i].shape).view(np.int32))
        want = np.broadcast_to(np.asarray(want, np.float32), (B, H, S_Q, S_KV))
        assert np.isfinite(want).all()
        for layout, out in zip(layouts, got):
            np.testing.assert_allclose(np.asarray(out, np.float32), want, rtol=2e-6, atol=2e-6,
                                       err_msg=layout)
    return jax.jit(run).lower(args), (args,), check


@pytest.mark.parametrize("first", range(0, N_PROGRAMS, 50))
def test_random_score_mods_match(first):
    _run(_forward, range(first, first + 50))


def test_the_generator_covers_the_cases():
    """The programs hoist values of every kind (rows, columns, per (b, h); floats and
    integers; with and without the head, the batch), or the fuzzing proves little."""
    seen = set()
    for seed in range(N_PROGRAMS):
        fn, args = program(seed)
        split = kernel_score.split(fn, arg_specs(args), B, H, S_Q, S_KV)
        rows, cols = jax.eval_shape(split.values, args)
        for side, values, floats in (("row", rows, split.floats[0]),
                                     ("col", cols, split.floats[1])):
            for v, f in zip(values, floats):
                seen.update({(side, "float" if f else "int"),
                             (side, "heads" if v.shape[1] > 1 else "no heads"),
                             (side, "batch" if v.shape[0] > 1 else "no batch")})
        seen.add("by position" if split.by_position else "per (b, h) only")
        diags = jax.eval_shape(split.diagonal, args)
        for f in split.d_floats:
            seen.update({("diagonal", "float" if f else "int"),
                         ("diagonal", "heads" if diags.shape[1] > 1 else "no heads"),
                         ("diagonal", "batch" if diags.shape[0] > 1 else "no batch")})
    assert seen == {(side, kind) for side in ("row", "col", "diagonal") for kind in (
        "float", "int", "heads", "no heads", "batch", "no batch")} | {
        "by position", "per (b, h) only"}, seen


# ---- gradients ---------------------------------------------------------------------------
def _pullbacks(split, rows, cols, layout, sides, g, score=SCORE, diags=None):
    """(y, dx [B, H, S_Q, S_KV], [per float row value: its gradient [B, H, S_Q]], [per
    float column value: [B, H, S_KV]], [per float diagonal value: [B, H, K]]) from
    `kernel_score.apply` on each (b, h) tile, the value gradients summed over the tile's
    other axis (a diagonal value's per run) as the kernels do."""
    score_fn = kernel_score.ScoreFn(split, *split.floats, split.d_floats, split.runs)
    q_axis = 0 if layout in ("tile", "ref", "narrow") else 1

    def one(bb, hh):
        x, q, kv, rt, ct = _tiles(layout, score[bb, hh], [_at(v, bb, hh) for v in rows],
                                  [_at(v, bb, hh) for v in cols])
        dt = diagonal_tiles(split.runs, diags, bb, hh, q - kv)
        y, pull = kernel_score.apply(score_fn, x, bb, hh, q, kv, (rt, ct, dt), with_grad=True,
                                     sides=sides)
        dx, dq, dk, dd = pull(_q_major(layout, g[bb, hh]))
        return (_q_major(layout, y), _q_major(layout, dx), [t.sum(1 - q_axis) for t in dq],
                [t.sum(q_axis) for t in dk], [split.runs.sums(t, q - kv) for t in dd])
    return jax.vmap(jax.vmap(one, (None, 0)), (0, None))(jnp.arange(B), jnp.arange(H))


def _cotangents(values, floats, grads):
    """Per value: its gradient summed to the value's [B|1, H|1, s] (zeros for integers)."""
    grads, out = iter(grads), []
    for v, f in zip(values, floats):
        if not f:
            out.append(jnp.zeros_like(v))
            continue
        d = next(grads)
        out.append(d.sum(axis=tuple(a for a in (0, 1) if v.shape[a] == 1), keepdims=True))
    return out


def _rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-6)


GRAD_SEEDS = [s for s in range(N_PROGRAMS) if s % 15 < 4][:N_GRAD]


def _gradients(seed, counts):
    fn, args = program(seed)
    split = kernel_score.split(fn, arg_specs(args), B, H, S_Q, S_KV)
    g = jax.random.normal(jax.random.key(seed), (B, H, S_Q, S_KV), F32)
    # float32 args are differentiated; integer, bool, 16-bit float tables held fixed
    diff = [i for i, a in enumerate(args) if jnp.result_type(a) == F32]
    counts.append(len(diff))

    def with_floats(fargs):
        full = list(args)
        for i, a in zip(diff, fargs):
            full[i] = a
        return full

    def run(fargs):
        def loss(s, *fargs):
            return jnp.sum(g * jnp.broadcast_to(fn(s, *IDX, *with_floats(fargs)), g.shape))
        want = jax.grad(loss, argnums=tuple(range(1 + len(diff))))(SCORE, *fargs)
        want_y = _truth(fn, with_floats(fargs))
        rows, cols = split.values(with_floats(fargs))
        diags = split.diagonal(with_floats(fargs))
        # as the kernels: dq's tile (q along rows) owns the row and diagonal values,
        # dk/dv's key-major tile the column values; and once with all sides on the
        # reference's tile (full value tiles, as the kernels: on "narrow" ones a float16
        # value's gradient would be summed in float16)
        pulls = [_pullbacks(split, rows, cols, "tile", ("q", "d"), g, diags=diags),
                 _pullbacks(split, rows, cols, "tile_t", ("kv",), g, diags=diags),
                 _pullbacks(split, rows, cols, "ref", ("q", "kv", "d"), g, diags=diags)]
        # the value gradients summed to the values, carried to the float args
        _, vjp = jax.vjp(lambda *fa: (split.values(with_floats(fa)),
                                      split.diagonal(with_floats(fa))), *fargs)
        d_diags = None if diags is None else _cotangents(
            [diags[:, :, i] for i in range(diags.shape[2])], split.d_floats, pulls[0][4])
        got = vjp(((_cotangents(rows, split.floats[0], pulls[0][2]),
                    _cotangents(cols, split.floats[1], pulls[1][3])),
                   None if d_diags is None else jnp.stack(d_diags, axis=2)))
        return want, want_y, pulls, got

    def check(outputs):
        want, want_y, pulls, got = outputs
        (y1, dx1, dq1, dk1, dd1), (y2, dx2, dq2, dk2, dd2), (y3, dx3, dq3, dk3, dd3) = pulls
        want_y = np.broadcast_to(np.asarray(want_y, np.float32), g.shape)
        assert not dk1 and not dq2 and not dd2, \
            "a kernel got gradients for the side it does not own"
        assert len(dq3) == sum(split.floats[0]) and len(dk3) == sum(split.floats[1])
        assert len(dd3) == sum(split.d_floats)
        for y, dx in ((y1, dx1), (y2, dx2), (y3, dx3)):
            np.testing.assert_allclose(np.asarray(y), want_y, rtol=2e-6, atol=2e-6)
            assert _rel(dx, want[0]) < 1e-5, ("dx", _rel(dx, want[0]))
        for a, b_ in zip(dq1 + dk2 + dd1, dq3 + dk3 + dd3):
            assert _rel(a, b_) < 1e-5, ("the value gradients by side and both", _rel(a, b_))
        for i, gi, wi in zip(diff, got, want[1:]):
            assert np.isfinite(np.asarray(wi)).all()
            # float32 sums in another order: relative to the gradient's norm
            assert _rel(gi, wi) < 2e-5, (f"the gradient of arg {i}", _rel(gi, wi),
                                         np.asarray(gi), np.asarray(wi))
    return jax.jit(run).lower([args[i] for i in diff]), ([args[i] for i in diff],), check


@pytest.mark.parametrize("part", range(2))
def test_random_score_mod_gradients_match(part):
    counts = []
    _run(lambda seed: _gradients(seed, counts), GRAD_SEEDS[part::2])
    assert sum(n > 0 for n in counts) >= len(counts) * 2 // 3  # most differentiate an arg


# ---- refusals ----------------------------------------------------------------------------
BOTH, BY_SCORE, NOT_ELEMENTWISE = ("depends on both q_idx and kv_idx", "depends on the score",
                                   "is no elementwise operation")


def _bad_term(rng):
    """(term reading the extra [H, L] table t at an index no kernel can hoist, the rule)."""
    ints = ("doc", "pos")
    r, c = side_int(rng, "q", set(ints)), side_int(rng, "kv", set(ints))
    w = float(rng.uniform(0.1, 1.0))
    return pick(rng, (
        # (a function of q - kv is a diagonal read; a sum, a product, 2q - kv are not)
        (lambda e: e["t"][e["h"], (e["q"] + e["kv"]) % L], BOTH),
        (lambda e: e["t"][e["h"], (e["q"] * e["kv"]) % L], BOTH),
        (lambda e: e["t"][e["h"], jnp.clip(2 * e["q"] - e["kv"], 0, L - 1)] * 0.0, BOTH),
        (lambda e: e["t"][e["h"], jnp.abs(e["q"] - e["kv"]) % L] * e["q"].astype(F32)
         + e["t"][e["h"], (jnp.abs(e["q"] - e["kv"]) + e["kv"]) % L], BOTH),
        # q - kv shifted by an iota along the rows: no longer a function of q - kv
        (lambda e: e["t"][e["h"], jnp.clip(e["q"] - e["kv"] + jnp.arange(S_Q)[:, None], 0,
                                           L - 1)], BOTH),
        (lambda e: e["t"][e["h"], (e["doc"][e["b"], e["q"]] + e["doc"][e["b"], e["kv"]]) % L],
         BOTH),
        (lambda e: e["t"][e["h"], jnp.abs(r(e) - c(e)) % L], BOTH),
        (lambda e: e["t"][e["h"], (e["s"] > 0).astype(jnp.int32)], BY_SCORE),
        (lambda e: e["t"][e["h"], jnp.clip((e["s"] * w).astype(jnp.int32), 0, L - 1)],
         BY_SCORE),
        (lambda e: e["t"][e["h"], jnp.where(e["s"] > 0, e["q"], e["kv"])], BY_SCORE),
        # operations no kernel runs (they read nothing: the message must not say "reads")
        (lambda e: -jnp.max(e["s"]) * 0.1, NOT_ELEMENTWISE),
        (lambda e: jnp.cumsum(e["s"] * e["t"][e["h"], e["q"]], axis=-1), NOT_ELEMENTWISE),
        (lambda e: jnp.cumsum(e["t"][e["h"], e["q"]] * e["kv"], axis=-1), NOT_ELEMENTWISE),
        (lambda e: jnp.max(r(e) - c(e), axis=-1, keepdims=True) * 0.5, NOT_ELEMENTWISE),
    ))


def test_random_reads_with_no_in_kernel_form_are_refused():
    rules = set()
    for seed in range(40):
        fn, args = program(seed)
        term, why = _bad_term(np.random.default_rng(10_000 + seed))
        rules.add(why)
        extra = (ARRAYS["doc"], ARRAYS["pos"], ARRAYS["th"])

        def mixed(s, b, h, q, kv, *a, fn=fn, term=term):
            *own, doc, pos, t = a
            return fn(s, b, h, q, kv, *own) + term(dict(s=s, b=b, h=h, q=q, kv=kv, doc=doc,
                                                        pos=pos, t=t))
        specs = arg_specs(args + extra)
        with pytest.raises(Unsupported, match=why) as info:
            kernel_score.split(mixed, specs, B, H, S_Q, S_KV)
        assert "score_mod that reads arrays" in str(info.value), (seed, str(info.value))
        if why == NOT_ELEMENTWISE:
            assert "reads an array" not in str(info.value), (seed, str(info.value))
        assert hoisting.reason(mixed, specs, B, H, S_Q, S_KV, hoisting.SCORE) == str(info.value)
    assert rules == {BOTH, BY_SCORE, NOT_ELEMENTWISE}


# ---- the hoisting bugs this generator found, as plain cases ----------------------------------
def test_bfloat16_values_reach_the_tiles():
    """bfloat16 values are floats (NumPy's issubdtype says not): hoisted as float words."""
    x = ARRAYS["bf16"]
    fn = lambda s, b, h, q, kv, x: s + x[b, q] * x[b, kv]  # noqa: E731  (bfloat16 on the tiles)
    split = kernel_score.split(fn, arg_specs([x]), B, H, S_Q, S_KV)
    assert split.floats == ((True,), (True,))
    rows, cols = split.values([x])
    np.testing.assert_allclose(np.asarray(_kernel_side(split, rows, cols, "tile")),
                               np.asarray(_truth(fn, [x]), np.float32), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.uint8])
def test_float_to_8bit_casts_on_the_tiles_saturate(dtype):
    """As XLA's convert: 150.3 -> int8 127 (through int32 and wrapped it was -106)."""
    t = ARRAYS["tb"]
    fn = lambda s, b, h, q, kv, t: (s * 60).astype(dtype).astype(F32) + t[b, q]  # noqa: E731
    split = kernel_score.split(fn, arg_specs([t]), B, H, S_Q, S_KV)
    rows, cols = split.values([t])
    np.testing.assert_allclose(np.asarray(_kernel_side(split, rows, cols, "tile")),
                               np.asarray(_truth(fn, [t])), rtol=1e-6, atol=1e-6)


def test_operations_on_read_values_are_named():
    """An operation no kernel runs on values that read arrays is named as that operation,
    not as a read (it was "reads an array at an index that depends on the score")."""
    t = ARRAYS["tb"]
    with pytest.raises(Unsupported, match="its cumsum of values of the score is no elementwise"):
        kernel_score.split(lambda s, b, h, q, kv, t: jnp.cumsum(s + t[b, q], axis=-1),
                           arg_specs([t]), B, H, S_Q, S_KV)


# ---- reads by q_idx - kv_idx alone (what runs by diagonals over packed segments) ---------
def _segment_positions(seed):
    """Positions inside random segments of one packed row: (q positions [1, 1, S_Q, 1],
    kv positions [1, 1, 1, S_KV], pairs in one segment [S_Q, S_KV]). The keys are the
    row's first S_KV tokens, so query and key segments are the same."""
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.choice(np.arange(1, S_Q), size=int(rng.integers(1, 4)), replace=False))
    seg = np.searchsorted(cuts, np.arange(S_Q), side="right")
    start = np.concatenate([[0], cuts])[seg]
    pos = np.arange(S_Q) - start
    same = seg[:, None] == seg[None, :S_KV]
    return (jnp.asarray(pos.reshape(1, 1, S_Q, 1), jnp.int32),
            jnp.asarray(pos[:S_KV].reshape(1, 1, 1, S_KV), jnp.int32), same)


@pytest.mark.parametrize("seed", range(60))
def test_by_difference_claims_only_what_packed_segments_keep(seed):
    """`hoisting.by_difference` over generated score_mods: for a program it passes, raw
    positions give the scores that positions inside each segment give, bit for bit, on
    every pair within a segment, for random segments (what running it on raw positions
    over shared packed segments relies on); one with a term of a position alone is
    refused, and so is any of the general generator's programs that reads one."""
    fn, args, spoiled = difference_program(seed)
    claimed = hoisting.by_difference(fn, arg_specs(args), B, H, S_Q, S_KV)
    assert claimed != spoiled, ("spoiled" if spoiled else "pure") + f" program {seed}"
    general, general_args = program(seed)
    if hoisting.by_difference(general, arg_specs(general_args), B, H, S_Q, S_KV):
        fn, args, claimed = general, general_args, True
    if claimed:
        b, h, q, kv = IDX
        raw = np.asarray(fn(SCORE, b, h, q, kv, *args))
        for k in range(3):
            q_pos, kv_pos, same = _segment_positions(1000 * seed + k)
            inside = np.asarray(fn(SCORE, b, h, q_pos, kv_pos, *args))
            np.testing.assert_array_equal(inside[:, :, same], raw[:, :, same])


def test_by_difference_follows_positions_only_along_their_own_axes():
    """A shape change that moves a position onto another axis before the difference
    is a use of its own (its values then pair with other positions)."""
    def moved(s, b, h, q, kv):
        q2 = jnp.broadcast_to(q, (1, 1, S_Q, 2)).reshape(1, 1, 2, S_Q)[..., :S_KV]
        return s + jnp.sum(q2 - kv, axis=2, keepdims=True).astype(F32)
    assert not hoisting.by_difference(moved, [], B, H, S_Q, S_KV)
    assert hoisting.by_difference(lambda s, b, h, q, kv: s * jnp.abs(q - kv).astype(F32),
                                  [], B, H, S_Q, S_KV)
