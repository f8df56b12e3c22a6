"""The built-in score_mods (fusedattn.score_mods): values, hashing, and the XLA
backend running them against the float64 oracle (forward, lse, every gradient)."""
from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
import pytest

from support import attn_cases as ac
import fusedattn
from fusedattn import dispatch, score_mods
from fusedattn.backends.xla.tiles import Tiling
from fusedattn.config import AttnConfig


# ---- ALiBi slopes ------------------------------------------------------------
def _paper_slopes(h: int):
    """The ALiBi paper's construction, written independently: for a power of two,
    a geometric sequence starting (and with ratio) 2^(-8/h); otherwise the slopes of
    the closest smaller power of two c, then every other slope of 2c."""
    def power_of_two(n):
        start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
        return [start * start ** i for i in range(n)]
    if math.log2(h).is_integer():
        return power_of_two(h)
    c = 2 ** math.floor(math.log2(h))
    return power_of_two(c) + power_of_two(2 * c)[0::2][:h - c]


@pytest.mark.parametrize("h", [8, 12, 16])
def test_slopes_match_an_independent_computation(h):
    got = score_mods.alibi_slopes(h)
    assert got.dtype == np.float32 and got.shape == (h,)
    np.testing.assert_allclose(got, np.asarray(_paper_slopes(h), np.float32), rtol=1e-7, atol=0)


def test_slopes_of_twelve_heads_spelled_out():
    # n = 8: 2^-1 .. 2^-8, then the odd slopes of 16 heads: 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5
    want = [2.0 ** -e for e in (1, 2, 3, 4, 5, 6, 7, 8, 0.5, 1.5, 2.5, 3.5)]
    np.testing.assert_array_equal(score_mods.alibi_slopes(12), np.asarray(want, np.float32))
    np.testing.assert_array_equal(score_mods.alibi(12).slopes(), score_mods.alibi_slopes(12))


# ---- values, hashing, equality -----------------------------------------------
def test_equal_instances_are_equal_and_hash_alike():
    assert score_mods.alibi(8) == score_mods.alibi(8) == score_mods.Alibi(np.int64(8))
    assert hash(score_mods.alibi(8)) == hash(score_mods.alibi(8))
    assert score_mods.alibi(8) != score_mods.alibi(4)
    assert score_mods.softcap(30) == score_mods.softcap(30.0)
    assert hash(score_mods.softcap(30)) == hash(score_mods.softcap(30.0))
    assert score_mods.softcap(30.0) != score_mods.softcap(20.0)
    assert score_mods.softcap(8.0) != score_mods.alibi(8)
    assert len({score_mods.alibi(8), score_mods.alibi(8), score_mods.softcap(1.5)}) == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        score_mods.alibi(8).num_heads = 4


def test_configs_with_equal_score_mods_share_caches():
    base = AttnConfig(batch=1, s_q=8, s_kv=8, h_q=4, h_kv=4, d_qk=8, d_v=8, dtype="float32",
                      mask="causal")
    a = dataclasses.replace(base, score_mod=score_mods.alibi(4))
    b = dataclasses.replace(base, score_mod=score_mods.alibi(4))
    assert a == b and hash(a) == hash(b)
    assert dispatch.plan(a, platform="cpu") is dispatch.plan(b, platform="cpu")
    assert a != dataclasses.replace(base, score_mod=score_mods.softcap(4.0))
    assert "score_mod=alibi4" in a.short()
    assert "score_mod=softcap2.5" in dataclasses.replace(base, score_mod=score_mods.softcap(2.5)).short()


@pytest.mark.parametrize("make, bad", [
    (score_mods.alibi, 0), (score_mods.alibi, -3), (score_mods.alibi, 2.5), (score_mods.alibi, True),
    (score_mods.softcap, 0.0), (score_mods.softcap, -1.0), (score_mods.softcap, float("inf")),
    (score_mods.softcap, float("nan")), (score_mods.softcap, "30"),
])
def test_bad_arguments_raise(make, bad):
    with pytest.raises(ValueError):
        make(bad)


