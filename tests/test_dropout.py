"""Dropout in the XLA backend: reproducible, one mask for forward and backward
(whatever the tiling), and the right keep rate."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from support import attn_cases as ac
from fusedattn.backends import xla
from fusedattn.backends.xla.tiles import Tiling
from fusedattn.config import AttnConfig
from fusedattn.validation import build_call

RATE = 0.3


def _config(built: ac.Built) -> AttnConfig:
    q, k, v = ac._to_user_layout(built.case, built.q, built.k, built.v)
    return build_call(q, k, v, **built.options())[0]


def _keep(built: ac.Built) -> np.ndarray:
    return np.asarray(xla.dropout_keep_mask(_config(built), built.rng))


CASES = [
    ac.Case(dropout=RATE),
    ac.Case(dropout=RATE, mask="causal", sequence="packed", bias=(True, False),
            softmax="learnable", h_kv=1),
    ac.Case(dropout=0.5, sequence="padding", s_q=9, s_kv=17, d_v=8, dtype="bfloat16",
            layout="sbhd"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.label() for c in CASES])
@pytest.mark.parametrize("tiled", [False, True])
def test_forward_and_backward_use_the_published_mask(case, tiled):
    """Oracle given the keep mask `dropout_keep_mask` publishes: forward and every
    gradient match, so the backward pass saw exactly the forward's mask."""
    built = ac.build(case)
    tiling = Tiling.from_blocks(built.case.s_q, built.case.s_kv, 8, 8) if tiled else None
    ac.check_case(case, tiling=tiling, keep=_keep(built))


def test_a_different_mask_would_be_detected():
    built = ac.build(CASES[0])
    out, _, _ = ac.run_backend(built)
    other = ac.oracle_for(built, keep=np.roll(_keep(built), 1, axis=-1))
    assert ac.rel_error(out, other.out) > 1e-2


def test_same_key_same_output_other_key_other_output():
    built = ac.build(CASES[1])
    out1, _, g1 = ac.run_backend(built)
    out2, _, g2 = ac.run_backend(built)
    np.testing.assert_array_equal(out1, out2)
    np.testing.assert_array_equal(g1["dq"], g2["dq"])
    other = dataclasses.replace(built, rng=jax.random.PRNGKey(12345))
    out3, _, _ = ac.run_backend(other)
    assert not np.array_equal(out1, out3)


def test_typed_and_raw_keys_both_work():
    built = ac.build(CASES[0])
    raw = np.asarray(xla.dropout_keep_mask(_config(built), jax.random.PRNGKey(7)))
    typed = np.asarray(xla.dropout_keep_mask(_config(built), jax.random.key(7)))
    assert raw.shape == typed.shape == (2, 4, 20, 20)
    assert 0.5 < raw.mean() < 0.9 and 0.5 < typed.mean() < 0.9


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
def test_keep_rate_is_right(rate):
    config = AttnConfig(batch=2, s_q=256, s_kv=256, h_q=4, h_kv=4, d_qk=8, d_v=8,
                        dtype="float32", dropout=rate)
    keep = np.asarray(xla.dropout_keep_mask(config, jax.random.PRNGKey(3)))
    n = keep.size
    sigma = np.sqrt(rate * (1 - rate) / n)
    assert abs(keep.mean() - (1 - rate)) < 5 * sigma
    # No structure along any axis: per-(batch, head) rates and neighbour agreement.
    per_head = keep.mean(axis=(2, 3))
    assert np.all(np.abs(per_head - (1 - rate)) < 5 * np.sqrt(rate * (1 - rate) / keep[0, 0].size))
    agree = 1 - 2 * rate * (1 - rate)  # P(two independent draws agree)
    for axis in (1, 2, 3):
        a = np.take(keep, range(0, keep.shape[axis] - 1), axis=axis)
        b = np.take(keep, range(1, keep.shape[axis]), axis=axis)
        m = a.size
        assert abs(np.mean(a == b) - agree) < 5 * np.sqrt(agree * (1 - agree) / m)
    assert abs(np.mean(keep[0] == keep[1]) - agree) < 5 * np.sqrt(agree * (1 - agree) / keep[0].size)


def test_expected_output_is_unbiased():
    """Averaged over keys, dropout's output is the dropout-free output (inverted scaling)."""
    base = ac.build(ac.Case(b=1, s_q=4, s_kv=16, h_q=2, h_kv=2))
    config = _config(dataclasses.replace(base, case=dataclasses.replace(base.case, dropout=RATE),
                                         rng=jax.random.PRNGKey(0)))
    no_drop = np.asarray(ac.oracle_for(base).out)

    @jax.jit
    def run(key):
        _, inputs = build_call(base.q, base.k, base.v, dropout=RATE, rng=key)
        return xla.attention(config, inputs)
    outs = np.stack([np.asarray(run(jax.random.PRNGKey(s))) for s in range(400)])
    err = np.abs(outs.mean(axis=0) - no_drop)
    sem = outs.std(axis=0) / np.sqrt(len(outs))
    assert np.all(err < 5 * sem + 1e-6)
