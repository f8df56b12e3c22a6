"""A drop-in's boolean mask whose value is known at trace time runs as the built-in mask
it equals.

* `folding.host_value` is checked differentially: generated programs of exact
  primitives over ``iota`` (integer arithmetic, comparisons, boolean logic, selects,
  shape changes, jnp library calls) are evaluated on the host inside a jit trace and
  compared with the values the compiled program computes; values that depend on an
  input, a random number, an inexact primitive or another transformation's tracer
  give None. A mask closed over by a jit, a `lax.scan` body or a `jax.checkpoint` is
  followed into the enclosing trace (so is Flax's `nn.scan` of a broadcast mask); one
  passed in as an argument is not (Flax's `nn.remat`: explain() says so).
* `recognise.dense_form` against an exhaustive search of the built-in forms.
* The drop-ins: Flax's ``make_causal_mask`` and ``jnp.tril`` inside jit are planned
  as ``mask="causal"`` (explain() says so) with outputs and gradients equal to the
  mask run as a mask; masks that are not built-in, or a named backend, keep the mask.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import fusedattn
from fusedattn import jax_nn
from fusedattn.block_sparse import recognise
from fusedattn.tracing.folding import host_value
from support.folding_programs import program
from support.generated_masks import check_forms

S = 24


def _folded(fn, *args):
    """(host_value of fn's result inside a jit trace, the compiled program's result)."""
    seen = []

    def traced(*a):
        out = fn(*a)
        seen.append(host_value(out))
        return out
    compiled = np.asarray(jax.jit(traced)(*args))
    return seen[0], compiled


@pytest.mark.parametrize("chunk", range(4))
def test_host_value_of_generated_programs_equals_the_compiled_value(chunk):
    x = jnp.ones((S + 3,))
    for seed in range(chunk * 50, chunk * 50 + 50):
        fn, text = program(seed, S)
        host, compiled = _folded(fn, x)
        assert host is not None, f"seed {seed}: {text} not evaluated"
        assert host.dtype == compiled.dtype and np.array_equal(host, compiled), \
            f"seed {seed}: {text}"


def test_host_value_of_flax_and_jnp_masks():
    x = jnp.ones((3, S))
    for fn in (lambda x: nn.make_causal_mask(jnp.ones(x.shape), dtype=jnp.bool_),
               lambda x: nn.make_causal_mask(x).astype(bool),
               lambda x: jnp.tril(jnp.ones((S, S), bool)),
               lambda x: nn.combine_masks(nn.make_causal_mask(jnp.ones(x.shape)),
                                          jnp.ones((1, 1, S, S), bool)).astype(bool)):
        host, compiled = _folded(fn, x)
        assert host is not None and np.array_equal(host, compiled)


@pytest.mark.parametrize("case", ["input", "random", "exp", "float_add"])
def test_host_value_refuses_what_it_cannot_know_exactly(case):
    x = jnp.arange(S, dtype=jnp.float32)
    i = jnp.arange(S)
    fns = {
        "input": lambda x: i[:, None] <= x[None, :],
        "random": lambda x: jax.random.bernoulli(jax.random.key(0), 0.5, (S, S)),
        "exp": lambda x: jnp.exp(i.astype(jnp.float32))[:, None] > i[None, :],
        "float_add": lambda x: (i.astype(jnp.float32) + 0.1)[:, None] > i[None, :],
    }
    host, _ = _folded(fns[case], x)
    assert host is None


def _inner(how, fn, m, x):
    """fn(m, x) traced inside a jit, a lax.scan body or a jax.checkpoint, with m closed
    over (or, "argument", passed to a jax.checkpoint as an argument)."""
    if how == "jit":
        return jax.jit(lambda y: fn(m, y))(x)
    if how == "scan":
        return lax.scan(lambda c, _: (fn(m, c), None), x, None, length=2)[0]
    if how == "checkpoint":
        return jax.checkpoint(lambda y: fn(m, y))(x)
    return jax.checkpoint(fn)(m, x)


@pytest.mark.parametrize("how", ["jit", "scan", "checkpoint", "argument"])
def test_host_value_follows_a_closed_over_mask_into_the_enclosing_trace(how):
    """A mask made in the step and closed over by an inner function is known there;
    one computed from the step's input, or passed in as an argument, is not."""
    i = jnp.arange(S)
    seen = []

    def look(m, y):
        seen.append(host_value(~m))
        whole = host_value(m)   # (the closed-over constant itself)
        assert (whole is None) == (seen[-1] is None)
        return y

    @jax.jit
    def step(x):
        _inner(how, look, i[:, None] <= i[None, :], x)
        return _inner(how, look, i[:, None] <= x.astype(jnp.int32)[None, :], x)
    step(jnp.arange(S, dtype=jnp.float32))
    if how == "argument":
        assert all(v is None for v in seen)
        return
    assert np.array_equal(seen[0], ~np.tri(S, dtype=bool).T), how
    assert all(v is None for v in seen[1:]), how


