"""The kernel forms of primitives (`block_sparse.mosaic_ops.FORMS`): what `evaluate`
computes inside a kernel equals what the function computes as written, bit for bit,
on edge values and over generated score_mods and mask_mods with their derivatives, and
binds none of the forms the warpgroup lowering fails on (`_unlowerable`). On CPU the
forms bind ordinary primitives; tests/gpu/test_flex_fuzz_gpu.py runs programs of the
same generator in the kernels, and tests/gpu/test_block_sparse_gpu.py the forms."""
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
    if got.dtype.itemsize == 2 and got.dtype.kind == "V" or got.dtype == np.float16:
        got, want = got.astype(np.float32), want.astype(np.float32)   # (exactly)
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


def _unlowerable(fn, *args, rewritten=True):
    """The equations `evaluate(fn, *args)` (or, not `rewritten`, `fn` as written) binds
    that the Mosaic GPU warpgroup lowering fails on (each a compile error on the GPU
    before its form)."""
    bad = []

    def walk(jaxpr):
        for e in jaxpr.eqns:
            name, ins = e.primitive.name, [v.aval for v in e.invars]
            out = e.outvars[0].aval
            if any(k in e.params for k in ("jaxpr", "call_jaxpr")):
                sub = e.params.get("jaxpr", e.params.get("call_jaxpr"))
                walk(getattr(sub, "jaxpr", sub))
            elif (name in ("floor", "ceil", "is_finite", "add_any")
                  or name in mosaic_ops.NO_LAYOUT
                  or name == "not" and out.dtype == jnp.bool_
                  or name == "convert_element_type" and out.dtype == jnp.bool_
                  and ins[0].dtype != jnp.bool_
                  or name in ("max", "min") and out.dtype == jnp.bool_
                  or name == "select_n" and (len(ins) != 3 or ins[0].dtype != jnp.bool_
                                             or any(a.shape != out.shape for a in ins))
                  or name == "integer_pow" and (e.params["y"] < 2 and e.params["y"] != -1)
                  or name in ("exp", "log", "sin", "cos", "tanh", "round")
                  and ins[0].dtype in (jnp.bfloat16, jnp.float16)):
                bad.append(f"{name} {[str(a) for a in ins]} {e.params}")
    traced = (lambda *a: mosaic_ops.evaluate(fn, *a)) if rewritten else fn
    walk(jax.make_jaxpr(traced)(*args).jaxpr)
    return bad


I32 = jnp.arange(-4, 5, dtype=jnp.int32)
EDGE_CASES = {
    "floor": (jnp.floor, EDGES), "ceil": (jnp.ceil, EDGES), "isfinite": (jnp.isfinite, EDGES),
    "floor_bf16": (jnp.floor, EDGES.astype(jnp.bfloat16)),
    "ceil_f16": (jnp.ceil, EDGES.astype(jnp.float16)),
    "exp_bf16": (jnp.exp, EDGES.astype(jnp.bfloat16)),
    "sin_f16": (jnp.sin, EDGES.astype(jnp.float16)),
    "pow0": (lambda x: x ** 0, EDGES), "pow1": (lambda x: x ** 1, EDGES),
    "pow-1": (lambda x: x ** -1, EDGES), "pow-3": (lambda x: x ** -3, EDGES),
    "pow0_int": (lambda x: x ** 0, I32), "pow1_int": (lambda x: x ** 1, I32),
    "not": (lambda x: ~(x > 0.5), EDGES), "not_int": (lambda x: ~x, I32),
    "to_bool": (lambda x: x.astype(bool), EDGES), "int_to_bool": (lambda x: x.astype(bool), I32),
    "bool_max_min": (lambda x: jnp.maximum(x > 0, x < -1) ^ jnp.minimum(x > 1, x < 2), EDGES),
    "scalar_select": (lambda x: jnp.where(True, x, 0.0), EDGES),
    "scalar_case": (lambda x: jnp.where(x > 0, 1.0, x), EDGES),
    "select_by_int": (lambda x: jax.lax.select_n(I32 % 3, x[:9], 2 * x[:9], -x[:9]), EDGES),
}


@pytest.mark.parametrize("name", EDGE_CASES)
def test_forms_equal_the_primitives_on_edge_values(name):
    fn, x = EDGE_CASES[name]
    _same(mosaic_ops.evaluate(fn, x), fn(x))
    assert _unlowerable(fn, x) == []
    x = x[jnp.isfinite(x) & (jnp.abs(x) < 1e4) & (x != 0)] \
        if jnp.issubdtype(x.dtype, jnp.floating) else x
    if jnp.issubdtype(fn(x).dtype, jnp.floating):   # and the forward-mode derivative
        jvp = lambda x: jax.jvp(fn, (x,), (jnp.ones_like(x),))  # noqa: E731
        for g, w in zip(mosaic_ops.evaluate(jvp, x), jvp(x)):
            _same(g, w)
        assert _unlowerable(jvp, x) == []


@pytest.mark.parametrize("name", ["floor", "isfinite", "not", "to_bool", "bool_max_min",
                                  "scalar_select", "select_by_int", "pow0", "pow-3",
                                  "exp_bf16"])
def test_the_checker_finds_what_the_lowering_fails_on_as_written(name):
    fn, x = EDGE_CASES[name]
    assert _unlowerable(fn, x, rewritten=False), name


@pytest.mark.parametrize("round_lowers", [True, False])
def test_what_has_a_form_counts_as_evaluable_and_what_fails_to_lay_out_does_not(
        round_lowers, monkeypatch):
    registry = mosaic_ops.lowered()
    if registry is None:
        pytest.fail("this JAX's Mosaic GPU lowering registry cannot be read")
    if not round_lowers:
        monkeypatch.setattr(mosaic_ops, "lowered", lambda: registry - {"round"})
    for name in ("floor", "ceil"):
        assert mosaic_ops.kernel_runs(name) == round_lowers, name
    for name in ("is_finite", "not", "select_n", "integer_pow", "add_any", "max"):
        assert mosaic_ops.kernel_runs(name), name
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
    `not`, scalar selects and integer powers are in many of them. Those the kernels
    take (no primitive `missing`) bind nothing the lowering fails on."""
    programs = ff.draw(200, seed=0)   # (the GPU fuzzer's first 100 among them)
    rng = np.random.default_rng(0)
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
                refused = mosaic_ops.missing(score, s, b, h, q, k, *args, derivative_of=0)
                assert refused or _unlowerable(score, s, b, h, q, k, *args) == [], \
                    program.describe()
                jvp = lambda s: jax.jvp(lambda x: score(x, b, h, q, k, *args),  # noqa: E731
                                        (s,), (jnp.ones_like(s),))
                for g, w in zip(mosaic_ops.evaluate(jvp, s), jvp(s)):
                    _close(g, w)
                assert refused or _unlowerable(jvp, s) == [], program.describe()
                checked += 1
            if mask is not None:
                _close(mosaic_ops.evaluate(mask, b, h, q, k, *args), mask(b, h, q, k, *args))
                assert mosaic_ops.missing(mask, b, h, q, k, *args) or \
                    _unlowerable(mask, b, h, q, k, *args) == [], program.describe()
                checked += 1
    assert checked >= 160, checked
    assert all(rewrites.get(n) for n in ("not", "select_n", "integer_pow")), rewrites
