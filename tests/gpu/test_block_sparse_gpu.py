"""The block-sparse Mosaic GPU kernels (forward, dq, dkv) against the float64
oracle: every mask family of `support.block_sparse_cases`, with and without a
score_mod, GQA and MHA, d 64 and 128, bf16 and fp16. Needs a Hopper GPU."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from support.block_sparse_cases import (FAMILIES, PACKED, SCORE_VALUE_MODS, block_map,
                                        check_packed, dense_visibility, doc_ids, in_layout,
                                        oracle, packed_case, rel_error, score_value_args)
from fusedattn import block_sparse as bs
from fusedattn.block_sparse import kernel_bwd_fused
from fusedattn.block_sparse.attention import (block_sparse_attention,
                                              block_sparse_attention_with_lse,
                                              choose_implementation)
from fusedattn.block_sparse.documents import Documents

pytestmark = pytest.mark.gpu

B, S = 2, 512


def _inputs(h, h_kv, d, dtype, seed=0, s=S):
    keys = jax.random.split(jax.random.key(seed), 4)
    return [jax.random.normal(kk, (B, s, hh, d), dtype)
            for kk, hh in zip(keys, (h, h_kv, h_kv, h))]


def _gradients(q, k, v, do, bm, score_mod=None, unseen_rows="zero", deterministic=False,
               lower=False):
    fn = jax.jit(jax.grad(lambda q, k, v: jnp.sum(
        block_sparse_attention(q, k, v, bm, score_mod=score_mod, unseen_rows=unseen_rows,
                               deterministic=deterministic)
        .astype(jnp.float32) * do.astype(jnp.float32)), argnums=(0, 1, 2)))
    return fn.lower(q, k, v).as_text() if lower else fn(q, k, v)


def _check(family, h, h_kv, d, dtype, score_mod=None, s=S, unseen_rows="zero"):
    q, k, v, do = _inputs(h, h_kv, d, dtype, s=s)
    if choose_implementation(q) != "mosaic":
        pytest.skip("the Mosaic GPU kernels need a Hopper GPU")
    _check_map(block_map(family, B, h, s), q, k, v, do, score_mod, unseen_rows)


def _check_map(bm, q, k, v, do, score_mod=None, unseen_rows="zero", deterministic=False):
    h, s, d = q.shape[2], q.shape[1], q.shape[3]
    out, lse = jax.jit(lambda q, k, v: block_sparse_attention_with_lse(
        q, k, v, bm, score_mod=score_mod, unseen_rows=unseen_rows))(q, k, v)
    grads = _gradients(q, k, v, do, bm, score_mod, unseen_rows, deterministic)
    ref_out, ref_lse, ref_grads = oracle(q, k, v, dense_visibility(bm, B, h, s), d ** -0.5,
                                         score_mod, do, unseen_rows=unseen_rows)
    lse = np.asarray(lse)
    finite = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(lse), finite), "rows without keys must give lse -inf"
    assert np.all(lse[~finite] == -np.inf)
    assert np.abs(lse[finite] - ref_lse[finite]).max() < 2e-2
    if unseen_rows == "zero":
        unseen = np.broadcast_to(~finite.transpose(0, 2, 1)[..., None], out.shape)
        assert np.all(np.asarray(out, np.float32)[unseen] == 0)
    assert rel_error(out, ref_out) < 2e-2
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert rel_error(g, r) < 4e-2, name


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("d", [64, 128])
def test_families_gqa(family, d):
    _check(family, 4, 2, d, jnp.bfloat16)


@pytest.mark.parametrize("family", FAMILIES)
def test_lengths_past_a_block_boundary(family):
    """s = 300: padded to whole blocks inside, the key padding masked in the last block."""
    _check(family, 4, 2, 128, jnp.bfloat16, s=300)


@pytest.mark.parametrize("family", ["documents", "documents_mask_mod"])
def test_more_tiles_than_sms(family):
    """The persistent forward walks several tiles a CTA (b2 h8 s2048: 256 query tiles),
    carrying its stages' barrier phases from tile to tile, while mask arrays load for
    partial blocks only (`kernel_parts.copy_partial`)."""
    _check(family, 8, 4, 128, jnp.bfloat16, s=2048)


@pytest.mark.parametrize("s", [S, 300])
def test_unseen_rows_take_the_mean_of_the_values(s):
    """unseen_rows="mean": the forward kernel writes the mean of v to rows that see no
    key, and the dk / dv kernel adds that mean's gradient to every key's dv."""
    _check("random_dense", 4, 2, 128, jnp.bfloat16, s=s, unseen_rows="mean")


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("on", [0, 1])
def test_gated_token_sum_kernel(masked, on):
    """The Mosaic GPU kernel of `unseen_rows.gated_token_sum` against numpy: the sum of
    every token, or of the unseen rows' (lse2 -inf), and zeros with the flag off."""
    from fusedattn.block_sparse import unseen_rows
    x = _inputs(4, 4, 128, jnp.bfloat16, s=1024)[0]
    if choose_implementation(x) != "mosaic":
        pytest.skip("the Mosaic GPU kernels need a Hopper GPU")
    lse2 = None
    want = np.asarray(x, np.float64)
    if masked:
        lse2 = jnp.where(jax.random.bernoulli(jax.random.key(1), 0.2, (B, 4, 1024)), -jnp.inf, 1.0)
        want = np.where(np.isinf(np.asarray(lse2)).transpose(0, 2, 1)[..., None], want, 0)
    got = jax.jit(lambda x, f, l: unseen_rows.gated_token_sum(x, f, l, kernel=True))(
        x, jnp.asarray([on], jnp.int32), lse2)
    np.testing.assert_allclose(np.asarray(got), want.sum(1) * on, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("cut", [False, True])
def test_unseen_rows_under_a_device_flag(cut):
    """A dense mask passed to the step: whether a row may see no key is a flag on the
    device (`unseen_rows.gate`), and the mean of v and its gradient are summed by the
    Pallas kernel only when it is set. Documents of whole blocks (flag 0: every row
    sees its own block); with some rows' keys cut away (flag 1: they see none)."""
    from fusedattn.block_sparse import unseen_rows
    q, k, v, do = _inputs(4, 2, 128, jnp.bfloat16)
    if choose_implementation(q) != "mosaic":
        pytest.skip("the Mosaic GPU kernels need a Hopper GPU")
    ids = doc_ids(B, S, [128, 256, 128])
    visible = np.broadcast_to((ids[:, :, None] == ids[:, None, :])[:, None], (B, 4, S, S)).copy()
    if cut:
        visible[:, :, 200:203] = False

    @jax.jit
    def step(q, k, v, do, mask):
        bm = bs.from_dense_mask(mask)
        out, vjp = jax.vjp(lambda q, k, v: block_sparse_attention(
            q, k, v, bm, unseen_rows="mean"), q, k, v)
        return (out,) + vjp(do) + (unseen_rows.gate(bm, False),)

    out, dq, dk, dv, flag = step(q, k, v, do, jnp.asarray(visible))
    assert int(flag[0]) == cut
    ref_out, _, ref_grads = oracle(q, k, v, visible, 128 ** -0.5, None, do, unseen_rows="mean")
    assert rel_error(out, ref_out) < 2e-2
    for name, g, r in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads):
        assert rel_error(g, r) < 4e-2, name