def test_host_value_under_grad_and_of_numpy():
    m = np.tri(4, dtype=bool)
    assert host_value(m) is m
    seen = []

    def loss(p, x):
        seen.append(host_value(nn.make_causal_mask(jnp.ones(x.shape), dtype=jnp.bool_)))
        return (p * x).sum()
    jax.jit(jax.grad(loss))(1.0, jnp.ones((2, 5)))
    assert seen[0] is not None and np.array_equal(seen[0][0, 0], np.tri(5, dtype=bool))
    assert host_value(jnp.ones(3)) is None   # a device array: not copied to the host


@pytest.mark.parametrize("chunk", range(4))
def test_dense_form_against_exhaustive_search(chunk):
    check_forms(lambda fn, s_q, s_kv, m: recognise.dense_form(m),
                range(chunk * 60, chunk * 60 + 60))


def test_host_value_reduces_a_large_mask_inside_xla():
    # a [64, 1, 2048, 2048] causal mask: 2^28 booleans, reduced inside XLA's program
    seen = []

    def f(x):
        mask = nn.make_causal_mask(jnp.ones((64, 2048)), dtype=jnp.bool_)
        seen.append(host_value(mask, reduce=jax_nn._first_and_same))
        return x
    jax.jit(f)(1.0)
    first, same = seen[0]
    assert bool(same) and np.array_equal(first, np.tri(2048, dtype=bool))


