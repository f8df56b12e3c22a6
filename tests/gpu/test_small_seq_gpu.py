"""The small-seq kernels on a GPU against the float64 reference: forward and
gradients for every head dim x dtype x KV length 1..16 with ragged lengths,
GQA (h_q 16, h_kv 4), padded and packed keys, and MHA with few keys (its own
backward kernel). Outputs are checked to be fully
written: the allocator's free memory is poisoned with NaN before each call.

Under compute-sanitizer (the platform allocator, so that an overrun leaves its
allocation instead of landing in XLA's pool):
  XLA_PYTHON_CLIENT_ALLOCATOR=platform compute-sanitizer --tool memcheck \
    --error-exitcode 9 python -m pytest -q -m gpu tests/gpu/test_small_seq_gpu.py \
    -k "packed or malformed or head_groups"
"""
from __future__ import annotations

import os
import sys
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from support import small_seq_reference as ref  # noqa: E402
from fusedattn import dispatch  # noqa: E402
from fusedattn.backends import small_seq  # noqa: E402
from fusedattn.sequence import SequenceDescriptor  # noqa: E402
from fusedattn.small_seq_api import build_small_seq_call, fused_attn_small_seq  # noqa: E402

pytestmark = pytest.mark.gpu

HEAD_DIMS = (64, 128, 256, 512)
DTYPES = ("bfloat16", "float16")
N, H_Q, H_KV = 48, 16, 4


@pytest.fixture(autouse=True, scope="module")
def _kernels_available():
    if dispatch.current_platform() not in ("cuda", "rocm"):
        pytest.skip("needs a CUDA or ROCm GPU")
    reason = small_seq._native_reason()
    assert reason is None, f"small-seq FFI targets missing: {reason}"


