"""A mask_mod that is exactly a built-in mask runs as that mask under `auto`.

`block_sparse.recognise.builtin_form` is checked differentially: over generated
mask_mods (ANDs and ORs of position comparisons) at small lengths, its answer is
compared with an exhaustive search of every built-in (mask, window) form, so it
must be sound (a form it returns equals the mask on every pair) and complete (it
finds one whenever one exists). Then dispatch: the rewritten plan, its explain()
line, and outputs and gradients equal to the call as written.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fusedattn
from fusedattn.block_sparse import builtin
from fusedattn.block_sparse import recognise
from fusedattn.block_sparse.terms import ElementMask, MaskMod
from fusedattn import dispatch
from support.generated_masks import brute, check_forms, dense


def builtin_form(fn, s_q, s_kv, mask="none", window=None):
    """`recognise.builtin_form` of mask_mod `fn` ANDed with the call's mask / window."""
    return recognise.builtin_form(ElementMask(
        [MaskMod.build(fn, (), 1, 1, s_q, s_kv), builtin.intervals(s_q, s_kv, mask, window)],
        s_q, s_kv))


@pytest.mark.parametrize("chunk", range(8))
def test_builtin_form_against_exhaustive_search(chunk):
    check_forms(lambda fn, s_q, s_kv, m: builtin_form(fn, s_q, s_kv),
                range(chunk * 60, chunk * 60 + 60))


@pytest.mark.parametrize("mask,window", [("causal", None), ("causal", (3, 0)),
                                         ("none", (2, 5)), ("none", (-1, 0))])
def test_builtin_form_combines_the_calls_own_mask(mask, window):
    # the call's mask AND a mask_mod: the form of the combination
    s = 17
    fn = lambda b, h, i, j: i - j < 6
    form = builtin_form(fn, s, s, mask, window)
    expect = dense(s, s, mask, window) & brute(fn, s, s)
    assert form is not None and np.array_equal(dense(s, s, *form), expect)


def test_builtin_form_bottom_right_and_named_shapes():
    assert builtin_form(lambda b, h, i, j: j <= i + 28, 100, 128) == ("causal_bottom_right", None)
    assert builtin_form(lambda b, h, i, j: (j <= i) & (i - j < 512), 4096, 4096) == \
        ("causal", (511, 0))
    assert builtin_form(lambda b, h, i, j: (j <= i) | (j < 8), 64, 64) is None   # prefix-LM
    assert builtin_form(lambda b, h, i, j: j < i, 64, 64) is None     # row 0 sees nothing
    assert builtin_form(lambda b, h, i, j: i // 8 == j // 8, 64, 64) is None  # documents


ARGS = dict(batch=2, s=96, h=2, d=32)


def _qkv():
    ks = jax.random.split(jax.random.PRNGKey(1), 3)
    shape = (ARGS["batch"], ARGS["s"], ARGS["h"], ARGS["d"])
    return tuple(jax.random.normal(k, shape, jnp.float32) for k in ks)


def window_mod(b, h, i, j):
    return (j <= i) & (i - j < 24)


def test_auto_plans_a_window_mask_mod_as_the_window():
    q, k, v = _qkv()
    plan = fusedattn.explain(q, k, v, mask_mod=window_mod)
    assert (plan.config.mask, plan.config.window, plan.config.score_mod) == \
        ("causal", (23, 0), None)
    assert "window_mod is mask='causal', window=(23, 0)" in str(plan)
    forced = fusedattn.explain(q, k, v, mask_mod=window_mod, backend="xla")
    assert not forced.rewritten and forced.config.score_mod is not None


def test_recognised_call_equals_the_call_as_written():
    q, k, v = _qkv()
    slopes = jnp.asarray([0.5, -0.25], jnp.float32)

    def score(s, b, h, i, j, t):
        return s + t[h] * (i - j)

    def mask(b, h, i, j, t):        # takes the args, reads positions only
        return window_mod(b, h, i, j)

    def loss(backend, q, k, v, t):
        out = fusedattn.fused_attn(q, k, v, score_mod=score, mask_mod=mask,
                                   score_mod_args=(t,), backend=backend)
        return (out * jnp.cos(out)).sum()
    assert fusedattn.explain(q, k, v, score_mod=score, mask_mod=mask,
                             score_mod_args=(slopes,)).rewritten
    got = jax.value_and_grad(lambda *a: loss("auto", *a), argnums=(0, 1, 2, 3))(q, k, v, slopes)
    want = jax.value_and_grad(lambda *a: loss("xla", *a), argnums=(0, 1, 2, 3))(q, k, v, slopes)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_mask_only_args_are_dropped_with_the_mask_mod():
    q, k, v = _qkv()
    t = jnp.zeros((3,), jnp.int32)
    out = fusedattn.fused_attn(q, k, v, mask_mod=lambda b, h, i, j, t: j <= i,
                               score_mod_args=(t,))
    want = fusedattn.fused_attn(q, k, v, mask="causal", backend="xla")
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("name,mod,args", [
    ("reads an array", lambda b, h, i, j, t: j <= i + t[0], (jnp.zeros((2,), jnp.int32),)),
    ("reads the head", lambda b, h, i, j: (j <= i) & (h >= 0), ()),
    ("a window and sink keys", lambda b, h, i, j: ((j <= i) & (i - j < 8)) | (j < 4), ()),
])
def test_masks_that_are_not_static_built_ins_run_as_written(name, mod, args):
    q, k, v = _qkv()
    plan = fusedattn.explain(q, k, v, mask_mod=mod, score_mod_args=args)
    assert not plan.rewritten and plan.config.score_mod is not None, name


def test_the_rewrite_is_cached_with_the_plan():
    q, k, v = _qkv()
    dispatch.clear_cache()
    first = fusedattn.explain(q, k, v, mask_mod=window_mod)
    assert fusedattn.explain(q, k, v, mask_mod=window_mod) is first
