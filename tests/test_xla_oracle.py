"""The XLA backend against the float64 oracle: forward, lse and every gradient.

The matrix is a structured selection, not the full product: every combination
of mask x sequence kind x tiling x (s_q == s_kv or not) runs, and the other
axes (window, bias broadcast, softmax variant, GQA, d_qk != d_v, layout,
dtype) cycle through it with different strides, so each of their values meets
several masks and sequence kinds, always with gradients.
"""
from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from support import attn_cases as ac
from support import oracle
from fusedattn.backends import xla
from fusedattn.backends.xla.tiles import TILE, Tiling, choose_tiling
from fusedattn.config import AttnConfig

MASKS = ("none", "causal", "causal_bottom_right")
SEQUENCES = ("dense", "padding", "packed")
WINDOWS = (None, (5, 0), (3, 2), (0, 4), (7, -1))
BIASES = (None, (False, False), (True, False), (False, True), (True, True))
SOFTMAXES = ("vanilla", "off_by_one", "learnable")
HEADS = ((4, 4), (4, 2), (4, 1))           # MHA, GQA, MQA
HEAD_DIMS = ((16, 16), (16, 8), (8, 24))
LAYOUTS = ("bshd", "sbhd", "bs3hd", "sb3hd", "bshd_bs2hd", "sbhd_sb2hd")
DTYPES = ("float32", "bfloat16", "float16")


