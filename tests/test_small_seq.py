"""fused_attn_small_seq on the CPU: API, validation, and the XLA path against a
float64 reference (forward and gradients, padded and packed keys, GQA)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from support import small_seq_reference as ref
from fusedattn.backends import small_seq
from fusedattn.config import AttnConfig
from fusedattn.sequence import SequenceDescriptor
from fusedattn.small_seq_api import build_small_seq_call, fused_attn_small_seq, plan_small_seq


def _inputs(seed, n, s, h_q, h_kv, d, dtype):
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(keys[0], (n, 1, h_q, d), jnp.float32).astype(dtype)
    k = jax.random.normal(keys[1], (n, s, h_kv, d), jnp.float32).astype(dtype)
    v = jax.random.normal(keys[2], (n, s, h_kv, d), jnp.float32).astype(dtype)
    d_o = jax.random.normal(keys[3], (n, 1, h_q, d), jnp.float32).astype(dtype)
    return q, k, v, d_o


def _grads(fn, q, k, v, d_o):
    out, vjp = jax.vjp(fn, q, k, v)
    return (out,) + vjp(d_o)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("h_q,h_kv", [(4, 4), (4, 2), (4, 1)])
def test_padded_forward_and_grads(dtype, h_q, h_kv):
    n, s, d = 6, 7, 32
    q, k, v, d_o = _inputs(0, n, s, h_q, h_kv, d, dtype)
    lengths = np.array([7, 0, 1, 3, 6, 7], np.int32)
    scale = 0.3
    got = _grads(lambda q, k, v: fused_attn_small_seq(q, k, v, sequence=lengths, scale=scale),
                 q, k, v, d_o)
    want = ref.attention(q, k, v, lengths, scale, d_o)
    for name, x, r in zip(("out", "dq", "dk", "dv"), got, want):
        assert x.dtype == q.dtype
        assert ref.rel_err(x, r) < ref.TOLERANCE[dtype], name
    assert np.all(np.asarray(got[0][1], np.float32) == 0.0)  # no keys -> 0, not NaN
    dk = np.asarray(got[2], np.float32)
    assert np.all(dk[3, 3:] == 0.0) and np.all(np.isfinite(dk))  # padding gets no gradient


def test_dense_default_scale():
    q, k, v, _ = _inputs(1, 3, 16, 2, 2, 64, "float32")
    out = fused_attn_small_seq(q, k, v)
    want = ref.attention(q, k, v, np.full(3, 16), 1 / 8.0)
    assert ref.rel_err(out, want) < 1e-5


def test_descriptor_with_q_lengths_zero_gives_zero():
    q, k, v, _ = _inputs(2, 3, 4, 2, 2, 16, "float32")
    seq = SequenceDescriptor.from_lengths(jnp.array([1, 0, 1]), jnp.array([4, 4, 2]))
    out = np.asarray(fused_attn_small_seq(q, k, v, sequence=seq))
    want = ref.attention(q, k, v, np.array([4, 0, 2]), 0.25)
    assert np.all(out[1] == 0.0)
    assert ref.rel_err(out, want) < 1e-5


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_packed_forward_and_grads(dtype):
    n, s, h_q, h_kv, d = 5, 16, 4, 2, 32
    q, k_pad, v_pad, d_o = _inputs(3, n, s, h_q, h_kv, d, dtype)
    lengths = np.array([16, 0, 3, 9, 1], np.int32)
    k, offsets = ref.pack(k_pad, lengths)
    v, _ = ref.pack(v_pad, lengths)
    k, v = jnp.asarray(k, dtype), jnp.asarray(v, dtype)
    fn = lambda q, k, v: fused_attn_small_seq(q, k, v, sequence=offsets, scale=0.2)
    out, dq, dk, dv = _grads(fn, q, k, v, d_o)
    r_out, r_dq, r_dk, r_dv = ref.attention(q, k_pad, v_pad, lengths, 0.2, d_o)
    tol = ref.TOLERANCE[dtype]
    assert out.shape == q.shape and dk.shape == k.shape
    assert ref.rel_err(out, r_out) < tol
    assert ref.rel_err(dq, r_dq) < tol
    assert ref.rel_err(dk, ref.unpack_grads(r_dk, lengths)) < tol
    assert ref.rel_err(dv, ref.unpack_grads(r_dv, lengths)) < tol


def test_packed_descriptor_and_unowned_rows():
    q, k_pad, v_pad, d_o = _inputs(4, 3, 4, 2, 1, 16, "float32")
    lengths = np.array([2, 4, 1])
    k, offsets = ref.pack(k_pad, lengths)
    v, _ = ref.pack(v_pad, lengths)
    # Two extra rows after the last sequence belong to nobody: zero gradient.
    k = jnp.concatenate([jnp.asarray(k), jnp.ones((2, 1, 16))])
    v = jnp.concatenate([jnp.asarray(v), jnp.ones((2, 1, 16))])
    seq = SequenceDescriptor.from_kv_offsets(offsets)
    out, _, dk, dv = _grads(lambda q, k, v: fused_attn_small_seq(q, k, v, sequence=seq), q, k, v, d_o)
    assert ref.rel_err(out, ref.attention(q, k_pad, v_pad, lengths, 0.25)) < 1e-5
    assert np.all(np.asarray(dk)[-2:] == 0) and np.all(np.asarray(dv)[-2:] == 0)


def test_jit_with_traced_lengths_and_offsets():
    q, k, v, _ = _inputs(5, 4, 8, 2, 2, 16, "float32")
    lengths = jnp.array([8, 2, 0, 5], jnp.int32)
    out = jax.jit(lambda q, k, v, l: fused_attn_small_seq(q, k, v, sequence=l))(q, k, v, lengths)
    assert ref.rel_err(out, ref.attention(q, k, v, np.asarray(lengths), 0.25)) < 1e-5
    kp, offsets = ref.pack(k, np.asarray(lengths))
    vp, _ = ref.pack(v, np.asarray(lengths))
    out = jax.jit(lambda q, k, v, o: fused_attn_small_seq(q, k, v, sequence=o))(q, kp, vp, offsets)
    assert ref.rel_err(out, ref.attention(q, k, v, np.asarray(lengths), 0.25)) < 1e-5


def test_traced_malformed_offsets_give_nan_rows():
    q, k, v, _ = _inputs(6, 3, 1, 2, 2, 16, "float32")
    kp = jnp.ones((40, 2, 16))
    offsets = jnp.array([0, 3, 20, 41], jnp.int32)  # 17 keys; past the end
    out = np.asarray(jax.jit(lambda o: fused_attn_small_seq(q, kp, kp, sequence=o))(offsets))
    assert np.all(np.isfinite(out[0])) and np.all(np.isnan(out[1])) and np.all(np.isnan(out[2]))


@pytest.mark.parametrize("option,value", [("bias", jnp.zeros((1, 1, 1, 4))), ("dropout", 0.1),
                                          ("mask", "causal"), ("window", (2, 0)),
                                          ("softmax", "off_by_one"), ("layout", "sbhd")])
def test_unsupported_options_name_the_rule(option, value):
    q, k, v, _ = _inputs(0, 2, 4, 2, 2, 16, "float32")
    with pytest.raises(ValueError, match=f"{option}=.*small-seq attention"):
        fused_attn_small_seq(q, k, v, **{option: value})


def test_neutral_options_are_accepted_and_unknown_ones_rejected():
    q, k, v, _ = _inputs(0, 2, 4, 2, 2, 16, "float32")
    fused_attn_small_seq(q, k, v, bias=None, dropout=0.0, mask="none")
    with pytest.raises(TypeError, match="unexpected keyword argument 'causal'"):
        fused_attn_small_seq(q, k, v, causal=True)


@pytest.mark.parametrize("case,error,match", [
    ("long", ValueError, "at most 16"),
    ("two_queries", ValueError, "one query token"),
    ("k_rank", ValueError, "padded .* or packed"),
    ("packed_no_sequence", ValueError, "need sequence"),
    ("packed_too_long", ValueError, "at most 16"),
    ("offsets_shape", ValueError, r"shape \(4,\)"),
    ("offsets_range", ValueError, "non-decreasing"),
    ("lengths_float", TypeError, "integer"),
    ("kind_mismatch", ValueError, "from_kv_offsets"),
    ("q_lengths", ValueError, "0 or 1"),
    ("gqa", ValueError, "multiple"),
    ("dtype_mix", TypeError, "same dtype"),
])
def test_validation(case, error, match):
    q, k, v, _ = _inputs(0, 3, 4, 4, 2, 16, "float32")
    kp = jnp.ones((20, 2, 16))
    args = {
        "long": (q, jnp.ones((3, 17, 2, 16)), jnp.ones((3, 17, 2, 16)), {}),
        "two_queries": (jnp.ones((3, 2, 4, 16)), k, v, {}),
        "k_rank": (q, jnp.ones((3, 16)), v, {}),
        "packed_no_sequence": (q, kp, kp, {}),
        "packed_too_long": (q, kp, kp, {"sequence": np.array([0, 1, 19, 20])}),
        "offsets_shape": (q, kp, kp, {"sequence": np.array([0, 1, 2])}),
        "offsets_range": (q, kp, kp, {"sequence": np.array([0, 5, 3, 6])}),
        "lengths_float": (q, k, v, {"sequence": np.array([1.0, 2.0, 3.0])}),
        "kind_mismatch": (q, kp, kp, {"sequence": SequenceDescriptor.from_lengths([1, 1, 1], [1, 2, 3])}),
        "q_lengths": (q, k, v, {"sequence": SequenceDescriptor.from_lengths([1, 2, 1], [1, 2, 3])}),
        "gqa": (jnp.ones((3, 1, 3, 16)), k, v, {}),
        "dtype_mix": (q.astype(jnp.bfloat16), k, v, {}),
    }[case]
    with pytest.raises(error, match=match):
        fused_attn_small_seq(*args[:3], **args[3])


def test_configs_and_plan():
    q, k, v, _ = _inputs(0, 3, 16, 4, 2, 128, "bfloat16")
    call = build_small_seq_call(q, jnp.ones((30, 2, 128), jnp.bfloat16),
                                jnp.ones((30, 2, 128), jnp.bfloat16), sequence=np.array([0, 1, 2, 30 - 14]))
    assert call.config.sequence == "ragged" and call.padded_config.sequence == "padding"
    assert call.config.api == "small_seq" and call.config.s_kv == 16 and call.config.s_q == 1
    plan = plan_small_seq(q, k, v)
    assert plan.chosen == "xla"  # CPU
    assert "cuda/rocm" in dict(plan.reasons)["small_seq"]


def _config(**changes):
    base = AttnConfig(batch=8, s_q=1, s_kv=16, h_q=16, h_kv=4, d_qk=128, d_v=128, dtype="bfloat16",
                      api="fused_attn", sequence="padding")
    return dataclasses.replace(base, **changes)


def test_supports_fused_attn_configs_of_small_seq_shape():
    assert small_seq.config_reason(_config()) is None
    assert small_seq.config_reason(_config(sequence="dense", s_kv=4, d_qk=512, d_v=512)) is None
    for changes, words in [({"s_q": 2}, "s_q == 1"), ({"s_kv": 17}, "at most 16"),
                           ({"bias_shape": (1, 1, 1, 16)}, "bias"), ({"dropout": 0.1}, "dropout"),
                           ({"mask": "causal"}, "causal"), ({"window": (3, 0)}, "window"),
                           ({"softmax": "off_by_one"}, "vanilla"), ({"dtype": "float32"}, "dtype"),
                           ({"d_qk": 96, "d_v": 96}, "head dim"), ({"d_v": 64}, "head dim"),
                           ({"sequence": "packed"}, "sequence kind"), ({"layout": "sbhd"}, "bshd"),
                           ({"qkv_packing": "kv"}, "separate"), ({"h_q": 64, "h_kv": 1}, "per kv head"),
                           ({"score_mod": abs}, "score_mod")]:
        reason = small_seq.config_reason(_config(**changes))
        assert reason is not None and words in reason, (changes, reason)


def test_forced_small_seq_backend_on_cpu_raises_with_reasons():
    q, k, v, _ = _inputs(0, 2, 4, 2, 2, 128, "bfloat16")
    with pytest.raises(ValueError, match="small_seq"):
        fused_attn_small_seq(q, k, v, backend="small_seq")
