"""Masks that need a map built on the device, through dispatch to the block_sparse backend:
documents from an id array (a mask_mod reading score_mod_args) through `fused_attn`, and
the drop-ins' dense boolean masks through `dot_product_attention` and Flax's
`attention_fn` (document, causal and a fully masked row), with GQA.

On CPU the backend's Hopper check is patched to pass and its kernels swapped for the
reference list walks (`IMPLEMENTATION`), so the whole path runs: dispatch, the map
built on the device from the call's arrays, the partial / full lists. With the check
failing, the same calls take block_sparse_xla (the same maps, walked by XLA: cudnn,
which would take a dense mask as a bias first on a GPU, has no extension here); with
that backend out of the preference too, the old path (xla, the mask as a bias).
Forward and gradients against the float64 oracle, plain and jitted, and explain()'s
reasons on all three routes."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fusedattn
from fusedattn import dispatch, score_mods
from fusedattn.backends import block_sparse as backend
from fusedattn.inputs import mask_as_bias
from fusedattn.validation import build_call
from support import oracle
from support import block_sparse_cases as bs_cases
from support.block_sparse_cases import doc_ids, jax_nn_oracle, rel_error

B, S, H, H_KV, D = 2, 256, 4, 2, 64
TOL_OUT, TOL_GRAD = 2e-2, 4e-2  # bf16 against float64 (test_block_sparse_attention's)


ROUTES = ("block_sparse", "block_sparse_xla", "xla")


def _use_route(monkeypatch, route):
    """A CUDA platform on which dispatch takes `route` for the masks below: a Hopper GPU
    (block_sparse, its kernels run as the reference list walks), another GPU
    (block_sparse_xla), or another GPU without block_sparse_xla in the preference."""
    monkeypatch.setenv(dispatch.ENV_PLATFORM, "cuda")
    monkeypatch.setattr(backend, "on_hopper", lambda: route == "block_sparse")
    monkeypatch.setattr(backend, "IMPLEMENTATION", "reference")
    order = dispatch.PREFERENCE["cuda"]
    monkeypatch.setitem(dispatch.PREFERENCE, "cuda", tuple(
        n for n in order if route != "xla" or n != "block_sparse_xla"))
    dispatch.clear_cache()


@pytest.fixture(params=ROUTES)
def route(request, monkeypatch):
    """Yields the backend dispatch takes for a mask (`_use_route`)."""
    _use_route(monkeypatch, request.param)
    yield request.param
    dispatch.clear_cache()


def _qkvo(h_kv=H_KV, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    shapes = ((B, S, H, D), (B, S, h_kv, D), (B, S, h_kv, D), (B, S, H, D))
    return [jax.random.normal(kk, shape, jnp.bfloat16) for kk, shape in zip(keys, shapes)]


def _docs():
    return jnp.asarray(doc_ids(B, S, [S // 8, S // 4, S // 8 + 40]))


def _run(call, q, k, v, do, *extra, jit=False):
    """(out, dq, dk, dv) of call(q, k, v, *extra); jitted with `extra` traced too."""
    fn = jax.jit(call) if jit else call
    out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, *extra), q, k, v)
    return (out, *vjp(do))


def _check(got, want):
    for name, g, w, tol in zip(("out", "dq", "dk", "dv"), got, want,
                               (TOL_OUT, TOL_GRAD, TOL_GRAD, TOL_GRAD)):
        assert g.shape == w.shape, name
        err = rel_error(np.asarray(g, np.float32), w)
        assert err < tol, (name, err)


def _route(plan, route):
    assert plan.chosen == route, str(plan)
    return str(plan)


# ---- documents from an id array through fused_attn --------------------------------------
def same_doc(b, h, i, j, doc):
    return doc[b, i] == doc[b, j]


@pytest.mark.parametrize("jit", [False, True], ids=["plain", "jit"])
def test_documents_from_ids_through_fused_attn(route, jit):
    q, k, v, do = _qkvo()
    doc = _docs()
    plan = fusedattn.explain(q, k, v, mask_mod=same_doc, score_mod_args=(doc,))
    text = _route(plan, route)
    if route != "xla":
        assert "built on the device in every call" in text
        assert "score_mod_args" in text and "known only when it runs" in text
    call = lambda q, k, v, doc: fusedattn.fused_attn(  # noqa: E731
        q, k, v, mask_mod=same_doc, score_mod_args=(doc,))
    got = _run(call, q, k, v, do, doc, jit=jit)
    visible = np.asarray(doc[:, None, :, None] == doc[:, None, None, :])
    _check(got, jax_nn_oracle(q, k, v, do, visible)[:4])


def test_documents_and_causal_through_fused_attn_with_mqa(route):
    q, k, v, do = _qkvo(h_kv=1)
    doc = _docs()
    call = lambda q, k, v, doc: fusedattn.fused_attn(  # noqa: E731
        q, k, v, mask="causal", mask_mod=same_doc, score_mod_args=(doc,))
    _route(fusedattn.explain(q, k, v, mask="causal", mask_mod=same_doc, score_mod_args=(doc,)),
           route)
    got = _run(call, q, k, v, do, doc, jit=True)
    visible = np.asarray(doc[:, None, :, None] == doc[:, None, None, :])
    _check(got, jax_nn_oracle(q, k, v, do, visible, causal=True)[:4])


# ---- score_mods reading arrays (the documents mask above) ----------------------------------------------------------
def doc_scale(s, b, h, i, j, doc, scale):
    return s * scale[doc[b, i]]


def same_doc_of_two(b, h, i, j, doc, _table):
    return doc[b, i] == doc[b, j]


@pytest.mark.parametrize("mask_mod", [same_doc_of_two, None], ids=["documents", "causal-only"])
def test_score_mod_reading_a_learned_table_runs_in_the_kernels(route, mask_mod):
    """A per-document scale (its table learned: the gradient reaches it) with or without
    a mask_mod: cuDNN cannot read by position, so block_sparse runs it."""
    q, k, v, do = _qkvo()
    doc = _docs()
    table = jnp.linspace(0.5, 1.5, int(doc.max()) + 1, dtype=jnp.float32)
    options = dict(mask="causal", score_mod=doc_scale, mask_mod=mask_mod)
    text = _route(fusedattn.explain(q, k, v, score_mod_args=(doc, table), **options), route)
    if route != "xla" and mask_mod is None:
        assert "runs the causal mask" not in text
    call = jax.jit(lambda q, k, v, t: fusedattn.fused_attn(
        q, k, v, score_mod_args=(doc, t), **options))
    out, vjp = jax.vjp(call, q, k, v, table)
    got = vjp(do)
    same = np.asarray(doc[:, None, :, None] == doc[:, None, None, :])
    visible = np.tril(np.ones((S, S), bool)) & (same if mask_mod is not None else True)
    ref_out, _, ref = bs_cases.oracle(q, k, v, np.broadcast_to(visible, (B, H, S, S)), D ** -0.5,
                                      doc_scale, do, args=(doc, table))
    _check((out,) + got[:3], (ref_out,) + tuple(ref[:3]))
    assert rel_error(np.asarray(got[3]), ref[4]) < TOL_GRAD


def test_a_t5_table_runs_here_with_its_gradient(route):
    """A T5 bias table read by q_idx - kv_idx: cuDNN's graph has no gather, so on Hopper
    block_sparse runs it (values per run of diagonals), under causal; output, dq, dk, dv
    and the table's gradient against the float64 oracle."""
    q, k, v, do = _qkvo()
    table = jax.random.normal(jax.random.key(11), (H, 32), jnp.float32)
    t5 = lambda s, b, h, i, j, t: s + t[h, score_mods.t5_bucket(i, j)]  # noqa: E731
    _route(fusedattn.explain(q, k, v, mask="causal", score_mod=t5, score_mod_args=(table,)),
           route)
    call = jax.jit(lambda q, k, v, t: fusedattn.fused_attn(q, k, v, mask="causal", score_mod=t5,
                                                           score_mod_args=(t,)))
    out, vjp = jax.vjp(call, q, k, v, table)
    got = vjp(do)
    visible = np.broadcast_to(np.tril(np.ones((S, S), bool)), (B, H, S, S))
    ref_out, _, ref = bs_cases.oracle(q, k, v, visible, D ** -0.5, t5, do, args=(table,))
    _check((out,) + got[:3], (ref_out,) + tuple(ref[:3]))
    assert rel_error(np.asarray(got[3]), ref[3]) < TOL_GRAD


