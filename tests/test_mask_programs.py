"""A drop-in's boolean mask computed inside the caller's jit from arrays read per query
row or per key column and from positions runs as a mask_mod over those arrays
(`tracing.mask_program`), with no S^2 mask read.

* The rewrite is checked differentially: generated masks (`support.mask_programs`)
  are traced, rewritten, and the program evaluated on every element (and on scattered
  rows and columns) must equal the mask; two traces give equal programs.
* Whether the mask holds on the diagonal for any arrays' values, where the program
  says so, is checked on the generated masks and named Flax masks.
* Masks it must not rewrite give None: the mask itself passed in, a float product, a
  random draw, a constant table read by both positions.
* The drop-ins, with block_sparse usable (its kernels as the reference list walks):
  Flax's padding mask ANDed with its causal mask, and its document mask from ids in
  any order with a padding flag or without (then every row sees its own key: the
  program knows the mask holds on the diagonal, and no mean of the values is written),
  run as mask_mods (explain() says so, the documents map counts ids per block) with
  outputs and gradients equal to the same mask passed as data and to the float64
  oracle; a prefix-LM mask built in the step runs as row groups; a named backend, or
  no Hopper, keeps the mask. A mask closed over by a `lax.scan` body runs as a mask_mod
  there too; one passed in as an argument gets explain()'s note on where to build it.
  explain() prints the program as an expression over b, h, i, j and its arrays; only
  the plan that runs is logged.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import fusedattn
from fusedattn import dispatch
from fusedattn.backends import block_sparse as backend
from fusedattn.block_sparse import classify
from fusedattn.tracing.mask_program import as_mask_mod
from support.attn_cases import rel_error
from support.block_sparse_cases import jax_nn_oracle
from support.mask_programs import inputs, program

B, N, T, S = 2, 3, 20, 24


def _checked(cases):
    """Per case ``(fn, args)``: (its program and arrays, or None; whether the program
    equals the mask on every element; whether it does on scattered rows and columns),
    all cases traced in one jit (one compilation)."""
    seen = []
    rows = np.random.default_rng(0).permutation(T)[:7].astype(np.int32)
    cols = np.random.default_rng(1).permutation(S)[:5].astype(np.int32)

    def one(fn, args):
        m = fn(*args)
        found = as_mask_mod(m)
        seen.append(found)
        if found is None:
            return jnp.bool_(False), jnp.bool_(False), jnp.bool_(False)
        prog, arrays, _ = found
        grid = [jnp.arange(n, dtype=jnp.int32).reshape([-1 if a == ax else 1 for a in range(4)])
                for ax, n in enumerate(m.shape)]
        whole = prog(*grid, *arrays)
        i, j = jnp.asarray(rows).reshape(1, 1, -1, 1), jnp.asarray(cols).reshape(1, 1, 1, -1)
        some = prog(grid[0], grid[1], i, j, *arrays)
        want = m[:, :, rows][:, :, :, cols]
        d = min(T, S)   # (a program said true on the diagonal must be, for these arrays)
        diagonal = ~found.diagonal | m[:, :, jnp.arange(d), jnp.arange(d)].all()
        return (jnp.asarray(whole.dtype == jnp.bool_) & (jnp.broadcast_to(whole, m.shape) == m).all(),
                (jnp.broadcast_to(some, want.shape) == want).all(), diagonal)
    flags = jax.jit(lambda args: [one(fn, a) for (fn, _), a in zip(cases, args)])(
        [a for _, a in cases])
    return [(f, bool(w), bool(s), bool(d)) for f, (w, s, d) in zip(seen, flags)]


@pytest.mark.parametrize("chunk", range(3))
def test_generated_masks_equal_their_programs(chunk):
    seeds = range(chunk * 50, chunk * 50 + 50)
    cases = [(program(seed, B, N, T, S), inputs(seed, B, T, S)) for seed in seeds]
    results = _checked([(fn, args) for (fn, _), args in cases])
    for seed, ((_, text), _), (found, whole, some, diagonal) in zip(seeds, cases, results):
        assert found is not None, f"seed {seed}: {text} not rewritten"
        assert whole, f"seed {seed}: {text}"
        assert some, f"seed {seed}: {text} (scattered indices)"
        assert diagonal, f"seed {seed}: {text} said true on the diagonal"
    assert any(f.diagonal for f, *_ in results) and not all(f.diagonal for f, *_ in results)


def test_two_traces_give_equal_programs():
    fn, text = program(7, B, N, T, S)
    (a, *_), (b, *_) = _checked([(fn, inputs(7, B, T, S))] * 2)
    assert a[0] == b[0] and hash(a[0]) == hash(b[0]), text


def test_the_program_reads_as_the_mask_it_rewrites():
    """explain() prints the program as an expression over b, h, i, j and its arrays."""
    seg = jnp.zeros((SB, SS), jnp.int32)
    masks = {
        "(a0[b, i] == a0[b, j])": lambda a: nn.make_attention_mask(a, a, jnp.equal),
        "(((a0[b, i] > 0) & (a0[b, j] > 0)) & (i >= j))": lambda a: nn.combine_masks(
            nn.make_attention_mask(a > 0, a > 0), nn.make_causal_mask(a)),
    }
    for text, fn in masks.items():
        found = []
        jax.eval_shape(lambda a: (found.append(as_mask_mod(fn(a).astype(bool))), a)[1], seg)
        assert found[0].program.expression() == text
        assert found[0].program.expression(limit=12) == text[:9] + "..."


@pytest.mark.parametrize("mask,diagonal", [
    (lambda s: nn.make_attention_mask(s, s, jnp.equal), True),
    (lambda s: nn.combine_masks(nn.make_attention_mask(s, s, jnp.equal),
                                nn.make_causal_mask(s)), True),
    (lambda s: nn.combine_masks(nn.make_attention_mask(s, s, jnp.equal),
                                nn.make_attention_mask(s != 0, s != 0)), False),
    (lambda s: nn.make_attention_mask(s > 0, s > 0), False),
    (lambda s: nn.make_attention_mask(s, s, jnp.greater_equal), True),
    (lambda s: nn.make_attention_mask(s, s[:, ::-1], jnp.equal), False),
], ids=["documents", "causal documents", "documents, padding id", "padding", "ids >=",
        "reversed ids"])
def test_the_diagonal_is_known_where_it_holds_for_any_ids(mask, diagonal):
    found = []
    jax.jit(lambda s: found.append(as_mask_mod(mask(s).astype(bool))))(
        jnp.zeros((B, T), jnp.int32))
    assert found[0] is not None and found[0].diagonal == diagonal


def test_constants_read_alike_are_told_apart():
    """Two constant arrays (closed over by a jitted helper: constants of its jaxpr) are
    two arrays, however the host objects holding them come and go; and a float type
    without a zero keeps its conversions."""
    c1 = jnp.arange(T, dtype=jnp.int32)
    c2 = c1 + 3

    @jax.jit
    def offsets(r):
        return (r[:, None, :, None] + c1[None, None, :, None]) == \
            (r[:, None, None, :T] + c2[None, None, None, :])

    def no_zero(r):   # (float8_e8m0fnu has no 0: False becomes 2^-127, then True)
        return (r[:, None, :, None] == r[:, None, None, :T]).astype(
            jnp.float8_e8m0fnu).astype(bool)
    r = jnp.zeros((B, T), jnp.int32)
    for fn in (offsets, no_zero):
        ((found, whole, some, diagonal),) = _checked([(fn, (r,))])
        assert found is not None and whole and some and diagonal, fn.__name__
        assert not found.diagonal, fn.__name__


@pytest.mark.parametrize("name", ["the mask itself", "float product", "random draw",
                                  "constant table"])
def test_masks_read_by_both_positions_are_not_rewritten(name):
    r, c, g = inputs(0, B, T, S)
    table = np.random.default_rng(0).random((T, S)) > 0.5
    fn = {"the mask itself": lambda m, r, c: m,
          "float product": lambda m, r, c: (r[:, None, :, None].astype(jnp.float32) * 0.3 *
                                            c[:, None, None, :].astype(jnp.float32)) > 0.5,
          "random draw": lambda m, r, c: jax.random.bernoulli(jax.random.key(0), 0.5,
                                                              (B, 1, T, S)) & (r[:, None, :, None] > 0),
          "constant table": lambda m, r, c: jnp.asarray(table)[None, None] & (r[:, None, :, None] > 0),
          }[name]
    found = []
    jax.jit(lambda m, r, c: found.append(as_mask_mod(fn(m, r, c))))(
        jnp.ones((B, 1, T, S), bool), r, c)
    assert found == [None]


# -- the drop-ins ----------------------------------------------------------------------

SB, SS, SH, SD = 2, 256, 4, 64
TOL_OUT, TOL_GRAD = 2e-2, 4e-2   # bf16 against float64 (test_block_sparse_dispatch's)


def _qkvo():
    keys = jax.random.split(jax.random.key(3), 4)
    return [jax.random.normal(kk, (SB, SS, SH, SD), jnp.bfloat16) for kk in keys]


def _tokens():
    tok = np.ones((SB, SS), np.int32)
    tok[0, 200:] = 0          # trailing padding
    tok[1, 60:90] = 0         # a gap
    return jnp.asarray(tok)


def _segments():
    seg = np.repeat(np.array([[3, 1, 2, 1], [2, 2, 0, 1]]), SS // 4, axis=1)   # ids in any order
    return jnp.asarray(seg.astype(np.int32))


def flax_padding_causal(q, k, v, tok):
    mask = nn.combine_masks(nn.make_attention_mask(tok > 0, tok > 0), nn.make_causal_mask(tok))
    return fusedattn.flax.attention_fn(q, k, v, mask=mask)


def flax_documents(q, k, v, seg):   # id 0: padding, sees nothing
    mask = nn.combine_masks(nn.make_attention_mask(seg, seg, jnp.equal),
                            nn.make_attention_mask(seg != 0, seg != 0))
    return fusedattn.dot_product_attention(q, k, v, mask=mask.astype(bool))


def flax_packed(q, k, v, seg):   # every id a document: each row sees its own key
    mask = nn.make_attention_mask(seg, seg, jnp.equal)
    return fusedattn.flax.attention_fn(q, k, v, mask=mask)


def _as_data(a, fn):
    if fn is flax_packed:
        return a[:, None, :, None] == a[:, None, None, :]
    if fn is flax_documents:
        return (a[:, None, :, None] == a[:, None, None, :]) & (a != 0)[:, None, :, None] & \
            (a != 0)[:, None, None, :]
    return (a[:, None, :, None] > 0) & (a[:, None, None, :] > 0) & jnp.tril(jnp.ones((SS, SS), bool))


def _plan_in_trace(fn, *args):
    """explain() of the drop-in call inside the same jit trace as the call."""
    found = []

    def traced(q, k, v, a):
        if fn is flax_packed:
            found.append(fusedattn.flax.explain(q, k, v, mask=nn.make_attention_mask(a, a, jnp.equal)))
        elif fn is flax_documents:
            mask = nn.combine_masks(nn.make_attention_mask(a, a, jnp.equal),
                                    nn.make_attention_mask(a != 0, a != 0)).astype(bool)
            found.append(fusedattn.jax_nn.explain(q, k, v, mask=mask))
        else:
            mask = nn.combine_masks(nn.make_attention_mask(a > 0, a > 0), nn.make_causal_mask(a))
            found.append(fusedattn.flax.explain(q, k, v, mask=mask))
        return q
    jax.eval_shape(traced, *args)
    return found[0]


@pytest.mark.parametrize("fn", [flax_padding_causal, flax_documents, flax_packed],
                         ids=lambda f: f.__name__)
def test_dropin_masks_run_as_mask_mods(fn, hopper_reference, monkeypatch):
    q, k, v, do = _qkvo()
    a = _tokens() if fn is flax_padding_causal else _segments()
    plan = _plan_in_trace(fn, q, k, v, a)
    assert plan.chosen == "block_sparse" and "mask_program" in plan.rewritten, str(plan)
    assert not plan.config.has_dense_mask, str(plan)
    # (with every row seeing a key, no kernel writes, nor pass computes, jax.nn's mean)
    assert (plan.config.unseen_rows == "mean") == (fn is not flax_packed), str(plan)
    counted = []
    inner = classify.documents
    monkeypatch.setattr(classify, "documents",
                        lambda t, e: counted.append(inner(t, e)) or counted[-1])

    def run(f, extra):
        return jax.jit(lambda q, k, v, x: jax.vjp(lambda q, k, v: f(q, k, v, x), q, k, v)[1](do)
                       + (f(q, k, v, x),))(q, k, v, extra)
    *grads, out = run(fn, a)
    assert any(c is not None for c in counted), "the map did not count ids"
    data = _as_data(a, fn)
    *grads_data, out_data = run(lambda q, k, v, m: fusedattn.dot_product_attention(
        q, k, v, mask=m), data)
    for name, x, y in zip(("dq", "dk", "dv", "out"), (*grads, out), (*grads_data, out_data)):
        np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32),
                                   atol=1e-6, err_msg=name)
    # against float64, with jax.nn's rule: a row that sees no key averages all values
    want = jax_nn_oracle(q, k, v, do, np.asarray(data))
    for name, x, y, tol in zip(("out", "dq", "dk", "dv"), (out, *grads), want,
                               (TOL_OUT, TOL_GRAD, TOL_GRAD, TOL_GRAD)):
        assert rel_error(np.asarray(x, np.float64), y) < tol, name
    empty = ~np.isfinite(want[4])
    assert empty.any() == (fn is not flax_packed)   # (padded rows see nothing)


def test_a_named_backend_or_no_block_map_backend_keeps_the_mask(hopper_reference, monkeypatch):
    q, k, v, _ = _qkvo()
    seg = _segments()

    def plan(implementation=None):
        found = []

        def traced(q, seg):
            mask = nn.make_attention_mask(seg, seg, jnp.equal).astype(bool)
            found.append(fusedattn.jax_nn.explain(q, q, q, mask=mask,
                                                  implementation=implementation))
            return q
        jax.eval_shape(traced, q, seg)
        return found[0]
    assert plan().chosen == "block_sparse" and not plan().config.has_dense_mask
    named = plan("block_sparse")
    assert named.config.has_dense_mask and "mask_program" not in named.rewritten
    monkeypatch.setattr(backend, "on_hopper", lambda: False)
    dispatch.clear_cache()   # (the same program, its map walked in XLA)
    assert plan().chosen == "block_sparse_xla" and not plan().config.has_dense_mask
    monkeypatch.setitem(dispatch.PREFERENCE, "cuda", tuple(
        n for n in dispatch.PREFERENCE["cuda"] if n != "block_sparse_xla"))
    dispatch.clear_cache()
    assert plan().config.has_dense_mask and plan().chosen == "xla"


def test_a_prefix_mask_built_in_the_step_runs_as_row_groups(hopper_reference):
    q = jnp.zeros((SB, SS, SH, SD), jnp.bfloat16)
    found = []

    def traced(q):
        i, j = jnp.arange(SS)[:, None], jnp.arange(SS)[None, :]
        found.append(fusedattn.jax_nn.explain(q, q, q, mask=(j <= i) | (j < 64)))
        return q
    jax.eval_shape(traced, q)
    assert found[0].groups and "mask_program" in found[0].rewritten, str(found[0])


def test_a_mask_closed_over_by_a_scan_body_runs_as_a_mask_mod(hopper_reference):
    """Layers under `lax.scan` that close over the step's mask: the walk follows it into
    the step's trace, so the mask runs as a mask_mod there too, with outputs and
    gradients equal to the same mask passed in as data (which stays a mask)."""
    q, k, v, do = _qkvo()
    tok = _tokens()
    plans = []

    def step(q, k, v, tok, data):
        mask = nn.combine_masks(nn.make_attention_mask(tok > 0, tok > 0),
                                nn.make_causal_mask(tok)) if data is None else data

        def layers(q, k, v):
            def layer(c, _):
                plans.append(fusedattn.flax.explain(c, k, v, mask=mask))
                return fusedattn.flax.attention_fn(c, k, v, mask=mask), None
            return lax.scan(layer, q, None, length=1)[0]
        out, vjp = jax.vjp(layers, q, k, v)
        return (out, *vjp(do))
    got = jax.jit(step)(q, k, v, tok, None)
    assert "mask_program" in plans[-1].rewritten, str(plans[-1])
    want = jax.jit(step)(q, k, v, tok, _as_data(tok, flax_padding_causal))
    assert plans[-1].config.has_dense_mask, str(plans[-1])
    for name, x, y in zip(("out", "dq", "dk", "dv"), got, want):
        assert np.abs(np.asarray(y, np.float32)).max() > 0, name
        np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32),
                                   atol=1e-6, err_msg=name)


def test_a_mask_passed_in_says_where_to_build_it(hopper_reference):
    """A mask that is an input of the traced function (a jit argument, or a
    jax.checkpoint's) is known only on the device: explain() says how to give its
    structure; a mask built or closed over in the trace, or a named backend, does not."""
    q = jnp.zeros((SB, SS, SH, SD), jnp.bfloat16)
    tok = _tokens()
    found = []

    def look(q, mask, implementation=None):
        found.append(fusedattn.jax_nn.explain(q, q, q, mask=mask,
                                              implementation=implementation).rewritten)
        return q

    def step(q, data, tok):
        built = (tok > 0)[:, None, :, None] & (tok > 0)[:, None, None, :]
        look(q, data)
        jax.checkpoint(look)(q, built)
        look(q, built)
        jax.checkpoint(lambda q: look(q, built))(q)
        look(q, data, "block_sparse")
        look(q, data & (tok > 0)[:, None, :, None])   # (made in the trace, if from an input)
        return q
    jax.eval_shape(step, q, _as_data(tok, flax_padding_causal), tok)
    said = ["input of the function being traced" in r for r in found]
    assert said == [True, True, False, False, False, False], found


@pytest.mark.parametrize("route", ["block_sparse", "block_sparse_xla", "xla"])
def test_only_the_plan_that_runs_is_logged(route, hopper_reference, monkeypatch, caplog):
    """The program's plan, tried first, is logged only where it runs (on a block map:
    block_sparse, or its walks in XLA without a Hopper); the mask's plan only where that
    runs (one line a call, for the config that runs)."""
    if route != "block_sparse":
        monkeypatch.setattr(backend, "on_hopper", lambda: False)
    if route == "xla":
        monkeypatch.setitem(dispatch.PREFERENCE, "cuda", tuple(
            n for n in dispatch.PREFERENCE["cuda"] if n != "block_sparse_xla"))
    dispatch.clear_cache()
    program = route != "xla"
    q = jnp.zeros((SB, SS, SH, SD), jnp.bfloat16)
    with caplog.at_level("INFO", logger="fusedattn"):
        jax.eval_shape(lambda q, t: fusedattn.flax.attention_fn(
            q, q, q, mask=nn.make_attention_mask(t > 0, t > 0)), q, _tokens())
    lines = [r.getMessage() for r in caplog.records if "fusedattn: " in r.getMessage()]
    assert len(lines) == 1, lines
    assert lines[0].endswith(f"-> {route}"), lines
    assert ("traced_mask" in lines[0]) == program and ("bool-mask" in lines[0]) != program, lines
