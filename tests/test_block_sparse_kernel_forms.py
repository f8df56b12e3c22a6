"""The kernel forms of primitives (`block_sparse.mosaic_ops.FORMS`): what `evaluate`
computes inside a kernel equals what the function computes as written, bit for bit,
on edge values and over generated score_mods and mask_mods with their derivatives.
(On CPU the forms bind ordinary primitives; tests/gpu/test_flex_fuzz_gpu.py runs the
same programs in the kernels.)"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fusedattn.block_sparse import mosaic_ops
from support import flex_fuzz as ff

EDGES = jnp.array([0.0, -0.0, 0.3, -0.3, 0.5, -0.5, 0.7, -0.7, 1.0, -1.0, 1.5, -1.5, 2.5, -2.5,
                  0.49999997, -0.49999997, 8388607.5, -8388607.5, 2.0 ** 24, 3e38, -3e38,
                  np.inf, -np.inf, np.nan, 1e-45, -1e-45], jnp.float32)


def _same(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype.kind == "f":   # the same bits: signed zeros and NaN included
        np.testing.assert_array_equal(np.signbit(got), np.signbit(want))
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(got, want)


def _close(got, want):
    """Equal up to float32 rounding: a function evaluated one primitive at a time
    compiles in other pieces than as written (XLA may contract a product and a sum)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype.kind != "f":
        return np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isinf(got) * np.sign(got), np.isinf(want) * np.sign(want))
    finite = np.isfinite(want)
    scale = np.abs(want[finite]).max(initial=1.0)
    np.testing.assert_allclose(got[finite], want[finite], rtol=4e-6, atol=4e-6 * scale)


@pytest.mark.parametrize("fn", [jnp.floor, jnp.ceil, jnp.isfinite, lambda x: x ** 0,
                                lambda x: x ** 1, lambda x: x ** -1, lambda x: x ** -3,
                                lambda x: ~(x > 0.5), lambda x: jnp.where(True, x, 0.0),
                                lambda x: jnp.where(x > 0, 1.0, x)],
                         ids=["floor", "ceil", "isfinite", "pow0", "pow1", "pow-1", "pow-3",
                              "not", "scalar_select", "scalar_case"])
def test_forms_equal_the_primitives_on_edge_values(fn):
    _same(mosaic_ops.evaluate(fn, EDGES), fn(EDGES))
    x = EDGES[jnp.isfinite(EDGES) & (jnp.abs(EDGES) < 1e30) & (EDGES != 0)]
    if jnp.issubdtype(fn(x).dtype, jnp.floating):   # and the forward-mode derivative
        jvp = lambda x: jax.jvp(fn, (x,), (jnp.ones_like(x),))  # noqa: E731
        for g, w in zip(mosaic_ops.evaluate(jvp, x), jvp(x)):
            _same(g, w)


def test_what_has_a_form_counts_as_evaluable_and_what_fails_to_lay_out_does_not():
    registry = mosaic_ops.lowered()
    for name in ("floor", "ceil", "is_finite", "not", "select_n", "integer_pow", "add_any"):
        assert mosaic_ops.kernel_runs(name) == (registry is None or "round" in registry
                                                or name not in ("floor", "ceil")), name
    for name in mosaic_ops.NO_LAYOUT:
        assert not mosaic_ops.kernel_runs(name), name


def _tiles(rng, program, shape=(8, 16)):
    args = ff.arg_values(rng)
    s = rng.standard_normal(shape).astype(np.float32) * 3
    s[0, :4] = (-0.0, 0.5, -1.5, 2.0)
    q = np.broadcast_to(np.arange(shape[0], dtype=np.int32)[:, None] * 5, shape)
    k = np.broadcast_to(np.arange(shape[1], dtype=np.int32)[None, :] * 3, shape)
    b, h = np.int32(program.index % ff.B), np.int32(program.index % ff.H)
    return jnp.asarray(s), b, h, jnp.asarray(q), jnp.asarray(k), args


@pytest.fixture
def rewrites(monkeypatch):
    """Counts, per primitive, the equations `evaluate` rewrote."""
    counts = {}

    def counted(name, form):
        def rewrite(ins, params):
            out = form.rewrite(ins, params)
            counts[name] = counts.get(name, 0) + (out is not None)
            return out
        return form._replace(rewrite=rewrite)
    monkeypatch.setattr(mosaic_ops, "FORMS", {n: counted(n, f) for n, f in
                                              mosaic_ops.FORMS.items()})
    return counts


def test_generated_programs_evaluate_as_written(rewrites):
    """Each generated score_mod (with its derivative in the score) and mask_mod, on
    tiles of scores and positions, through `evaluate` and as written: the forms of
    `not`, scalar selects and integer powers are in most of them."""
    programs = ff.draw(200, seed=1)
    rng = np.random.default_rng(1)
    checked = 0
    for program in programs:
        score, mask = program.functions()
        s, b, h, q, k, args = _tiles(rng, program)
        with np.errstate(all="ignore"):
            if score is not None:
                try:
                    want = score(s, b, h, q, k, *args)
                except Exception:   # noqa: BLE001  (a form the lowering must refuse)
                    continue
                _close(mosaic_ops.evaluate(score, s, b, h, q, k, *args), want)
                jvp = lambda s: jax.jvp(lambda x: score(x, b, h, q, k, *args),  # noqa: E731
                                        (s,), (jnp.ones_like(s),))
                for g, w in zip(mosaic_ops.evaluate(jvp, s), jvp(s)):
                    _close(g, w)
                checked += 1
            if mask is not None:
                _close(mosaic_ops.evaluate(mask, b, h, q, k, *args), mask(b, h, q, k, *args))
                checked += 1
    assert checked >= 160, checked
    assert all(rewrites.get(n) for n in ("not", "select_n", "integer_pow")), rewrites