def test_a_score_mod_alone_stays_with_cudnn_where_cudnn_runs_it(route, monkeypatch):
    """ALiBi slopes read by the head, no mask_mod: cuDNN's graph takes them (here its
    support check is patched to say so), so block_sparse leaves the call to cudnn."""
    monkeypatch.setattr(dispatch.load_backend("cudnn"), "supports", lambda config: None)
    q, k, v, _ = _qkvo()
    alibi = lambda s, b, h, i, j, sl: s + sl[h] * (j - i).astype(s.dtype)  # noqa: E731
    plan = fusedattn.explain(q, k, v, mask="causal", score_mod=alibi,
                             score_mod_args=(jnp.linspace(0.1, 0.5, H),))
    _route(plan, "cudnn")
    if route == "block_sparse":
        assert dict(plan.reasons)["block_sparse"].startswith(
            "cudnn runs this call (faster); block_sparse takes it where cudnn cannot"), str(plan)
    # (named, the kernels run it)
    assert fusedattn.explain(q, k, v, mask="causal", score_mod=alibi, backend="block_sparse",
                             score_mod_args=(jnp.linspace(0.1, 0.5, H),)).chosen == (
        "block_sparse" if route == "block_sparse" else None)


@pytest.mark.parametrize("mask", ["none", "causal"])
def test_a_score_mod_cudnn_refuses_runs_on_the_kernels_not_xla(route, mask):
    """Clipping the scores, whose backward cuDNN's engines refuse, and a rounded position
    term its lowering has no operation for: on Hopper the kernels run them (here cuDNN
    has no extension, so it refuses everything); elsewhere XLA does."""
    q, k, v, do = _qkvo()

    def clip_round(s, b, h, i, j):
        return jnp.clip(s, -1.5, 1.5) + 0.25 * jnp.round(((i - j) % 7).astype(s.dtype) / 3)
    options = dict(score_mod=clip_round, mask=mask)
    _route(fusedattn.explain(q, k, v, **options),
           "block_sparse" if route == "block_sparse" else "xla")
    got = _run(lambda q, k, v: fusedattn.fused_attn(q, k, v, **options), q, k, v, do, jit=True)
    ref = oracle.attention(*(np.asarray(x, np.float64) for x in (q, k, v)), mask=mask,
                           score_mod=clip_round, d_out=np.asarray(do, np.float64))
    _check(got, (ref.out, ref.dq, ref.dk, ref.dv))