def _qkv(b=2, t=S, n=2, d=16, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    return [jax.random.normal(k, (b, t, n, d), jnp.float32) for k in ks]


def _plan_and_grads(make_mask, fn, monkeypatch, **options):
    """(the plan of a drop-in call inside jit, the line `_known_mask` gave the call `fn`
    made, its output and q / k / v gradients)."""
    q, k, v = _qkv()
    plans, notes = [], []
    known = jax_nn._known_mask
    monkeypatch.setattr(jax_nn, "_known_mask",
                        lambda *a: (lambda r: (notes.append(r[3]), r)[1])(known(*a)))

    def loss(q, k, v):
        m = make_mask(q)
        plans.append(jax_nn.masked_plan(q, k, v, mask=m, **options))
        out = fn(q, k, v, m)
        return (out * jnp.cos(out)).sum(), out
    grads, out = jax.jit(jax.grad(loss, (0, 1, 2), has_aux=True))(q, k, v)
    return plans[0], notes[-1], out, grads


def _expect(fn, mask, **options):
    q, k, v = _qkv()

    def loss(q, k, v):
        out = fn(q, k, v, mask)
        return (out * jnp.cos(out)).sum(), out
    return jax.grad(loss, (0, 1, 2), has_aux=True)(q, k, v)


def _jax_nn(**options):
    return lambda q, k, v, m: fusedattn.dot_product_attention(q, k, v, mask=m, **options)


CAUSAL_MASKS = {
    "flax_make_causal_mask": lambda q: nn.make_causal_mask(jnp.ones(q.shape[:2]),
                                                           dtype=jnp.bool_),
    "jnp_tril": lambda q: jnp.tril(jnp.ones((S, S), bool)),
    "iota_compare": lambda q: (lax.broadcasted_iota(jnp.int32, (1, 1, S, S), 3)
                               <= lax.broadcasted_iota(jnp.int32, (1, 1, S, S), 2)),
}


@pytest.mark.parametrize("name", sorted(CAUSAL_MASKS))
def test_known_causal_mask_runs_as_causal(name, monkeypatch):
    plan, note, out, grads = _plan_and_grads(CAUSAL_MASKS[name], _jax_nn(), monkeypatch)
    assert plan.config.mask == "causal" and not plan.config.has_dense_mask
    assert "the mask equals mask='causal' on every pair" in str(plan) and note
    (g_want, out_want) = _expect(_jax_nn(is_causal=True), None)
    np.testing.assert_allclose(out, out_want, atol=1e-6)
    for g, w in zip(grads, g_want):
        np.testing.assert_allclose(g, w, atol=1e-5)


def test_known_window_mask_with_is_causal_and_flax(monkeypatch):
    band = lambda q: jnp.abs(jnp.arange(S)[:, None] - jnp.arange(S)[None, :]) <= 3
    plan, note, out, _ = _plan_and_grads(band, _jax_nn(is_causal=True), monkeypatch,
                                         is_causal=True)
    assert plan.config.mask == "causal" and plan.config.window == (3, 0)
    assert "mask='causal', window=(3, 0)" in note
    _, want = _expect(_jax_nn(), jnp.tril(band(None)))
    np.testing.assert_allclose(out, want, atol=1e-6)
    flax_fn = lambda q, k, v, m: fusedattn.flax.attention_fn(q, k, v, mask=m)
    _, note, out, grads = _plan_and_grads(band, flax_fn, monkeypatch)
    assert "mask='none', window=(3, 3)" in note   # (the Flax call's own rewrite)
    g_want, want = _expect(lambda q, k, v, m: nn.dot_product_attention(q, k, v, mask=m),
                           band(None))
    np.testing.assert_allclose(out, want, atol=1e-5)
    for g, w in zip(grads, g_want):
        np.testing.assert_allclose(g, w, atol=1e-4)


@pytest.mark.parametrize("t,lengths", [(18, None), (18, (16, 10)), (12, (16, 10))])
def test_one_sided_forms_with_lengths_and_unequal_sequences(t, lengths):
    # `j <= i + 2` is window=(-1, 2), `j >= i - 3` window=(3, -1): an unbounded side
    ks = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(ks[0], (2, t, 2, 16))
    k, v = (jax.random.normal(x, (2, 16, 2, 16)) for x in ks[1:])
    i, j = np.arange(t)[:, None], np.arange(16)[None, :]
    kv_len = None if lengths is None else jnp.asarray(lengths)
    for mask in (j <= i + 2, j >= i - 3):
        run = lambda impl: fusedattn.dot_product_attention(
            q, k, v, mask=mask, key_value_seq_lengths=kv_len, implementation=impl)
        assert jax_nn._known_mask(mask, False, None, (2, 2, t, 16), "auto")[3]
        np.testing.assert_allclose(run(None), run("xla"), atol=1e-6)


def test_a_mask_jax_nn_refuses_is_still_refused():
    q = jnp.ones((2, S, 2, 16))
    with pytest.raises(ValueError):
        fusedattn.dot_product_attention(q, q, q, mask=np.ones((3, 1, S, S), bool))


@pytest.mark.parametrize("case", ["not_builtin", "empty_row", "input", "named_backend",
                                  "one_batch_entry_differs"])
def test_masks_that_stay_masks(case, monkeypatch):
    tri = lambda q: jnp.tril(jnp.ones((S, S), bool))
    make, options = {
        "not_builtin": (lambda q: tri(q) & (jnp.arange(S)[None, :] % 3 != 1), {}),
        "empty_row": (lambda q: tri(q) & (jnp.arange(S)[:, None] != 5), {}),
        "input": (lambda q: tri(q) & (q[0, :, 0, :1] > -10), {}),
        "named_backend": (tri, {"implementation": "xla"}),
        "one_batch_entry_differs": (lambda q: tri(q)[None, None] & (
            jnp.arange(2)[:, None, None, None] + jnp.arange(S)[:, None] != S), {}),
    }[case]
    backend = {"backend": "xla"} if options else {}
    plan, note, out, _ = _plan_and_grads(make, _jax_nn(**options), monkeypatch, **backend)
    assert plan.config.has_dense_mask and plan.config.mask == "none"
    assert "the mask equals" not in str(plan) and not note


def test_a_numpy_mask_is_recognised_by_explain_and_by_the_call(monkeypatch):
    q = jax.ShapeDtypeStruct((2, S, 2, 16), jnp.bfloat16)
    tri = np.tri(S, dtype=bool)
    plan = fusedattn.flax.explain(q, q, q, mask=tri[None, None])
    assert plan.config.mask == "causal" and "the mask equals mask='causal'" in str(plan)
    assert jax_nn.explain(q, q, q, mask=tri).config.mask == "causal"
    notes = []
    known = jax_nn._known_mask
    monkeypatch.setattr(jax_nn, "_known_mask",
                        lambda *a: (lambda r: (notes.append(r[3]), r)[1])(known(*a)))
    x = jnp.ones((2, S, 2, 16), jnp.float32)
    fusedattn.flax.attention_fn(x, x, x, mask=tri[None, None].astype(np.float32))
    fusedattn.dot_product_attention(x, x, x, mask=tri)
    assert len(notes) == 2 and all("mask='causal'" in n for n in notes)


def test_flax_scan_closes_over_its_broadcast_mask_and_remat_takes_it_as_an_argument():
    """Flax's `nn.scan` closes its scan body over broadcast inputs, so the step's
    `make_causal_mask` is followed into the step and runs as mask="causal"; `nn.remat`
    passes its inputs as arguments, so there the mask stays a mask and explain() says so."""
    b, s, e = 2, 32, 16
    plans = []

    def attention(query, key, value, mask=None):
        if type(query).__name__ == "DynamicJaxprTracer":   # (not Flax's probing trace)
            plans.append(fusedattn.flax.explain(query, key, value, mask=mask))
        return fusedattn.flax.attention_fn(query, key, value, mask=mask)

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, mask):
            return x + nn.MultiHeadDotProductAttention(num_heads=2,
                                                       attention_fn=attention)(x, mask=mask), None

    class Model(nn.Module):
        scan: bool

        @nn.compact
        def __call__(self, x):
            mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
            if self.scan:
                return nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                               in_axes=nn.broadcast, length=2)()(x, mask)[0]
            return nn.remat(Block)()(x, mask)[0]
    x = jnp.ones((b, s, e))
    for scan in (True, False):
        params = jax.eval_shape(Model(scan).init, jax.random.key(0), x)
        plans.clear()
        jax.eval_shape(Model(scan).apply, params, x)
        assert plans, scan
        if scan:
            assert all(p.config.mask == "causal" and not p.config.has_dense_mask
                       for p in plans), plans[0]
        else:
            assert all(p.config.has_dense_mask and "input of the function being traced"
                       in p.rewritten for p in plans), plans[0]