def _poison_free_memory(nbytes=64 << 20):
    """Fill memory the allocator will hand out next with NaN bits (0xffff is NaN in
    bf16, fp16 and, paired, fp32), so an unwritten output element shows as NaN."""
    junk = jnp.full((nbytes // 2,), 0xFFFF, jnp.uint16)
    junk.block_until_ready()
    del junk


def _random(seed, shape, dtype):
    return jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32).astype(dtype)


def _lengths(rng, s_kv, n=N):
    """Ragged lengths in [0, s_kv] with 0, 1 and s_kv always present."""
    lengths = rng.integers(0, s_kv + 1, size=n)
    lengths[:3] = [0, min(1, s_kv), s_kv]
    return lengths.astype(np.int32)


def _run(q, k, v, d_o, sequence, scale):
    """(out, dq, dk, dv) as float32 NumPy, from one jitted step; `sequence` is traced."""
    def step(q, k, v, d_o, sequence):
        fn = lambda q, k, v: fused_attn_small_seq(q, k, v, sequence=sequence, scale=scale,
                                                  backend="small_seq")
        out, vjp = jax.vjp(fn, q, k, v)
        return (out, *vjp(d_o))
    _poison_free_memory()
    return [np.asarray(x.astype(jnp.float32)) for x in jax.jit(step)(q, k, v, d_o, sequence)]


def _check(got, want, dtype, what):
    for name, x, r in zip(("out", "dq", "dk", "dv"), got, want):
        assert np.all(np.isfinite(x)), f"{what}: {name} has non-finite values (unwritten?)"
        err = ref.rel_err(x, r)
        assert err < ref.TOLERANCE[dtype], f"{what}: {name} rel err {err:.3g}"


@pytest.mark.parametrize("s_kv", range(1, 17))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_padded(d, dtype, s_kv):
    rng = np.random.default_rng(s_kv * 1000 + d)
    q, d_o = (_random(i, (N, 1, H_Q, d), dtype) for i in (1, 2))
    k, v = (_random(i, (N, s_kv, H_KV, d), dtype) for i in (3, 4))
    lengths = _lengths(rng, s_kv)
    scale = 1.0 / np.sqrt(d)
    got = _run(q, k, v, d_o, jnp.asarray(lengths), scale)
    want = ref.attention(q, k, v, lengths, scale, d_o)
    _check(got, want, dtype, f"d{d} {dtype} s_kv{s_kv}")
    assert np.all(got[0][lengths == 0] == 0.0)
    slot = np.arange(s_kv)[None, :] >= lengths[:, None]  # padding: exactly zero gradient
    assert np.all(got[2][slot] == 0.0) and np.all(got[3][slot] == 0.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_packed(d, dtype):
    rng = np.random.default_rng(d)
    lengths = np.concatenate([np.arange(17), rng.integers(0, 17, size=N - 17)]).astype(np.int32)
    rng.shuffle(lengths)
    q, d_o = (_random(i, (N, 1, H_Q, d), dtype) for i in (5, 6))
    k_pad, v_pad = (_random(i, (N, 16, H_KV, d), dtype) for i in (7, 8))
    k, offsets = ref.pack(np.asarray(k_pad.astype(jnp.float32)), lengths)
    v, _ = ref.pack(np.asarray(v_pad.astype(jnp.float32)), lengths)
    extra = 3  # rows after the last sequence: nobody's, zero gradient
    k = jnp.concatenate([jnp.asarray(k, dtype), _random(9, (extra, H_KV, d), dtype)])
    v = jnp.concatenate([jnp.asarray(v, dtype), _random(10, (extra, H_KV, d), dtype)])
    scale = 0.7 / np.sqrt(d)
    got = _run(q, k, v, d_o, SequenceDescriptor.from_kv_offsets(offsets), scale)
    r_out, r_dq, r_dk, r_dv = ref.attention(q, k_pad, v_pad, lengths, scale, d_o)
    pad_rows = lambda x: np.concatenate([ref.unpack_grads(x, lengths), np.zeros((extra, H_KV, d))])
    _check(got, (r_out, r_dq, pad_rows(r_dk), pad_rows(r_dv)), dtype, f"packed d{d} {dtype}")
    assert np.all(got[2][-extra:] == 0.0) and np.all(got[3][-extra:] == 0.0)


@pytest.mark.parametrize("h_q,h_kv", [(8, 8), (16, 1), (32, 2)])
def test_head_groups(h_q, h_kv):
    d, dtype = 128, "bfloat16"
    lengths = _lengths(np.random.default_rng(h_q), 16)
    q, d_o = (_random(i, (N, 1, h_q, d), dtype) for i in (11, 12))
    k, v = (_random(i, (N, 16, h_kv, d), dtype) for i in (13, 14))
    got = _run(q, k, v, d_o, jnp.asarray(lengths), 0.1)
    _check(got, ref.attention(q, k, v, lengths, 0.1, d_o), dtype, f"h{h_q}/{h_kv}")


@pytest.mark.parametrize("s_kv", (1, 3, 4))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", (64, 128, 256))
def test_mha_few_keys(d, dtype, s_kv):
    """MHA with <= 4 keys takes its own backward kernel (4 rows pipelined per
    team); an odd row count leaves the last block partly empty."""
    n, h = N + 5, 8
    lengths = _lengths(np.random.default_rng(s_kv + d), s_kv, n)
    q, d_o = (_random(i, (n, 1, h, d), dtype) for i in (25, 26))
    k, v = (_random(i, (n, s_kv, h, d), dtype) for i in (27, 28))
    scale = 1.0 / np.sqrt(d)
    got = _run(q, k, v, d_o, jnp.asarray(lengths), scale)
    _check(got, ref.attention(q, k, v, lengths, scale, d_o), dtype, f"mha d{d} {dtype} s_kv{s_kv}")
    slot = np.arange(s_kv)[None, :] >= lengths[:, None]
    assert np.all(got[2][slot] == 0.0) and np.all(got[3][slot] == 0.0)


def test_lse_matches_reference():
    d, dtype, s_kv = 256, "float16", 9
    lengths = _lengths(np.random.default_rng(0), s_kv)
    q = _random(15, (N, 1, H_Q, d), dtype)
    k, v = (_random(i, (N, s_kv, H_KV, d), dtype) for i in (16, 17))
    call = build_small_seq_call(q, k, v, sequence=jnp.asarray(lengths), scale=0.05)
    _, lse = small_seq.forward_with_lse(call.config, call.inputs)
    want = ref.lse(q, k, lengths, 0.05)
    lse = np.asarray(lse)[..., 0]
    assert lse.shape == (N, H_Q)
    assert np.all(lse[lengths == 0] == -np.inf)
    ok = lengths > 0
    np.testing.assert_allclose(lse[ok], want[ok], rtol=1e-4, atol=1e-4)


def test_malformed_traced_offsets_give_nan_without_faults():
    d, dtype = 128, "bfloat16"
    q, d_o = (_random(i, (4, 1, H_Q, d), dtype) for i in (18, 19))
    k, v = (_random(i, (40, H_KV, d), dtype) for i in (20, 21))
    offsets = jnp.array([0, 5, 22, 50, 40], jnp.int32)  # 17 keys; past the end; backwards
    out, dq, dk, dv = _run(q, k, v, d_o, offsets, 0.1)
    assert np.all(np.isfinite(out[0])) and np.all(np.isnan(out[1:]))
    assert np.all(np.isfinite(dk[:5])) and np.all(np.isnan(dk[5:22]))


def test_fused_attn_dispatch_chooses_small_seq():
    import fusedattn
    d, dtype = 128, "bfloat16"
    lengths = _lengths(np.random.default_rng(1), 8)
    q = _random(22, (N, 1, H_Q, d), dtype)
    k, v = (_random(i, (N, 8, H_KV, d), dtype) for i in (23, 24))
    seq = SequenceDescriptor.from_lengths(jnp.ones(N, jnp.int32), jnp.asarray(lengths))
    plan = fusedattn.explain(q, k, v, sequence=seq)
    assert plan.chosen == "small_seq", str(plan)
    out = fusedattn.fused_attn(q, k, v, sequence=seq)
    assert ref.rel_err(np.asarray(out, np.float32), ref.attention(q, k, v, lengths, d ** -0.5)) < 4e-2