def test_a_score_mod_that_reads_no_array_runs_in_the_kernel(route):
    q, k, v, do = _qkvo()
    doc = _docs()
    softcap = lambda s, b, h, i, j, doc: 5.0 * jnp.tanh(s / 5.0)  # noqa: E731
    options = dict(score_mod=softcap, mask_mod=same_doc, score_mod_args=(doc,))
    _route(fusedattn.explain(q, k, v, **options), route)
    got = _run(lambda q, k, v, doc: fusedattn.fused_attn(q, k, v, **dict(
        options, score_mod_args=(doc,))), q, k, v, do, doc, jit=True)
    # (the documents as segment ids: the oracle masks after the score_mod, as the contract)
    ref = oracle.attention(*(np.asarray(x, np.float64) for x in (q, k, v)),
                           q_segment_ids=np.asarray(doc), score_mod=softcap,
                           score_mod_args=(np.asarray(doc),), d_out=np.asarray(do, np.float64))
    _check(got, (ref.out, ref.dq, ref.dk, ref.dv))


def test_arrays_closed_over_are_read_like_args(route):
    """A kernel cannot capture arrays: a mask_mod closing over one has its reads hoisted
    like score_mod_args (documents), or is refused with the reason (a per-head read)."""
    q, k, v, do = _qkvo()
    doc = _docs()
    closure = lambda b, h, i, j: doc[b, i] == doc[b, j]  # noqa: E731
    _route(fusedattn.explain(q, k, v, mask_mod=closure), route)
    got = _run(lambda q, k, v: fusedattn.fused_attn(q, k, v, mask_mod=closure), q, k, v, do,
               jit=True)
    visible = np.asarray(doc[:, None, :, None] == doc[:, None, None, :])
    _check(got, jax_nn_oracle(q, k, v, do, visible)[:4])
    width = jnp.asarray([32, 64, 96, 128], jnp.int32)
    per_head = lambda b, h, i, j: (j <= i) & (i - j < width[h])  # noqa: E731
    plan = fusedattn.explain(q, k, v, mask_mod=per_head)
    assert plan.chosen == "xla"
    if route != "xla":
        assert "head index" in dict(plan.reasons)[route], str(plan)