def _matrix():
    cases = []
    for n, (mask, seq, tiled, cross) in enumerate(
            itertools.product(MASKS, SEQUENCES, (False, True), (False, True))):
        pick = lambda values, stride: values[(n * stride + n // len(values)) % len(values)]  # noqa: E731
        h_q, h_kv = pick(HEADS, 1)
        d_qk, d_v = pick(HEAD_DIMS, 2)
        case = ac.Case(
            s_q=13 if cross else 21, s_kv=22 if cross else 21, h_q=h_q, h_kv=h_kv, d_qk=d_qk,
            d_v=d_v, mask=mask, sequence=seq, window=pick(WINDOWS, 3), bias=pick(BIASES, 2),
            softmax=pick(SOFTMAXES, 1), layout=pick(LAYOUTS, 5), dtype=pick(DTYPES, 1), seed=n)
        cases.append((case.fixed(), tiled))
    return cases


MATRIX = _matrix()


def test_matrix_covers_every_value():
    seen = {axis: {getattr(c, axis) for c, _ in MATRIX}
            for axis in ("mask", "sequence", "window", "bias", "softmax", "layout", "dtype")}
    assert seen["mask"] == set(MASKS) and seen["sequence"] == set(SEQUENCES)
    assert seen["window"] >= {None, (5, 0), (3, 2), (0, 4)}
    assert seen["bias"] == set(BIASES) and seen["softmax"] == set(SOFTMAXES)
    assert seen["layout"] == set(LAYOUTS) and seen["dtype"] == set(DTYPES)
    assert {(c.h_q, c.h_kv) for c, _ in MATRIX} == set(HEADS)
    assert any(c.d_qk != c.d_v for c, _ in MATRIX)


def _tiling(case: ac.Case, tiled: bool):
    # Blocks that do not divide the lengths, so internal padding is exercised too.
    return Tiling.from_blocks(case.s_q, case.s_kv, 8, 6) if tiled else None


@pytest.mark.parametrize("case,tiled", MATRIX, ids=[c.label() + ("-tiled" if t else "")
                                                    for c, t in MATRIX])
def test_against_oracle(case, tiled):
    ac.check_case(case, tiling=_tiling(case, tiled))


# ---- score_mod -----------------------------------------------------------
def soft_cap(score, batch, head, q_idx, kv_idx):
    return 5.0 * jnp.tanh(score / 5.0)


def relative_bias(score, batch, head, q_idx, kv_idx, table):
    # table [h, 2 * max_distance + 1], one learned bias per head and clipped distance.
    distance = jnp.clip(kv_idx - q_idx, -8, 8) + 8
    return score + table[head, distance]


def alibi(score, batch, head, q_idx, kv_idx, slopes):
    return score - slopes[head] * jnp.abs(q_idx - kv_idx).astype(score.dtype)


def causal_score_mod(score, batch, head, q_idx, kv_idx):
    return jnp.where(kv_idx <= q_idx, score, -jnp.inf)


def _slopes(h):
    return (2.0 ** (-8.0 * np.arange(1, h + 1) / h)).astype(np.float32)


SCORE_MODS = [
    ac.Case(score_mod=soft_cap, scale=1.0),
    ac.Case(score_mod=relative_bias, sequence="packed", mask="causal",
            score_mod_args=(np.random.default_rng(1).standard_normal((4, 17)).astype(np.float32),)),
    ac.Case(score_mod=alibi, sequence="padding", score_mod_args=(_slopes(4),), h_kv=1),
    ac.Case(score_mod=causal_score_mod, sequence="padding", softmax="off_by_one"),
    ac.Case(score_mod=soft_cap, dtype="bfloat16", layout="sbhd", bias=(True, True), scale=1.0),
]


@pytest.mark.parametrize("case", SCORE_MODS, ids=[c.label() for c in SCORE_MODS])
@pytest.mark.parametrize("tiled", [False, True])
def test_score_mod_against_oracle(case, tiled):
    ac.check_case(case, tiling=_tiling(case, tiled))


def test_causal_score_mod_equals_causal_mask():
    base = ac.build(ac.Case(sequence="packed", seed=3))
    as_mod = ac.build(ac.Case(sequence="packed", seed=3, score_mod=causal_score_mod))
    as_mask = ac.build(ac.Case(sequence="packed", seed=3, mask="causal"))
    out_mod, _, g_mod = ac.run_backend(as_mod)
    out_mask, _, g_mask = ac.run_backend(as_mask)
    out_none, _, _ = ac.run_backend(base)
    np.testing.assert_allclose(out_mod, out_mask, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(g_mod["dq"], g_mask["dq"], rtol=1e-5, atol=1e-6)
    assert ac.rel_error(out_none, out_mask) > 1e-2  # the mask matters for these inputs


# ---- padding, empty rows, lse ---------------------------------------------
def test_padded_and_empty_rows_are_zero_with_finite_grads():
    """Row 0: kv length 0 (every query sees nothing); row 1: queries past q length.
    Bottom-right with len_kv < len_q leaves the first queries of row 1 with no key."""
    q_len, kv_len = np.array([6, 9], np.int32), np.array([0, 4], np.int32)
    case = ac.Case(s_q=12, s_kv=10, mask="causal_bottom_right", sequence="padding")
    built = ac.build(case)
    from fusedattn.sequence import SequenceDescriptor
    built.sequence = SequenceDescriptor.from_lengths(q_len, kv_len)
    built.ref_kwargs.update(q_lengths=q_len, kv_lengths=kv_len)
    for tiling in (None, Tiling.from_blocks(12, 10, 4, 4)):
        out, lse, grads = ac.run_backend(built, tiling)
        ref = ac.oracle_for(built)
        assert np.all(out[0] == 0.0) and np.all(out[1, 9:] == 0.0) and np.all(out[1, :5] == 0.0)
        assert np.all(np.isneginf(lse[0]))
        for name in ("dq", "dk", "dv"):
            assert np.all(np.isfinite(grads[name]))
            ac.assert_close(name, grads[name], getattr(ref, name), 1e-5)
        assert np.all(grads["dq"][0] == 0.0) and np.all(grads["dk"][0] == 0.0)
        ac.assert_close("out", out, ref.out, 1e-5)


def test_lse_cotangent_against_oracle():
    built = ac.build(ac.Case(sequence="packed", softmax="learnable", mask="causal"))
    from fusedattn.validation import build_call
    config, inputs = build_call(built.q, built.k, built.v, **built.options())
    w = jnp.asarray(np.random.default_rng(5).standard_normal((2, 4, 20)), jnp.float32)

    def loss(q, k, v, offset):
        out, lse = xla.attention_with_lse(config, inputs._replace(q=q, k=k, v=v,
                                                                  softmax_offset=offset))
        return jnp.sum(out * built.d_out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse * w, 0.0))
    grads = jax.grad(loss, argnums=(0, 1, 2, 3))(built.q, built.k, built.v, built.offset)
    f64 = lambda x: np.asarray(x, np.float64)  # noqa: E731
    ref = oracle.attention(f64(built.q), f64(built.k), f64(built.v), d_lse=f64(w), **built.ref_kwargs)
    for g, r, name in zip(grads, (ref.dq, ref.dk, ref.dv, ref.d_offset), ("dq", "dk", "dv", "d_offset")):
        ac.assert_close(name, f64(g), r, 1e-5)


# ---- entry points and shapes ----------------------------------------------
def test_public_api_runs_the_xla_backend():
    import fusedattn
    built = ac.build(ac.Case(mask="causal", sequence="padding", bias=(False, True)))
    out = fusedattn.fused_attn(built.q, built.k, built.v, backend="xla", **built.options())
    ref = ac.oracle_for(built)
    ac.assert_close("out", np.asarray(out, np.float64), ref.out, 1e-5)


def test_small_seq_shape_single_query():
    """The shape fused_attn_small_seq's XLA path uses: one query, <= 16 keys, padded keys."""
    case = ac.Case(b=64, s_q=1, s_kv=16, h_q=8, h_kv=2, d_qk=32, d_v=32, sequence="padding")
    config = AttnConfig(batch=64, s_q=1, s_kv=16, h_q=8, h_kv=2, d_qk=32, d_v=32, dtype="float32")
    assert choose_tiling(config).n_q == choose_tiling(config).n_kv == 1
    ac.check_case(case)


def test_vmap_of_tiled_backend():
    """vmap turns the tile-skipping conds into selects; results must not change."""
    cases = [ac.build(ac.Case(b=1, mask="causal", sequence="packed", seed=s)) for s in (1, 2)]
    from fusedattn.validation import build_call
    config, _ = build_call(cases[0].q, cases[0].k, cases[0].v, **cases[0].options())
    tiling = Tiling.from_blocks(20, 20, 8, 8)

    def one(q, k, v, seq):
        _, inputs = build_call(q, k, v, **dict(cases[0].options(), sequence=seq))
        return xla.attention_with_lse(config, inputs, tiling=tiling)[0]
    stack = lambda *xs: jax.tree_util.tree_map(lambda *a: jnp.stack(a), *xs)  # noqa: E731
    out = jax.vmap(one)(*(stack(*(getattr(c, n) for c in cases)) for n in ("q", "k", "v", "sequence")))
    for i, c in enumerate(cases):
        ac.assert_close("out", np.asarray(out[i], np.float64), ac.oracle_for(c).out, 1e-5)


@pytest.mark.parametrize("shape,expect_single", [
    ((2, 1024, 1024, 8), True),        # the benchmark shape: one tile, no loop
    ((1, 16384, 16384, 8), False),     # the long case: tiles
    ((4, 3000, 5000, 16), False),
])
def test_tiling_choice(shape, expect_single):
    b, s_q, s_kv, h = shape
    config = AttnConfig(batch=b, s_q=s_q, s_kv=s_kv, h_q=h, h_kv=h, d_qk=64, d_v=64, dtype="float32")
    t = choose_tiling(config)
    assert (t.n_q * t.n_kv == 1) == expect_single
    assert t.s_q >= s_q and t.s_kv >= s_kv and t.s_q % t.block_q == 0 and t.s_kv % t.block_kv == 0
    if not expect_single:
        assert b * h * t.block_q * t.block_kv <= TILE
        assert t.s_q - s_q < t.n_q * 8 and t.s_kv - s_kv < t.n_kv * 8  # little padding


def test_supports():
    config = AttnConfig(batch=1, s_q=4, s_kv=4, h_q=2, h_kv=1, d_qk=8, d_v=4, dtype="bfloat16",
                        mask="causal_bottom_right", softmax="learnable", dropout=0.1,
                        sequence="packed", max_segments=2, layout="sbhd", qkv_packing="kv")
    assert xla.BACKEND.supports(config) is None
    import dataclasses
    assert "ragged" in xla.BACKEND.supports(dataclasses.replace(config, sequence="ragged"))
    assert "dtype" in xla.BACKEND.supports(dataclasses.replace(config, dtype="float8_e4m3fn"))


def test_bias_of_minus_infinity_masks_like_a_mask():
    """A -inf bias (a common way to mask) may empty whole rows: 0 output, finite grads."""
    built = ac.build(ac.Case(bias=(True, True), softmax="vanilla"))
    bias = np.array(built.bias, np.float32)
    bias[0, :, :, 5:] = -np.inf      # batch 0: only keys 0..4 visible
    bias[1, 2, 7, :] = -np.inf       # batch 1, head 2, query 7: no key at all
    built.bias = jnp.asarray(bias)
    built.ref_kwargs["bias"] = bias.astype(np.float64)
    for tiling in (None, Tiling.from_blocks(20, 20, 8, 8)):
        out, lse, grads = ac.run_backend(built, tiling)
        ref = ac.oracle_for(built)
        assert np.all(out[1, 7, 2] == 0.0) and np.isneginf(lse[1, 2, 7])
        ac.assert_close("out", out, ref.out, 1e-5)
        for name in ("dq", "dk", "dv"):
            ac.assert_close(name, grads[name], getattr(ref, name), 1e-5)
        finite = np.isfinite(bias)
        assert np.all(grads["dbias"][~finite] == 0.0)
        ac.assert_close("dbias", grads["dbias"][finite], ref.dbias[finite], 1e-5)