def test_values_on_a_small_grid():
    score = jnp.asarray(np.linspace(-40.0, 40.0, 24).reshape(1, 2, 3, 4), jnp.float32)
    batch = jnp.zeros((1, 1, 1, 1), jnp.int32)
    head = jnp.arange(2).reshape(1, 2, 1, 1)
    q_idx = jnp.arange(3).reshape(1, 1, 3, 1)
    kv_idx = jnp.arange(4).reshape(1, 1, 1, 4)
    capped = np.asarray(score_mods.softcap(5.0)(score, batch, head, q_idx, kv_idx))
    np.testing.assert_allclose(capped, 5.0 * np.tanh(np.asarray(score) / 5.0), rtol=1e-6)
    assert np.all(np.abs(capped) <= 5.0)  # (tanh rounds to 1 in float32 far out)
    biased = np.asarray(score_mods.alibi(2)(score, batch, head, q_idx, kv_idx))
    slopes = score_mods.alibi_slopes(2)  # [2^-4, 2^-8]
    want = np.asarray(score) + slopes[None, :, None, None] * (np.arange(4)[None, None, None, :]
                                                              - np.arange(3)[None, None, :, None])
    np.testing.assert_allclose(biased, want, rtol=1e-6)


# ---- through the XLA backend, against the float64 oracle ----------------------
ALIBI4 = score_mods.alibi(4)
CASES = [
    ac.Case(score_mod=ALIBI4, mask="causal"),
    ac.Case(score_mod=ALIBI4, mask="causal", sequence="padding", s_q=13, s_kv=22),
    ac.Case(score_mod=ALIBI4, mask="causal", sequence="packed", h_kv=1),
    ac.Case(score_mod=ALIBI4, window=(6, 0), bias=(False, True), dtype="bfloat16"),
    ac.Case(score_mod=score_mods.alibi(4), mask="causal", softmax="learnable", layout="sbhd"),
    ac.Case(score_mod=score_mods.softcap(2.0), scale=1.0),
    ac.Case(score_mod=score_mods.softcap(2.0), scale=1.0, mask="causal", sequence="padding",
            dtype="float16"),
    ac.Case(score_mod=score_mods.softcap(1.5), scale=1.0, bias=(True, True), layout="bs3hd"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.label() for c in CASES])
@pytest.mark.parametrize("tiled", [False, True])
def test_against_oracle(case, tiled):
    case = case.fixed()
    tiling = Tiling.from_blocks(case.s_q, case.s_kv, 8, 6) if tiled else None
    ac.check_case(case, tiling=tiling)


def test_the_score_mods_matter_for_these_inputs():
    """Each case's score_mod changes the oracle's output by more than twice the tolerance, so
    the comparisons above would see a backend that ignored it."""
    for case in CASES:
        built = ac.build(case)
        plain = ac.build(dataclasses.replace(case, score_mod=None))
        err = ac.rel_error(ac.oracle_for(built).out, ac.oracle_for(plain).out)
        assert err > 2 * ac.TOLERANCE[case.dtype], (case.label(), err)


def test_alibi_equals_the_bias_it_stands_for():
    """Dense ALiBi is an additive bias [1, h, s_q, s_kv] = slope[h] * (j - i)."""
    built = ac.build(ac.Case(mask="causal", s_q=17, s_kv=17, h_kv=4))
    slopes = score_mods.alibi_slopes(4)
    i, j = np.arange(17)[:, None], np.arange(17)[None, :]
    bias = jnp.asarray((slopes[:, None, None] * (j - i))[None], jnp.float32)
    with_mod = fusedattn.fused_attn(built.q, built.k, built.v, mask="causal", backend="xla",
                                    score_mod=score_mods.alibi(4))
    with_bias = fusedattn.fused_attn(built.q, built.k, built.v, mask="causal", backend="xla",
                                     bias=bias)
    np.testing.assert_allclose(np.asarray(with_mod), np.asarray(with_bias), rtol=1e-5, atol=1e-6)


def test_softcap_equals_the_function_it_stands_for():
    built = ac.build(ac.Case(bias=(False, True)))
    fn = lambda s, b, h, i, j: 3.0 * jnp.tanh(s / 3.0)  # noqa: E731
    outs = [fusedattn.fused_attn(built.q, built.k, built.v, bias=built.bias, backend="xla",
                                 score_mod=mod) for mod in (score_mods.softcap(3.0), fn)]
    np.testing.assert_allclose(np.asarray(outs[0]), np.asarray(outs[1]), rtol=1e-6, atol=1e-7)