# ---- the drop-ins' dense boolean masks --------------------------------------------------
def _doc_mask():
    doc = _docs()
    return doc[:, None, :, None] == doc[:, None, None, :]     # [B, 1, T, S]


@pytest.mark.parametrize("jit", [False, True], ids=["plain", "jit"])
def test_document_mask_through_dot_product_attention(route, jit):
    q, k, v, do = _qkvo()
    mask = _doc_mask()
    text = _route(fusedattn.jax_nn.explain(q, k, v, mask=mask), route)
    if route != "xla":
        assert f"dense boolean mask: a block map on {route} " in text
        assert "built on the device in every call from the dense boolean mask" in text
    else:
        assert "dense boolean mask: an additive bias on xla" in text
        assert "block_sparse: its Mosaic GPU kernels need a Hopper GPU" in text
    call = lambda q, k, v, m: fusedattn.dot_product_attention(q, k, v, mask=m)  # noqa: E731
    got = _run(call, q, k, v, do, mask, jit=jit)
    _check(got, jax_nn_oracle(q, k, v, do, np.asarray(mask))[:4])


def test_fully_masked_row_and_causal_through_dot_product_attention(route):
    """Rows that see no key average all values on both routes (block_sparse's forward
    kernel writes the mean itself; the drop-in overwrites the bias route's rows), here
    with is_causal on top."""
    q, k, v, do = _qkvo()
    mask = np.asarray(_doc_mask()).copy()
    mask[:, :, 5] = False                        # row 5 sees nothing
    mask[1, :, 200:, :] = False                  # whole blocks of rows see nothing
    plan = fusedattn.jax_nn.explain(q, k, v, mask=mask, is_causal=True)
    _route(plan, route)
    assert "causal" in plan.config.short()
    assert plan.config.unseen_rows == ("zero" if route == "xla" else "mean")
    call = lambda q, k, v, m: fusedattn.dot_product_attention(  # noqa: E731
        q, k, v, mask=m, is_causal=True)
    got = _run(call, q, k, v, do, jnp.asarray(mask), jit=True)
    want = jax_nn_oracle(q, k, v, do, mask, causal=True)
    _check(got, want[:4])
    out, lse = fusedattn.dot_product_attention(q, k, v, mask=mask, is_causal=True,
                                               return_residual=True)
    assert rel_error(np.asarray(out, np.float32), want[0]) < TOL_OUT
    seen = np.isfinite(want[4]).transpose(0, 2, 1)          # [B, T, H]
    np.testing.assert_allclose(np.asarray(lse, np.float32)[seen],
                               want[4].transpose(0, 2, 1)[seen], atol=5e-2)


def _empty_rows_and_padding():
    """A random mask with rows that see nothing (one row; whole blocks of rows), keys
    padded away from some rows' only visible keys, and padded query rows."""
    mask = np.random.default_rng(4).random((B, 1, S, S)) < 0.3
    mask[:, :, 5] = False
    mask[1, :, 200:] = False
    mask[0, :, 150:170] = False
    mask[0, :, 150:170, 100:110] = True          # hidden by kv length 100 in batch 0
    lengths = dict(query_seq_lengths=jnp.asarray([S, 180], jnp.int32),
                   key_value_seq_lengths=jnp.asarray([100, S], jnp.int32))
    return mask, lengths


def _jax_nn(q, k, v, **options):
    """jax.nn's own XLA path, k / v repeated over each group of query heads."""
    group = q.shape[2] // k.shape[2]
    return jax.nn.dot_product_attention(q, jnp.repeat(k, group, 2), jnp.repeat(v, group, 2),
                                        implementation="xla", **options)


