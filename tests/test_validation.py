"""Every bad input raises ValueError/TypeError naming the argument, before any kernel."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fusedattn
from fusedattn import SequenceDescriptor
from fusedattn.validation import build_call

B, S, H, D = 2, 16, 4, 8


def arr(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


Q = arr((B, S, H, D))


def check(exc, match, *args, **kw):
    with pytest.raises(exc, match=match):
        build_call(*args, **kw)


def test_valid_call_builds_config():
    cfg, inputs = build_call(Q, arr((B, 32, 2, D)), arr((B, 32, 2, 16)), mask="causal")
    assert (cfg.batch, cfg.s_q, cfg.s_kv, cfg.h_q, cfg.h_kv, cfg.d_qk, cfg.d_v) == (B, S, 32, H, 2, D, 16)
    assert cfg.scale == pytest.approx(D ** -0.5) and cfg.group_size == 2
    hash(cfg)  # configs key caches


@pytest.mark.parametrize("args,exc,match", [
    ((arr((B, S, H)), Q, Q), ValueError, "q must have rank 4"),
    ((Q, arr((B, S, H)), Q), ValueError, "k must have rank 4"),
    ((Q, Q, "v"), TypeError, "v must be an array"),
    ((Q, arr((B + 1, S, H, D)), arr((B + 1, S, H, D))), ValueError, "k batch size"),
    ((Q, arr((B, S, H, D)), arr((B, S + 1, H, D))), ValueError, "same sequence length"),
    ((Q, arr((B, S, H, D)), arr((B, S, 2, D))), ValueError, "same number of heads"),
    ((Q, arr((B, S, H, D + 1)), Q), ValueError, "head dim"),
    ((Q, arr((B, S, 3, D)), arr((B, S, 3, D))), ValueError, r"h_q % h_kv == 0"),
    ((Q, arr((B, S, H, D), jnp.float16), Q), TypeError, "same dtype"),
    ((arr((B, S, H, D), jnp.int32),) * 3, TypeError, "dtype must be one of"),
])
def test_bad_tensors(args, exc, match):
    check(exc, match, *args)


@pytest.mark.parametrize("kw,exc,match", [
    (dict(mask="padding"), ValueError, "mask must be one of"),
    (dict(window=(2,)), TypeError, "window must be a"),
    (dict(window=(-2, 0)), ValueError, "window sides"),
    (dict(window=(4, 2), mask="causal"), ValueError, "window right side must be 0"),
    (dict(bias=arr((B, H, S))), ValueError, "bias must have rank 4"),
    (dict(bias=arr((3, H, S, S))), ValueError, "dimension 0 must be 2 or 1"),
    (dict(bias=arr((1, 1, S, S + 1))), ValueError, "dimension 3 must be 16"),
    (dict(bias=arr((1, 1, S, S), jnp.int32)), TypeError, "bias must be a floating"),
    (dict(scale="big"), TypeError, "scale must be"),
    (dict(softmax="sparsemax"), ValueError, "softmax must be one of"),
    (dict(softmax="learnable"), ValueError, "needs softmax_offset"),
    (dict(softmax="learnable", softmax_offset=arr((H + 1,), jnp.float32)), ValueError, "softmax_offset must have shape"),
    (dict(softmax_offset=arr((H,), jnp.float32)), ValueError, "only used with softmax='learnable'"),
    (dict(dropout=1.0, rng=jax.random.PRNGKey(0)), ValueError, r"dropout must be a float in \[0, 1\)"),
    (dict(dropout=-0.1), ValueError, "dropout must be"),
    (dict(dropout=0.1), ValueError, "needs rng"),
    (dict(score_mod=3), TypeError, "score_mod must be a function"),
    (dict(score_mod_args=(jnp.ones(3),)), ValueError, "without score_mod"),
    (dict(deterministic=1), TypeError, "deterministic must be a bool"),
    (dict(layout="bhsd"), ValueError, "layout must be one of"),
    (dict(sequence=(3, 4)), TypeError, "SequenceDescriptor"),
])
def test_bad_options(kw, exc, match):
    check(exc, match, Q, Q, Q, **kw)


def test_packed_layouts():
    qkv = arr((B, S, 3, H, D))
    cfg, _ = build_call(qkv, None, None, layout="bs3hd")
    assert cfg.qkv_packing == "qkv" and (cfg.s_q, cfg.h_q, cfg.d_qk) == (S, H, D)
    check(ValueError, "must have 3 at dimension 2", arr((B, S, 2, H, D)), None, None, layout="bs3hd")
    check(ValueError, "k and v must be None", qkv, Q, None, layout="bs3hd")
    cfg, _ = build_call(arr((S, B, H, D)), arr((S, B, 2, H, D)), None, layout="sbhd_sb2hd")
    assert cfg.layout == "sbhd" and cfg.batch == B and cfg.s_q == S
    check(ValueError, "v must be None", Q, arr((B, S, 2, H, D)), Q, layout="bshd_bs2hd")


@pytest.mark.parametrize("lengths,match", [
    (np.array([3, -1]), r"q_lengths must lie in \[0, 16\]"),
    (np.array([3, 17]), r"q_lengths must lie in \[0, 16\]"),
])
def test_lengths_out_of_range(lengths, match):
    check(ValueError, match, Q, Q, Q, sequence=SequenceDescriptor.from_lengths(lengths))


def test_lengths_shape_and_dtype():
    check(ValueError, "q_lengths must have shape", Q, Q, Q,
          sequence=SequenceDescriptor.from_lengths(np.array([1, 2, 3])))
    check(TypeError, "integer array", Q, Q, Q,
          sequence=SequenceDescriptor.from_lengths(np.array([1.0, 2.0])))


def test_segment_ids_must_be_sorted():
    ids = np.array([[1, 1, 2, 2] * 4, [1] * 8 + [2] * 8])
    check(ValueError, "segment_ids must be sorted", Q, Q, Q,
          sequence=SequenceDescriptor.from_segment_ids(ids, max_segments=2))
    gap = np.array([[1] * 8 + [0] * 4 + [2] * 4, [1] * 16])
    check(ValueError, "padding \\(0\\) only at the end", Q, Q, Q,
          sequence=SequenceDescriptor.from_segment_ids(gap, max_segments=2))
    too_many = np.array([[1] * 8 + [3] * 8, [1] * 16])
    check(ValueError, "segment_ids must lie in", Q, Q, Q,
          sequence=SequenceDescriptor.from_segment_ids(too_many, max_segments=2))


def test_positions_must_count_within_segments():
    ids = np.array([[1] * 8 + [2] * 8, [1] * 16])
    bad = np.tile(np.arange(16), (2, 1))  # does not restart at segment 2
    check(ValueError, "q_positions must count", Q, Q, Q,
          sequence=SequenceDescriptor.from_segment_ids(ids, q_positions=bad, max_segments=2))


def test_offsets_must_be_back_to_back():
    lens = np.array([[4, 4], [8, 0]])
    check(ValueError, "back to back", Q, Q, Q, sequence=SequenceDescriptor.from_seqlens_offsets(
        lens, np.array([[0, 6], [0, 0]]), q_len=S))
    check(ValueError, "must not exceed", Q, Q, Q, sequence=SequenceDescriptor.from_seqlens_offsets(
        np.array([[12, 8], [8, 0]]), np.array([[0, 12], [0, 8]]), q_len=S))


def test_packing_forms_agree():
    ids = np.array([[1] * 5 + [2] * 7 + [0] * 4, [1] * 16])
    a = SequenceDescriptor.from_segment_ids(ids, max_segments=3)
    b = SequenceDescriptor.from_seqlens_offsets(np.array([[5, 7, 0], [16, 0, 0]]),
                                                np.array([[0, 5, 12], [0, 16, 16]]), q_len=S)
    for field in ("q_segment_ids", "q_positions", "q_lengths"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
    np.testing.assert_array_equal(a.q_positions[0, :12], list(range(5)) + list(range(7)))


def test_traced_lengths_are_accepted_under_jit():
    # Value checks need concrete values; under jit the same call must still trace.
    @jax.jit
    def f(lengths):
        cfg, _ = build_call(Q, Q, Q, sequence=SequenceDescriptor.from_lengths(lengths))
        return jnp.int32(cfg.batch)
    assert int(f(jnp.array([3, 4]))) == B


def test_fused_attn_validates_before_dispatch():
    with pytest.raises(ValueError, match="mask must be one of"):
        fusedattn.fused_attn(jnp.ones((B, S, H, D)), jnp.ones((B, S, H, D)),
                             jnp.ones((B, S, H, D)), mask="sliding")


def test_score_mod_of_the_wrong_shape_is_named():
    q = jnp.ones((2, 16, 4, 8))
    with pytest.raises(ValueError, match=r"score_mod\(score, .*returned shape \(2, 4, 2\): "
                                         r"score_mod must be elementwise"):
        fusedattn.fused_attn(q, q, q, score_mod=lambda s, b, h, i, j: s.sum(-1))
    with pytest.raises(ValueError, match=r"score_mod\(score, .* failed: TypeError"):
        fusedattn.fused_attn(q, q, q, score_mod=lambda s, b, h, i, j: s + None)
    with pytest.raises(ValueError, match="returned None"):
        fusedattn.fused_attn(q, q, q, score_mod=lambda s, b, h, i, j: None)
