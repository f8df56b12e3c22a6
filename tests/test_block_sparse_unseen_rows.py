"""jax.nn's rows that see no key on the block-sparse path (`block_sparse.unseen_rows`):
the gate that says whether any row may see no key (at trace time, or as a device flag)
against brute force, the token sums' XLA form (which ignores the flag) against numpy,
and `unseen_rows="mean"` under a device flag of each value against the float64 oracle.
The Mosaic GPU form of the sums, zeros where the flag is 0:
tests/gpu/test_block_sparse_gpu.py."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from support.block_sparse_cases import block_map, dense_visibility, doc_ids, oracle, rel_error
from fusedattn import block_sparse as bs
from fusedattn.block_sparse import unseen_rows
from fusedattn.block_sparse.attention import block_sparse_attention

B, H, H_KV, D = 2, 4, 2, 32


def _rows_see_keys(visible) -> bool:
    """Every query row of a boolean mask [b, h|1, s_q, s_kv] sees a key."""
    return bool(np.asarray(visible).any(-1).all())


def test_gate_at_trace_time_and_on_the_device():
    """A closed gate (False, or a flag of 0) means every row sees a key, checked on the
    mask itself; whole-block documents close it, and a row that sees nothing opens it."""
    causal = bs.from_builtin(512, mask="causal")         # block 0's only block is partial
    assert unseen_rows.gate(causal, has_score=False) is True
    assert unseen_rows.gate(causal, has_score=True) is True
    docs = bs.from_segment_ids(jnp.asarray(doc_ids(B, 512, (128, 256, 128))), pad_id=None)
    flag = unseen_rows.gate(docs, has_score=False)       # built on the device
    assert flag.shape == (1,) and flag.dtype == jnp.int32 and int(flag[0]) == 0
    assert unseen_rows.gate(docs, has_score=True) is True
    gate_of = jax.jit(lambda m: unseen_rows.gate(bs.from_dense_mask(m), False))
    for lengths, cut, want in (((128, 256, 128), False, 0), ((100, 300, 112), False, None),
                               ((128, 256, 128), True, 1), ((100, 300, 112), True, 1)):
        ids = doc_ids(B, 512, lengths)
        visible = np.broadcast_to((ids[:, :, None] == ids[:, None, :])[:, None], (B, 1, 512, 512))
        visible = visible.copy()
        if cut:
            visible[1, :, 300] = False                   # one row sees no key
        got = int(gate_of(jnp.asarray(visible))[0])
        assert got in (0, 1) and (got == 1 or _rows_see_keys(visible))
        if want is not None:
            assert got == want


@pytest.mark.parametrize("s", [512, 384, 300])
@pytest.mark.parametrize("masked", [False, True])
def test_xla_token_sum(s, masked):
    """XLA's form (CPU, and shapes the kernel does not take) sums whatever the flag."""
    keys = jax.random.split(jax.random.key(s), 2)
    x = jax.random.normal(keys[0], (B, s, H, D), jnp.bfloat16)
    lse2 = None
    want = np.asarray(x, np.float64)
    if masked:
        lse2 = jnp.where(jax.random.bernoulli(keys[1], 0.2, (B, H, s)), -jnp.inf, 1.0)
        want = np.where(np.isinf(np.asarray(lse2)).transpose(0, 2, 1)[..., None], want, 0)
    want = want.sum(1)
    got = unseen_rows.gated_token_sum(x, jnp.asarray([0], jnp.int32), lse2, kernel=False)
    assert got.shape == (B, H, D) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("lengths, sees_all", [((128, 256, 128), True), ((100, 300, 112), False)])
def test_mean_rule_under_a_device_flag(lengths, sees_all):
    """A dense mask passed to the step: its map, and so the gate, exist only on the device.
    Documents of whole blocks leave no row unseen (flag 0); the other case drops some
    rows' keys so that they see none (flag 1). The reference path computes the mean
    either way; skipping it on flag 0 is the GPU kernel's (tests/gpu)."""
    s = 512
    ids = doc_ids(B, s, lengths)
    visible = np.broadcast_to((ids[:, :, None] == ids[:, None, :])[:, None], (B, H, s, s)).copy()
    if not sees_all:
        visible[:, :, 5:9] = False                       # rows that see no key
    keys = jax.random.split(jax.random.key(3), 4)
    q, k, v, do = (jax.random.normal(kk, (B, s, hh, D)) for kk, hh in zip(keys, (H, H_KV, H_KV, H)))

    @jax.jit
    def step(q, k, v, do, mask):
        bm = bs.from_dense_mask(mask)
        out, vjp = jax.vjp(lambda q, k, v: block_sparse_attention(
            q, k, v, bm, implementation="reference", unseen_rows="mean"), q, k, v)
        return (out,) + vjp(do) + (unseen_rows.gate(bm, False),)

    out, dq, dk, dv, flag = step(q, k, v, do, jnp.asarray(visible))
    assert int(flag[0]) == (not sees_all)
    ref_out, _, ref_grads = oracle(q, k, v, visible, D ** -0.5, None, do, unseen_rows="mean")
    assert rel_error(out, ref_out) < 1e-4
    for g, r in zip((dq, dk, dv), ref_grads):
        assert rel_error(g, r) < 1e-4


def test_the_backward_stays_differentiable_in_d_out():
    """The backward is linear in dO, so its derivative along dO is itself: the unseen
    rows' term of dv included (a stop_gradient on dO there would drop it)."""
    s = 256
    keys = jax.random.split(jax.random.key(4), 5)
    q, k, v, do, t = (jax.random.normal(kk, (B, s, hh, D))
                      for kk, hh in zip(keys, (H, H_KV, H_KV, H, H)))
    bm = block_map("random_dense", B, H, s)
    assert not _rows_see_keys(dense_visibility(bm, B, H, s))
    grads = lambda do: jax.vjp(lambda q, k, v: block_sparse_attention(  # noqa: E731
        q, k, v, bm, implementation="reference", unseen_rows="mean"), q, k, v)[1](do)
    direct = grads(t)
    _, along = jax.jvp(grads, (do,), (t,))
    for name, a, b in zip(("dq", "dk", "dv"), direct, along):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-5,
                                   err_msg=name)