def test_empty_rows_padding_and_causal_against_jax_nn(route):
    """Rows that see no key (the mask, kv padding, is_causal), padded query rows: output
    and gradients as jax.nn's own XLA path, on both routes (padding takes block_sparse)."""
    q, k, v, do = _qkvo()
    mask, lengths = _empty_rows_and_padding()
    plan = fusedattn.jax_nn.explain(q, k, v, mask=mask, is_causal=True, **lengths)
    _route(plan, route)
    assert plan.config.unseen_rows == "zero"    # padded rows give 0: overwritten outside
    ragged = fusedattn.jax_nn.explain(q[:, :-1], k[:, :-1], v[:, :-1], mask=mask[..., :-1, :-1])
    assert ragged.config.unseen_rows == "zero"  # past a block boundary: outside too

    def call(fn):
        return lambda q, k, v, m, ql, kvl: fn(q, k, v, mask=m, is_causal=True,
                                              query_seq_lengths=ql, key_value_seq_lengths=kvl)
    extra = (jnp.asarray(mask), *lengths.values())
    got = _run(call(fusedattn.dot_product_attention), q, k, v, do, *extra, jit=True)
    # jax.nn in float32 (its bf16 result is as far from the truth as ours)
    f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
    want = _run(call(_jax_nn), *f32, *extra)
    _check(got, [np.asarray(x, np.float64) for x in want])
    assert np.all(np.asarray(got[0])[1, 180:] == 0)          # padded query rows


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_residual_of_rows_that_see_no_key_is_jax_nns(route, dtype):
    """return_residual: a row that sees no key (padded query rows too) gets jax.nn's
    log-sum-exp on both routes, though block_sparse's kernels give -inf there and the
    mask as a bias a value shifted by its constant (float16: -inf, as jax.nn's)."""
    q, k, v, _ = (x.astype(dtype) for x in _qkvo())
    mask, lengths = _empty_rows_and_padding()
    options = dict(mask=mask, is_causal=True, **lengths)
    _route(fusedattn.jax_nn.explain(q, k, v, **options), route)
    out, lse = jax.jit(lambda q, k, v: fusedattn.dot_product_attention(
        q, k, v, return_residual=True, **options))(q, k, v)
    want_out, want = _jax_nn(q, k, v, return_residual=True, **options)
    assert lse.dtype == want.dtype == dtype
    lse, want = np.asarray(lse, np.float32), np.asarray(want, np.float32)
    unseen = want < -1e30 if dtype == jnp.bfloat16 else want == -np.inf
    assert unseen[0, 5].all() and unseen[1, 180:].all() and unseen[0, 150:170].all()
    np.testing.assert_array_equal(lse[unseen], want[unseen])
    np.testing.assert_allclose(lse[~unseen], want[~unseen], atol=5e-2)
    assert rel_error(np.asarray(out, np.float32), np.asarray(want_out, np.float64)) < TOL_OUT


