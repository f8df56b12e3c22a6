"""Prefix-LM planned as row groups, with block_sparse able to run the whole call: calls
without a gradient run block_sparse over the whole map (`Plan.inference`), training
steps run the row groups (forward and backward).

On CPU the backend's Hopper check is patched and its kernels swapped for the reference
list walks, as in test_block_sparse_dispatch. Each route is checked exactly against the
call it must be (block_sparse's plan, or `recognised.run_groups`), and all of them
against the float64 oracle. Without Hopper the plan is the row groups alone, as before.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fusedattn
from fusedattn import dispatch
from fusedattn.backends import block_sparse as backend
from fusedattn.dispatch import recognised
from fusedattn.validation import build_call
from support import oracle
from support.block_sparse_cases import rel_error

B, S, H, D = 2, 256, 4, 64
TOL_OUT, TOL_GRAD = 2e-2, 4e-2  # bf16 against float64 (test_block_sparse_dispatch's)
PREFIX_LM = {p: (lambda b, h, i, j, p=p: (j <= i) | (j < p)) for p in (64, 128)}


def _qkvo():
    keys = jax.random.split(jax.random.key(5), 4)
    return [jax.random.normal(kk, (B, S, H, D), jnp.bfloat16) for kk in keys]


def _oracle(q, k, v, do, p):
    i, j = np.arange(S)[:, None], np.arange(S)[None, :]
    visible = (j <= i) | (j < p)
    ref = oracle.attention(*(np.asarray(x, np.float64) for x in (q, k, v)),
                           bias=np.where(visible, 0.0, -np.inf),
                           d_out=np.asarray(do, np.float64))
    return ref.out, ref.dq, ref.dk, ref.dv


def _near_oracle(got, want):
    for name, g, w, tol in zip(("out", "dq", "dk", "dv"), got, want,
                               (TOL_OUT, TOL_GRAD, TOL_GRAD, TOL_GRAD)):
        err = rel_error(np.asarray(g, np.float32), w)
        assert err < tol, (name, err)


def _equal(got, want):
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


def _trained(call, q, k, v, do):
    """(out, dq, dk, dv) of `call` under jax.vjp, jitted."""
    def step(q, k, v, do):
        out, vjp = jax.vjp(call, q, k, v)
        return (out, *vjp(do))
    return jax.jit(step)(q, k, v, do)


def _groups_call(mask_mod):
    """The row groups run directly (`recognised.run_groups`), as the plan has them."""
    def call(q, k, v):
        config, inputs = build_call(q, k, v, mask_mod=mask_mod)
        plan = dispatch.plan(config)
        return recognised.run_groups(plan.config, plan.groups, inputs)
    return call


@pytest.mark.parametrize("p", sorted(PREFIX_LM))
def test_forward_only_runs_block_sparse_and_training_runs_the_groups(hopper_reference, p):
    mask_mod = PREFIX_LM[p]
    q, k, v, do = _qkvo()
    plan = fusedattn.explain(q, k, v, mask_mod=mask_mod)
    assert plan.strategy == "row_groups" and plan.preferred is None, str(plan)
    assert plan.inference is not None and plan.inference.chosen == "block_sparse"
    assert plan.inference.config == plan.config and not plan.inference.groups
    assert hash(plan) == hash(fusedattn.explain(q, k, v, mask_mod=mask_mod))
    text = str(plan)
    assert "calls without a gradient run block_sparse over the whole map" in text, text
    assert f"queries [0, {p}) x keys [0, {p}):" in text, text
    assert f"queries [{p}, {S}) x keys [0, {S}):" in text, text
    assert plan.rewritten in text

    call = lambda q, k, v: fusedattn.fused_attn(q, k, v, mask_mod=mask_mod)  # noqa: E731
    # a forward-only call: block_sparse's kernels over the whole map
    out = jax.jit(call)(q, k, v)
    want = jax.jit(lambda q, k, v: fusedattn.fused_attn(
        q, k, v, mask_mod=mask_mod, backend="block_sparse"))(q, k, v)
    _equal([out], [want])
    # a training step: the row groups' own output and gradients
    trained = _trained(call, q, k, v, do)
    groups = _trained(_groups_call(mask_mod), q, k, v, do)
    _equal(trained, groups)
    expected = _oracle(q, k, v, do, p)
    for got in ((out, *trained[1:]), trained, groups):
        _near_oracle(got, expected)


def test_without_hopper_the_plan_is_the_row_groups_alone(hopper_reference, monkeypatch):
    monkeypatch.setattr(backend, "on_hopper", lambda: False)
    dispatch.clear_cache()
    mask_mod = PREFIX_LM[128]
    q, k, v, do = _qkvo()
    plan = fusedattn.explain(q, k, v, mask_mod=mask_mod)
    assert plan.strategy == "row_groups" and plan.inference is None, str(plan)
    assert "without a gradient" not in str(plan)
    call = lambda q, k, v: fusedattn.fused_attn(q, k, v, mask_mod=mask_mod)  # noqa: E731
    _equal([jax.jit(call)(q, k, v)], [jax.jit(_groups_call(mask_mod))(q, k, v)])
    trained = _trained(call, q, k, v, do)
    _equal(trained, _trained(_groups_call(mask_mod), q, k, v, do))
    _near_oracle(trained, _oracle(q, k, v, do, 128))


def test_a_named_backend_runs_the_call_as_written(hopper_reference):
    q, k, v, _ = _qkvo()
    for name in ("block_sparse", "xla"):
        plan = fusedattn.explain(q, k, v, mask_mod=PREFIX_LM[64], backend=name)
        assert plan.chosen == name and not plan.groups and plan.inference is None


def test_unread_float_score_mod_args_get_no_gradient(hopper_reference):
    """A mask_mod taking an array it never reads still splits by rows; differentiating
    through that array gives 0, as the groups (which never see it) did."""
    q, k, v, do = _qkvo()
    mod = lambda b, h, i, j, unused: (j <= i) | (j < 64)  # noqa: E731
    extra = jnp.ones((3,), jnp.float32)
    plan = fusedattn.explain(q, k, v, mask_mod=mod, score_mod_args=(extra,))
    assert plan.groups and plan.inference is not None, str(plan)

    def loss(q, extra):
        out = fusedattn.fused_attn(q, k, v, mask_mod=mod, score_mod_args=(extra,))
        return (out.astype(jnp.float32) * do.astype(jnp.float32)).sum()
    dq, d_extra = jax.jit(jax.grad(loss, argnums=(0, 1)))(q, extra)
    assert np.all(np.asarray(d_extra) == 0) and np.isfinite(np.asarray(dq, np.float32)).all()