@pytest.mark.parametrize("family", ["causal", "documents", "random_dense"])
def test_backward_is_deterministic(family):
    """With deterministic=True dq and dk / dv walk their own lists with no atomics (where
    the fused kernel would run too: documents, a dense mask): the same bits run after run."""
    q, k, v, do = _inputs(4, 2, 128, jnp.bfloat16)
    if choose_implementation(q) != "mosaic":
        pytest.skip("the Mosaic GPU kernels need a Hopper GPU")
    bm = block_map(family, B, 4, S)
    assert kernel_bwd_fused.TARGET not in _gradients(q, k, v, do, bm, deterministic=True,
                                                     lower=True)
    first, second = (_gradients(q, k, v, do, bm, deterministic=True) for _ in range(2))
    for a, b in zip(first, second):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def _fused_inputs(dtype, s):
    """q, k, v, dO (GQA 4 / 2, d 128) for the fused backward, or a skip with the one
    refusal expected beside a non-Hopper GPU: an extension built without CUTLASS."""
    q, k, v, do = _inputs(4, 2, 128, dtype, s=s)
    if choose_implementation(q) != "mosaic":
        pytest.skip("the Mosaic GPU kernels need a Hopper GPU")
    why = kernel_bwd_fused.reason(q, seq_first=False, implementation="mosaic")
    if why is not None:
        assert "was built without" in why, why
        pytest.skip(why)
    return q, k, v, do


