"""A mask_mod whose query rows fall into runs, each a built-in mask of a range of keys
(prefix-LM), runs as one call per run under `auto`.

`block_sparse.recognise.row_groups` is checked differentially: over generated
mask_mods, every answer must equal the mask on every pair, and whenever an exhaustive
search finds rows ``[0, t)`` and ``[t, s_q)`` (or all rows) to be built-in forms of the
keys they see, it must find a decomposition too. Then dispatch on CPU: the plan, its
explain() text, and outputs, lse and every gradient against the call as written.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fusedattn
from fusedattn import dispatch
from fusedattn.block_sparse import builtin, recognise
from fusedattn.block_sparse.terms import ElementMask, MaskMod
from fusedattn.validation import build_call
from support.generated_masks import brute, dense, exhaustive, generated


def row_groups(fn, s_q, s_kv):
    return recognise.row_groups(ElementMask(
        [MaskMod.build(fn, (), 1, 1, s_q, s_kv), builtin.intervals(s_q, s_kv)], s_q, s_kv))


def composed(groups, s_q, s_kv):
    m = np.zeros((s_q, s_kv), bool)
    for (r0, r1), (k0, k1), form in groups:
        m[r0:r1, k0:k1] = dense(r1 - r0, k1 - k0, *form)
    return m


def _tight(part):
    cols = np.flatnonzero(part.any(axis=0))
    return len(cols) > 0 and exhaustive(part[:, cols[0]:cols[-1] + 1])


def splittable(m):
    """Whether all rows, or rows [0, t) and [t, s_q) for some t, are each a built-in
    form of the keys they see."""
    return _tight(m) or any(_tight(m[:t]) and _tight(m[t:]) for t in range(1, len(m)))


def with_prefix(seed):
    """A generated mask_mod, for odd seeds ORed with a prefix of keys (prefix-LM's form)."""
    fn, s_q, s_kv, text = generated(seed)
    if seed % 2 == 0:
        return fn, s_q, s_kv, text
    p = 1 + seed % 7
    return (lambda b, h, i, j: fn(b, h, i, j) | (j < p)), s_q, s_kv, f"({text}) | j<{p}"


@pytest.mark.parametrize("chunk", range(6))
def test_row_groups_against_exhaustive_search(chunk):
    split = 0
    for seed in range(chunk * 50, chunk * 50 + 50):
        fn, s_q, s_kv, text = with_prefix(seed)
        if s_q > 13 or s_kv > 13:   # (the exhaustive search's cost grows as s^4)
            s_q, s_kv = min(s_q, 13), min(s_kv, 13)
        m = brute(fn, s_q, s_kv)
        groups = row_groups(fn, s_q, s_kv)
        if groups is None:
            assert not (m.any(axis=1).all() and splittable(m)), \
                f"seed {seed}: {text} ({s_q}x{s_kv}) splits, not found"
            continue
        assert np.array_equal(composed(groups, s_q, s_kv), m), f"seed {seed}: {text} -> {groups}"
        split += len(groups) == 2
    assert split > 0   # the generator reaches two-run masks, so they are exercised


def test_row_groups_of_named_masks():
    assert row_groups(lambda b, h, i, j: (j <= i) | (j < 1024), 4096, 4096) == (
        ((0, 1024), (0, 1024), ("none", None)),
        ((1024, 4096), (0, 4096), ("causal_bottom_right", None)))
    assert row_groups(lambda b, h, i, j: j < 40, 64, 96) == (((0, 64), (0, 40), ("none", None)),)
    assert row_groups(lambda b, h, i, j: (j <= i) & (i - j < 9), 64, 64) == (
        ((0, 64), (0, 64), ("causal", (8, 0))),)
    assert row_groups(lambda b, h, i, j: i // 8 == j // 8, 64, 64) is None   # 8 documents
    assert row_groups(lambda b, h, i, j: ((j <= i) & (i - j < 8)) | (j < 4), 64, 64) is None


B, S, H, D = 2, 96, 4, 32


def prefix_mod(b, h, i, j):
    return (j <= i) | (j < 40)


def _qkv(s_q=S, s_kv=S, h_kv=H, layout="bshd"):
    ks = jax.random.split(jax.random.PRNGKey(3), 3)
    shape = lambda s, h: (B, s, h, D) if layout == "bshd" else (s, B, h, D)  # noqa: E731
    return (jax.random.normal(ks[0], shape(s_q, H), jnp.float32),
            jax.random.normal(ks[1], shape(s_kv, h_kv), jnp.float32),
            jax.random.normal(ks[2], shape(s_kv, h_kv), jnp.float32))


def test_auto_plans_prefix_lm_as_two_calls():
    q, k, v = _qkv()
    plan = fusedattn.explain(q, k, v, mask_mod=prefix_mod)
    assert plan.strategy == "row_groups" and plan.chosen is None
    assert [(r, kv, p.config.mask, p.config.s_q, p.config.s_kv) for r, kv, p in plan.groups] == [
        ((0, 40), (0, 40), "none", 40, 40), ((40, 96), (0, 96), "causal_bottom_right", 56, 96)]
    assert all(p.config.score_mod is None for *_, p in plan.groups)
    text = str(plan)
    assert "queries [0, 40) against keys [0, 40) with mask='none'" in text, text
    assert "queries [40, 96) x keys [0, 96):" in text and ">> xla" in text, text
    assert fusedattn.explain(q, k, v, mask_mod=prefix_mod) is plan   # cached
    with pytest.raises(dispatch.UnsupportedError, match="a call per run of query rows"):
        plan.require()
    forced = fusedattn.explain(q, k, v, mask_mod=prefix_mod, backend="xla")
    assert forced.strategy == "plain" and not forced.rewritten


def test_explain_gives_each_run_of_rows_its_split_over_sharded_inputs():
    """Sharded arrays: each run of rows is a call of its own, split by batch / heads
    as its plan says (the sub-calls' lengths in the per-device shapes)."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    mesh = jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    sds = jax.ShapeDtypeStruct((4, 96, 8, 32), jnp.float32,
                               sharding=NamedSharding(mesh, P("dp", None, "tp")))
    plan = fusedattn.explain(sds, sds, sds, mask_mod=prefix_mod)
    assert plan.strategy == "row_groups"
    text = str(plan)
    assert "queries [0, 40) x keys [0, 40): sharding over mesh" in text, text
    assert "queries [40, 96) x keys [0, 96): sharding over mesh" in text, text
    assert "each device runs b2 h2/2 (sq40 skv40)" in text, text
    assert "each device runs b2 h2/2 (sq56 skv96)" in text, text
    plain = fusedattn.explain(*(jax.ShapeDtypeStruct(sds.shape, sds.dtype) for _ in range(3)),
                              mask_mod=prefix_mod)
    assert plain.distributed == ""   # (no sharding: no distributed plan)


CASES = {
    "prefix-LM": dict(mask_mod=prefix_mod),
    "prefix-LM, GQA, sbhd": dict(mask_mod=prefix_mod, h_kv=2, layout="sbhd"),
    "prefix-LM, off-by-one sink": dict(mask_mod=prefix_mod, softmax="off_by_one"),
    "prefix-LM, learnable sinks": dict(mask_mod=prefix_mod, softmax="learnable"),
    "prefix over longer keys": dict(mask_mod=lambda b, h, i, j: (j <= i + 32) | (j < 48),
                                    s_kv=128),
    "a key prefix only": dict(mask_mod=lambda b, h, i, j: j < 50),
    "prefix-LM and the call's window": dict(mask_mod=prefix_mod, window=(-1, 10)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_row_groups_equal_the_call_as_written(name):
    options = dict(CASES[name])
    shape = {key: options.pop(key) for key in ("s_kv", "h_kv", "layout") if key in options}
    q, k, v = _qkv(**shape)
    layout = shape.get("layout", "bshd")
    offset = (jnp.linspace(-1.0, 1.0, H, dtype=jnp.float32)
              if options.get("softmax") == "learnable" else None)
    plan = fusedattn.explain(q, k, v, softmax_offset=offset, layout=layout, **options)
    assert plan.strategy == "row_groups", (name, str(plan))

    def loss(backend, q, k, v, offset):
        out = fusedattn.fused_attn(q, k, v, softmax_offset=offset, layout=layout,
                                   backend=backend, **options)
        return (out * jnp.cos(out)).sum()
    args = (q, k, v, offset)
    grad = lambda backend: jax.value_and_grad(  # noqa: E731
        lambda *a: loss(backend, *a), argnums=(0, 1, 2) + ((3,) if offset is not None else ()))
    got, want = grad("auto")(*args), grad("xla")(*args)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)


def test_row_groups_give_the_calls_lse():
    q, k, v = _qkv()
    config, inputs = build_call(q, k, v, mask_mod=prefix_mod)
    out, lse = dispatch.plan(config).run_with_lse(inputs)
    want_out, want_lse = dispatch.plan(config, "xla").run_with_lse(inputs)
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name,options", [
    ("a score_mod", dict(score_mod=lambda s, b, h, i, j: s * 0.5)),
    ("a bias", dict(bias=jnp.zeros((1, 1, S, S)))),
    ("dropout", dict(dropout=0.1, rng=jax.random.PRNGKey(0))),
])
def test_calls_that_cannot_split_by_rows_run_whole(name, options):
    q, k, v = _qkv()
    plan = fusedattn.explain(q, k, v, mask_mod=prefix_mod, **options)
    assert plan.strategy != "row_groups" and not plan.rewritten, name