def _reductions_over_pairs(fn, *args, t=S, s=S):
    """The reduce_or equations of fn's jaxpr (sub-jaxprs included) over the key axis of
    a boolean [.., T, S] operand: the S^2 pass that finds rows seeing no key."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "reduce_or":
                aval = eqn.invars[0].aval
                if (aval.dtype == jnp.bool_ and aval.shape[-2:] == (t, s)
                        and aval.ndim - 1 in eqn.params["axes"]):
                    found.append(eqn)
            for param in eqn.params.values():
                for sub in param if isinstance(param, (tuple, list)) else (param,):
                    if hasattr(sub, "eqns"):
                        walk(sub)
                    elif hasattr(getattr(sub, "jaxpr", None), "eqns"):
                        walk(sub.jaxpr)
    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


@pytest.mark.parametrize("return_residual", [False, True])
def test_block_sparse_finds_rows_seeing_nothing_without_an_s2_pass(route, return_residual):
    """On block_sparse the rows that see no key come from the kernels' lse (-inf there);
    the bias route keeps its pass over the mask (which shows the check finds one)."""
    q, k, v, do = _qkvo()
    mask, lengths = _empty_rows_and_padding()

    def loss(q, k, v, m):
        out = fusedattn.dot_product_attention(q, k, v, mask=m, is_causal=True,
                                              return_residual=return_residual, **lengths)
        out = out[0] if return_residual else out
        return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32))
    passes = _reductions_over_pairs(jax.value_and_grad(loss, argnums=(0, 1, 2)), q, k, v,
                                    jnp.asarray(mask))
    assert bool(passes) == (route == "xla"), passes


@pytest.mark.parametrize("jit", [False, True], ids=["plain", "jit"])
def test_float_document_mask_through_flax_attention_fn(route, jit):
    """Flax's make_attention_mask gives float masks (non-zero: attend), [B, 1, T, S]."""
    from flax import linen as nn
    from fusedattn import flax as fa
    q, k, v, do = _qkvo()
    mask = nn.make_attention_mask(_docs(), _docs(), pairwise_fn=jnp.equal)
    assert mask.dtype == jnp.float32
    text = _route(fa.explain(q, k, v, mask=mask), route)
    assert (f"a block map on {route} " if route != "xla" else "an additive bias on xla") in text
    call = lambda q, k, v, m: fa.attention_fn(q, k, v, mask=m)  # noqa: E731
    got = _run(call, q, k, v, do, mask, jit=jit)
    _check(got, jax_nn_oracle(q, k, v, do, np.asarray(mask) != 0)[:4])


def test_causal_mask_through_flax_attention_fn(route):
    from flax import linen as nn
    from fusedattn import flax as fa
    q, k, v, do = _qkvo()
    mask = nn.make_causal_mask(jnp.ones((B, S)))
    _route(fa.explain(q, k, v, mask=mask), route)
    got = _run(lambda q, k, v, m: fa.attention_fn(q, k, v, mask=m), q, k, v, do, mask,
               jit=True)
    _check(got, jax_nn_oracle(q, k, v, do, np.asarray(mask) != 0)[:4])


def test_both_routes_agree(monkeypatch):
    """The block map and the bias give the same numbers (bf16 rounding apart). (Here
    block_sparse runs the same walks as block_sparse_xla: one of them stands for both.)"""
    q, k, v, _ = _qkvo(seed=3)
    mask = _doc_mask()
    outs = []
    for route in ("block_sparse_xla", "xla"):
        _use_route(monkeypatch, route)
        assert fusedattn.jax_nn.explain(q, k, v, mask=mask).chosen == route
        outs.append(np.asarray(fusedattn.dot_product_attention(q, k, v, mask=mask), np.float32))
    dispatch.clear_cache()
    assert rel_error(outs[0], outs[1]) < 1e-2


# ---- what block_sparse refuses, and why ---------------------------------------------------
@pytest.mark.parametrize("route", ["block_sparse"], indirect=True)
def test_mask_with_a_bias_runs_as_a_bias(route):
    q, k, v, do = _qkvo()
    mask = _doc_mask()
    bias = 0.1 * jax.random.normal(jax.random.key(7), (1, H, S, S), jnp.float32)
    plan = fusedattn.jax_nn.explain(q, k, v, bias, mask)
    assert plan.chosen == "xla" and "takes no bias" in dict(plan.reasons)["block_sparse"]
    assert plan.config.has_bias and plan.config.has_dense_mask
    assert "not a block map because block_sparse: takes no bias" in str(plan)
    got = _run(lambda q, k, v: fusedattn.dot_product_attention(q, k, v, bias, mask),
               q, k, v, do, jit=True)
    visible = np.asarray(mask)
    ref = oracle.attention(*(np.asarray(x, np.float64) for x in (q, k, v)),
                           bias=np.where(visible, np.asarray(bias, np.float64), -np.inf),
                           d_out=np.asarray(do, np.float64))
    _check(got, (ref.out, ref.dq, ref.dk, ref.dv))