def _documents_map(case, s):
    ids = jnp.asarray(doc_ids(B, s, [s // 8, s // 4, s // 8 + 40]))
    if case == "segment ids":
        return bs.from_segment_ids(ids)
    if case == "segment ids differing by row":   # (each row its own words and lists)
        return bs.from_segment_ids(jnp.stack([jnp.roll(ids[i], 37 * i) for i in range(B)]))
    if case == "segment ids of one row for every row":
        return bs.from_segment_ids(ids[:1])
    if case == "segment ids with padding":   # (whole rows of padding: unseen, 0)
        return bs.from_segment_ids(jnp.where(ids % 3 == 0, 0, ids), pad_id=0)
    # flex's documents mask_mod and its padding test, the ids read as an array
    return bs.block_map(lambda b_, h_, i, j, d: (d[b_, i] == d[b_, j]) & (d[b_, i] % 3 != 0),
                        B, 4, s, s, args=(ids,))


@pytest.mark.parametrize("case", ["segment ids", "segment ids differing by row",
                                  "segment ids of one row for every row",
                                  "segment ids with padding",
                                  "mask_mod over ids with a padding test"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("s", [S, 300])
def test_documents_backward_runs_the_fused_kernel(case, dtype, s):
    """A documents mask alone takes the backward of one kernel (`kernel_bwd_fused`):
    against the float64 oracle, GQA, lengths past a block boundary, padding."""
    q, k, v, do = _fused_inputs(dtype, s)
    bm = _documents_map(case, s)
    assert kernel_bwd_fused.TARGET in _gradients(q, k, v, do, bm, lower=True)
    _check_map(bm, q, k, v, do)
    _check_map(bm, q, k, v, do, deterministic=True)   # (the Mosaic kernels, same mask)


@pytest.mark.parametrize("bad, message", [
    ("dv_add", "dv_add must be [B, H, 128]"), ("s_kv", "s_kv_real must be in [1, S_kv]"),
    ("full lists", "the full lists must match the partial ones"),
    ("dtype", "q must be bfloat16 or float16")])
def test_the_fused_kernel_refuses_bad_buffers_with_an_error(bad, message):
    """The native handler checks every buffer before it launches: a mismatch reaches
    Python as an error naming the rule, not a fault."""
    q, k, v, do = _fused_inputs(jnp.bfloat16, S)
    if bad == "dtype":
        q, k, v, do = (x.astype(jnp.float32) for x in (q, k, v, do))
    ids = jnp.asarray(doc_ids(B, S, [100, 200, 212]))
    bm = bs.from_segment_ids(ids)
    lists = [jnp.asarray(x, jnp.int32) for x in (bm.q_num_blocks, bm.q_indices,
                                                 bm.full_q_num_blocks, bm.full_q_indices)]
    if bad == "full lists":
        lists[3] = lists[3][..., :1]
    q_words, kv_words = kernel_bwd_fused.words(Documents(ids, ids, None, None), S, S)
    lse_delta = jnp.zeros((B, q.shape[2], 2, S), jnp.float32)
    dv_add = jnp.zeros((B, q.shape[2], 64 if bad == "dv_add" else 128), jnp.float32)
    with pytest.raises(jax.errors.JaxRuntimeError, match=re.escape(message)):
        jax.block_until_ready(kernel_bwd_fused.backward(
            q, k, v, do, lse_delta, lists, q_words, kv_words, None, dv_add, scale=0.1,
            s_kv=S + 1 if bad == "s_kv" else S))


def _dense_map(case, s, h):
    rng = np.random.default_rng(3)
    if case == "random per head":   # partial blocks everywhere, each head its own bits
        m = rng.random((B, h, s, s)) < 0.3
    elif case == "documents of one row for the batch":
        ids = doc_ids(1, s, [s // 8, s // 4, s // 8 + 40])
        m = (ids[:, :, None] == ids[:, None, :])[:, None]
    else:   # "rows that see no key": their mean's gradient added to dv in the kernel,
        # and a whole query block no key block visits (its dq stays zero)
        m = rng.random((B, 1, s, s)) < 0.5
        m[:, :, 5:9] = False
        m[:, :, 128:256] = False
    return bs.from_dense_mask(jnp.asarray(m))


@pytest.mark.parametrize("case", ["random per head", "documents of one row for the batch",
                                  "rows that see no key"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("s", [S, 300])
def test_dense_mask_backward_runs_the_fused_kernel(case, dtype, s):
    """A dense mask alone takes the backward of one kernel, reading its packed bits in
    partial blocks: against the float64 oracle, GQA, lengths past a block boundary,
    jax.nn's mean for unseen rows (and, with deterministic=True, the Mosaic kernels)."""
    q, k, v, do = _fused_inputs(dtype, s)
    bm = _dense_map(case, s, 4)
    unseen = "mean" if case == "rows that see no key" else "zero"
    assert kernel_bwd_fused.TARGET in _gradients(q, k, v, do, bm, unseen_rows=unseen,
                                                 lower=True)
    _check_map(bm, q, k, v, do, unseen_rows=unseen)
    _check_map(bm, q, k, v, do, unseen_rows=unseen, deterministic=True)


@pytest.mark.parametrize("family", ["sliding_window", "documents", "random_dense"])
def test_mha_fp16(family):
    _check(family, 2, 2, 128, jnp.float16)


@pytest.mark.parametrize("family", ["causal", "documents"])
def test_score_mod(family):
    rel = lambda s, b, h, i, j: s + 0.01 * (i - j).astype(s.dtype)
    _check(family, 4, 2, 128, jnp.bfloat16, score_mod=rel)


def test_softcap_score_mod():
    cap = lambda s, b, h, i, j: 5.0 * jnp.tanh(s / 5.0)
    _check("sliding_window", 4, 4, 64, jnp.bfloat16, score_mod=cap)


def _thirds(s, i, j):
    """s, s / 2 or -s as (i - j) % 3 is 0, 1 or 2: a three-way select by an integer
    (lax.select_n takes equal shapes: a score_mod also sees a scalar score)."""
    shape = jnp.broadcast_shapes(jnp.shape(s), jnp.shape(i), jnp.shape(j))
    which, s = jnp.broadcast_to((i - j) % 3, shape), jnp.broadcast_to(s, shape)
    return jax.lax.select_n(which, s, 0.5 * s, -s)


@pytest.mark.parametrize("score_mod", [
    # floor and ceil (kernel forms from round) of scores of either sign, where rounding
    # in their place would move half the logits by 1 / 4
    lambda s, b, h, i, j: s + 0.25 * jnp.floor(4.0 * s) - 0.25 * jnp.ceil(2.0 * s - 0.5),
    # a boolean not, a scalar predicate and case, a select by an integer, bool max
    lambda s, b, h, i, j: jnp.where(~(i == j) | (h > 1), s, s - 1.0) + jnp.where(h > 2, 0.5, s)
    + _thirds(s, i, j) * jnp.maximum(i > j + 5, h == 0),
    # s ** -2 (and -3 in its derivative), is_finite where exp(12 s) overflows for a few
    # percent of the scores, a 16-bit sine computed in float32
    lambda s, b, h, i, j: s + 0.5 * (jnp.abs(s) + 1.0) ** -2
    + 2.0 * jnp.isfinite(jnp.exp(12.0 * s)) + jnp.sin(s.astype(jnp.bfloat16)).astype(s.dtype),
], ids=["floor_ceil", "not_selects_bool_max", "integer_pow_is_finite_bf16_sin"])
def test_kernel_forms_run_in_the_kernels(score_mod):
    """Primitives the kernels evaluate through a kernel form (`mosaic_ops.FORMS`), in a
    score_mod and its derivative, against the float64 oracle."""
    _check("sliding_window", 4, 2, 128, jnp.bfloat16, score_mod=score_mod)


def test_a_mask_mod_with_kernel_forms_runs_on_the_kernels():
    """floor of negative and positive quotients, a boolean not, a conversion to bool."""
    plan = _check_mask_mod("blocks by floor, at odd distances, and the diagonal",
                           lambda b, h, i, j: (jnp.floor((i - 200) / 96.0)
                                               == jnp.floor((j - 200) / 96.0))
                           & ~((i - j + 1) % 2).astype(bool) | (i == j), {})
    assert plan.chosen == "block_sparse", str(plan)


@pytest.mark.parametrize("name, mask_mod, options", [
    ("sliding window with a global first key",
     lambda b, h, i, j: ((j <= i) & (i - j < 128)) | (j == 0), {}),
    ("documents of 128 and causal", lambda b, h, i, j: i // 128 == j // 128,
     dict(mask="causal")),
    ("sliding window and 4 sink keys over 300 tokens",
     lambda b, h, i, j: ((j <= i) & (i - j < 100)) | (j < 4), dict(s=300)),
])
def test_fused_attn_runs_mask_mods_on_the_block_sparse_kernels(name, mask_mod, options):
    """fused_attn's dispatch picks block_sparse for a mask_mod of positions on Hopper,
    explain() gives its block map, and forward and gradients match the float64 oracle."""
    plan = _check_mask_mod(name, mask_mod, options)
    assert plan.chosen == "block_sparse" and not plan.rewritten, str(plan)
    assert "block map" in str(plan), str(plan)


@pytest.mark.parametrize("name, mask_mod, options", [
    ("sliding window", lambda b, h, i, j: (j <= i) & (i - j < 128), {}),
    ("sliding window over 300 tokens", lambda b, h, i, j: (j <= i) & (i - j < 100), dict(s=300)),
    ("band over longer keys", lambda b, h, i, j: (j <= i + 64) & (i + 64 - j < 200),
     dict(s_kv=576)),
])
def test_fused_attn_runs_built_in_mask_mods_as_the_built_in_mask(name, mask_mod, options):
    """A mask_mod equal to a built-in mask on every pair runs as that mask, on the
    vendor kernel a measurement picks (cuDNN or FA3), and matches the float64 oracle."""
    plan = _check_mask_mod(name, mask_mod, options)
    assert plan.rewritten and plan.chosen in ("cudnn", "flash"), str(plan)


@pytest.mark.parametrize("name, mask_mod, options", [
    ("prefix-LM", lambda b, h, i, j: (j <= i) | (j < 128), {}),
    ("prefix-LM over 300 tokens", lambda b, h, i, j: (j <= i) | (j < 100), dict(s=300)),
    ("prefix over longer keys", lambda b, h, i, j: (j <= i + 64) | (j < 200), dict(s_kv=576)),
])
def test_fused_attn_runs_prefix_lm_as_a_call_per_run_of_rows(name, mask_mod, options):
    """Prefix-LM's rows are two built-in masks (the prefix unmasked, the rest
    bottom-right causal): in a training step each runs on the vendor kernel a
    measurement picks, and the rows put together match the float64 oracle; a call
    without a gradient runs the block-sparse kernels over the whole map."""
    plan = _check_mask_mod(name, mask_mod, options)
    assert plan.strategy == "row_groups", str(plan)
    assert plan._runs() and set(plan._runs()) <= {"cudnn", "flash"}, str(plan)
    assert plan.inference is not None and plan.inference.chosen == "block_sparse", str(plan)


def _check_mask_mod(name, mask_mod, options):
    """explain() of fused_attn with `mask_mod`, after its forward and gradients are
    checked against the float64 oracle (b2 h4/2 d128 bf16, s 512 unless given)."""
    import fusedattn
    from support import attn_cases as ac
    from fusedattn.score_mods import Masked
    options = dict(options)
    s = options.pop("s", 512)
    s_kv = options.pop("s_kv", s)
    case = ac.Case(b=2, s_q=s, s_kv=s_kv, h_q=4, h_kv=2, d_qk=128, d_v=128,
                   dtype="bfloat16", score_mod=Masked(None, mask_mod), **options)
    built = ac.build(case)
    plan = fusedattn.explain(built.q, built.k, built.v, **built.options())
    if choose_implementation(built.q) != "mosaic":
        pytest.skip("the Mosaic GPU kernels need a Hopper GPU")
    out, vjp = jax.jit(lambda q, k, v: jax.vjp(
        lambda *a: fusedattn.fused_attn(*a, **built.options()), q, k, v))(
            built.q, built.k, built.v)
    dq, dk, dv = vjp(built.d_out)
    # (a call without a gradient may run another route: `Plan.inference`)
    alone = jax.jit(lambda q, k, v: fusedattn.fused_attn(q, k, v, **built.options()))(
        built.q, built.k, built.v)
    ref = ac.oracle_for(built)
    tol = ac.TOLERANCE["bfloat16"]
    for what, got, want in (("out", out, ref.out), ("dq", dq, ref.dq), ("dk", dk, ref.dk),
                            ("dv", dv, ref.dv), ("out without a gradient", alone, ref.out)):
        error = ac.rel_error(np.asarray(jnp.asarray(got, jnp.float32), np.float64), want)
        assert error < tol, (name, what, error)
    return plan


def _doc_mask_mod(b, h, i, j, doc):
    return doc[b, i] == doc[b, j]


@pytest.mark.parametrize("layout", ["sbhd", "bs3hd", "sbhd_sb2hd"])
def test_dispatch_runs_other_layouts_on_the_kernels(layout):
    """Sequence-first and packed q, k, v (documents from ids through fused_attn) run on
    the block_sparse kernels (sbhd read in place, packed arrays sliced apart): forward
    and gradients in the caller's layout against the float64 oracle."""
    import fusedattn
    q, k, v, do = _inputs(4, 4 if "3" in layout else 2, 128, jnp.bfloat16, s=384)
    if choose_implementation(q) != "mosaic":
        pytest.skip("the Mosaic GPU kernels need a Hopper GPU")
    ids = jnp.asarray(doc_ids(B, 384, [64, 160, 96]))
    kw = dict(layout=layout, mask_mod=_doc_mask_mod, score_mod_args=(ids,))
    plan = fusedattn.explain(*in_layout(layout, q, k, v)[0], **kw)
    assert plan.chosen == "block_sparse", str(plan)

    def call(q, k, v):
        args, back = in_layout(layout, q, k, v)
        return back(fusedattn.fused_attn(*args, **kw))
    out, vjp = jax.jit(lambda q, k, v: jax.vjp(call, q, k, v))(q, k, v)
    visible = np.broadcast_to(np.asarray(ids[:, None, :, None] == ids[:, None, None, :]),
                              (B, 4, 384, 384))
    ref_out, _, ref_grads = oracle(q, k, v, visible, 128 ** -0.5, None, do)
    assert rel_error(out, ref_out) < 2e-2, layout
    for name, g, r in zip(("dq", "dk", "dv"), vjp(do), ref_grads):
        assert rel_error(g, r) < 4e-2, (layout, name)


@pytest.mark.parametrize("case", sorted(PACKED))
def test_packed_segments_run_on_the_kernels(case):
    """Packed sequences with a mask_mod or score_mod (positions inside each segment) on
    the block_sparse kernels, against the XLA backend in float32 (`check_packed`)."""
    import fusedattn
    q, k, v, do = _inputs(4, 2, 128, jnp.bfloat16, s=640)
    if choose_implementation(q) != "mosaic":
        pytest.skip("the Mosaic GPU kernels need a Hopper GPU")
    seq, opts, args = packed_case(case, B, 640)
    plan = fusedattn.explain(q, k, v, score_mod_args=args, **opts)
    assert plan.chosen == "block_sparse", str(plan)
    check_packed(q, k, v, do, seq, opts, args)


@pytest.mark.parametrize("route", ["fused_attn, ids", "jax.nn drop-in, dense mask",
                                   "jax.nn drop-in, dense mask and padding",
                                   "flax drop-in, make_causal_mask"])
def test_dispatch_runs_maps_built_on_the_device(route):
    """Masks whose map is built on the device in every call take the block_sparse
    backend by themselves: a mask_mod reading an id array through fused_attn, a dense
    document mask through the jax.nn drop-in (with padding lengths too), Flax's causal
    mask through attention_fn. Forward and gradients against the float64 oracle."""
    import fusedattn
    import fusedattn.flax
    import fusedattn.jax_nn
    from flax import linen as nn
    from support.block_sparse_cases import doc_ids
    h, h_kv = (4, 4) if route.startswith("flax") else (4, 2)
    q, k, v, do = _inputs(h, h_kv, 128, jnp.bfloat16, s=384)
    if choose_implementation(q) != "mosaic":
        pytest.skip("the Mosaic GPU kernels need a Hopper GPU")
    s = q.shape[1]
    ids = jnp.asarray(doc_ids(B, s, [64, 160, 96]))
    if route.startswith("fused_attn"):
        call = lambda q, k, v: fusedattn.fused_attn(q, k, v, mask_mod=_doc_mask_mod,
                                                    score_mod_args=(ids,))
        plan = fusedattn.explain(q, k, v, mask_mod=_doc_mask_mod, score_mod_args=(ids,))
        visible = np.asarray(ids[:, None, :, None] == ids[:, None, None, :])
    elif route.startswith("jax.nn"):
        dense = ids[:, None, :, None] == ids[:, None, None, :]
        lengths = {}
        visible = np.asarray(dense)
        if route.endswith("padding"):  # every real row sees its own key; padded rows give 0
            n = jnp.asarray([s, 250], jnp.int32)
            lengths = dict(query_seq_lengths=n, key_value_seq_lengths=n)
            real = np.arange(s)[None, :] < np.asarray(n)[:, None]
            visible = visible & real[:, None, :, None] & real[:, None, None, :]
        call = lambda q, k, v: fusedattn.dot_product_attention(q, k, v, mask=dense, **lengths)
        plan = fusedattn.jax_nn.explain(q, k, v, mask=dense, **lengths)
    else:
        causal = nn.make_causal_mask(jnp.ones((B, s)), dtype=jnp.bool_)
        call = lambda q, k, v: fusedattn.flax.attention_fn(q, k, v, mask=causal)
        plan = fusedattn.flax.explain(q, k, v, mask=causal)
        visible = np.asarray(causal)
    assert getattr(plan, "chosen", None) == "block_sparse", str(plan)
    out, vjp = jax.jit(lambda q, k, v: jax.vjp(call, q, k, v))(q, k, v)
    grads = vjp(do)
    visible = np.broadcast_to(visible, (B, h, s, s))
    ref_out, _, ref_grads = oracle(q, k, v, visible, 128 ** -0.5, None, do)
    assert rel_error(out, ref_out) < 2e-2, route
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert rel_error(g, r) < 4e-2, (route, name)


@pytest.mark.parametrize("mask", ["causal", "documents"])
@pytest.mark.parametrize("name", sorted(SCORE_VALUE_MODS))
def test_score_mods_reading_arrays(name, mask):
    """Values read per row, column or (batch, head) hoisted into the kernels, at a length
    past a block boundary: output, dq, dk, dv and each float arg's gradient."""
    s, h = 300, 4
    q, k, v, do = _inputs(h, 2, 128, jnp.bfloat16, s=s)
    if choose_implementation(q) != "mosaic":
        pytest.skip("the Mosaic GPU kernels need a Hopper GPU")
    docs = jnp.asarray(doc_ids(B, s, [70, 130, 100]))
    args, mod = score_value_args(name, docs, h), SCORE_VALUE_MODS[name]
    same = (lambda b, hh, i, j, doc: (doc[b, i] == doc[b, j]) & (j <= i)) if mask == "documents" \
        else None
    bm = bs.block_map(same, B, 1, s, s, args=(docs,) if same else (), mask="causal",
                      block=(128, 128))
    floats = [i for i, a in enumerate(args) if jnp.issubdtype(a.dtype, jnp.floating)]

    def loss(q, k, v, *fargs):
        full = list(args)
        for i, a in zip(floats, fargs):
            full[i] = a
        out = block_sparse_attention(q, k, v, bm, score_mod=mod, score_mod_args=tuple(full))
        return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32)), out
    grads, out = jax.jit(jax.grad(loss, argnums=tuple(range(3 + len(floats))), has_aux=True))(
        q, k, v, *[args[i] for i in floats])
    ref_out, _, ref = oracle(q, k, v, dense_visibility(bm, B, h, s), 128 ** -0.5, mod, do,
                             args=args)
    assert rel_error(out, ref_out) < 2e-2
    for label, g, r in zip(("dq", "dk", "dv"), grads, ref):
        assert rel_error(g, r) < 4e-2, label
    for g, i in zip(grads[3:], floats):
        assert rel_error(g, ref[3 + i]) < 4e-2, f"the gradient of arg {i}"