@pytest.mark.parametrize("route", ["block_sparse"], indirect=True)
def test_refusals_name_the_reason(route):
    q, k, v, _ = _qkvo()
    doc = _docs()
    by_sum = lambda s, b, h, i, j, t: s + t[b, (i + j) % 8]  # noqa: E731
    plan = fusedattn.explain(q, k, v, score_mod=by_sum, mask_mod=same_doc,
                             score_mod_args=(doc,))
    assert "depends on both q_idx and kv_idx" in dict(plan.reasons)["block_sparse"]
    by_head = lambda b, h, i, j, t: t[h, i] == t[h, j]  # noqa: E731
    table = jnp.zeros((H, S), jnp.int32)
    plan = fusedattn.explain(q, k, v, mask_mod=by_head, score_mod_args=(table,))
    assert "head index" in dict(plan.reasons)["block_sparse"]
    plan = fusedattn.explain(q.astype(jnp.float32), k.astype(jnp.float32),
                             v.astype(jnp.float32), mask_mod=same_doc, score_mod_args=(doc,))
    assert "dtype float32" in dict(plan.reasons)["block_sparse"]


@pytest.mark.parametrize("route", ["block_sparse"], indirect=True)
def test_supports_is_cached_per_config(route):
    config, _ = build_call(*_qkvo()[:3], mask_mod=same_doc, score_mod_args=(_docs(),))
    backend.args_reason.cache_clear()
    backend.mask_reads.cache_clear()
    for _ in range(3):
        backend.BACKEND.supports(config)
    assert backend.args_reason.cache_info().misses == 1
    assert backend.mask_reads.cache_info().misses == 1


def test_drop_in_explain_names_a_fallback():
    with jax.enable_x64(True):
        x = jnp.zeros((1, 8, 2, 4), jnp.float64)
        assert "jax.nn's own implementation" in fusedattn.jax_nn.explain(x, x, x)
    from fusedattn import flax as fa
    q = jax.ShapeDtypeStruct((1, 8, 2, 64), jnp.bfloat16)
    assert "Flax's own function" in fa.explain(q, q, q, precision="highest")
    assert isinstance(fa.explain(q, q, q, mask=jax.ShapeDtypeStruct((1, 1, 8, 8), jnp.bool_)),
                      dispatch.Plan)


# ---- the mask as a bias: one conversion, jax.nn's constant ---------------------------------
def test_mask_as_bias_is_jax_nns_additive_term():
    q = jnp.zeros((2, 8, 4, 16), jnp.bfloat16)
    mask = jnp.asarray(np.random.default_rng(0).random((2, 1, 8, 8)) < 0.5)
    bias = jnp.ones((1, 4, 8, 8), jnp.float32)
    config, inputs = build_call(q, q, q, bias=bias, dense_mask=mask)
    assert config.dense_mask_shape == (2, 1, 8, 8) and config.bias_shape == (1, 4, 8, 8)
    lowered = config.mask_as_bias()
    assert lowered.bias_shape == (2, 4, 8, 8) and not lowered.has_dense_mask
    folded = mask_as_bias(config, inputs)
    assert folded.dense_mask is None and folded.bias.shape == (2, 4, 8, 8)
    # the term in q's dtype, then in the bias's (as the drop-in always made it)
    big = np.float32(jnp.asarray(-0.7 * float(jnp.finfo(jnp.bfloat16).max), jnp.bfloat16))
    want = np.where(np.asarray(mask), np.float32(1), np.float32(1) + big)
    np.testing.assert_array_equal(np.asarray(folded.bias), np.broadcast_to(want, (2, 4, 8, 8)))
    for name in dispatch.ALL_BACKENDS:
        expected = config if dispatch.takes_dense_mask(name) else lowered
        assert dispatch.takes_dense_mask(name) == name.startswith("block_sparse")
        assert dispatch.config_for(config, name) == expected


@pytest.mark.parametrize("mask, error, words", [
    (jnp.ones((2, 1, 8, 8), jnp.float32), TypeError, "boolean"),
    (jnp.ones((2, 1, 1, 8), jnp.bool_), ValueError, "s_q, s_kv"),
    (jnp.ones((3, 1, 8, 8), jnp.bool_), ValueError, "1|b"),
])
def test_dense_mask_is_validated(mask, error, words):
    q = jnp.zeros((2, 8, 4, 16), jnp.bfloat16)
    with pytest.raises(error, match=words.replace("|", r"\|")):
        build_call(q, q, q, dense_mask=mask)
