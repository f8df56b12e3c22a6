"""Query-only terms of a score_mod leave the cuDNN program (fusedattn.flex_hoist):
which terms go, which stay, and that program + row shift is the score_mod itself
(the NumPy interpreter against the JAX function, masks included). CPU."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from support import flex_cases as fc
from fusedattn.backends.cudnn.lowering import lower as flex_lowering
from fusedattn.config import AttnConfig
from fusedattn.score_mods import Masked

B, H, S = 2, 3, 16


def _lower(mod, mask="none", mask_mod=None, arg_specs=()):
    config = AttnConfig(batch=B, s_q=S, s_kv=S, h_q=H, h_kv=H, d_qk=16, d_v=16,
                        dtype="float32", mask=mask, score_mod=mod,
                        score_mod_arg_specs=tuple(arg_specs))
    score_mod = mod if mask_mod is None else Masked(mod, mask_mod)
    return config, flex_lowering.lower(config, score_mod)


def _check_equal(config, low, mod, args=(), mask_mod=None):
    """program(score) + row shift == the masked score_mod, pair by pair."""
    rng = np.random.default_rng(0)
    score = rng.standard_normal((B, H, S, S))
    q_idx, kv_idx = np.arange(S).reshape(1, 1, S, 1), np.arange(S).reshape(1, 1, 1, S)
    got = fc.program_scores(low, score, q_idx, kv_idx, low.evaluate(args, ()), args)
    f = flex_lowering.masked_score_mod(config, mod, mask_mod)
    batch, head = jnp.arange(B).reshape(B, 1, 1, 1), jnp.arange(H).reshape(1, H, 1, 1)
    want = np.asarray(f(jnp.asarray(score, jnp.float32), batch, head, jnp.asarray(q_idx),
                        jnp.asarray(kv_idx), *args), np.float64)
    finite = np.isfinite(want)
    np.testing.assert_array_equal(np.isfinite(got), finite)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-5, atol=1e-5)


def _reads(program: str, token: str) -> bool:
    return any(token in line.split(":")[1].split(",") for line in program.split("|"))


@pytest.mark.parametrize("mask", ["none", "causal", "causal_bottom_right"])
def test_the_query_term_of_a_relative_position_leaves_the_program(mask):
    mod = lambda s, b, h, q, k: s + 0.05 * (q - k)  # noqa: E731
    config, low = _lower(mod, mask)
    assert low.row_terms == "0.05*q"
    # only the mask still reads the query index
    body = [line for line in low.forward.split("|") if not line.startswith(("ge", "sel"))]
    assert not any(_reads(line, "q") for line in body), low.forward
    _check_equal(config, low, mod)


def test_a_per_head_slope_times_the_query_leaves_with_its_factor():
    mod = lambda s, b, h, q, k, sl: s + sl[h] * (k - q)  # noqa: E731
    slopes = jnp.asarray([0.5, 0.25, 0.125], jnp.float32)
    config, low = _lower(mod, "causal", arg_specs=[((H,), "float32")])
    assert low.row_terms == "-1.0*a0*q"
    assert low.input_shapes == ((1, H, 1, 1),)
    _check_equal(config, low, mod, (slopes,))


def test_an_offset_only_the_query_term_read_is_no_input_any_more():
    mod = lambda s, b, h, q, k, off: s + 0.01 * ((q + off[0]) - k)  # noqa: E731
    off = jnp.asarray([7], jnp.int32)
    config, low = _lower(mod, arg_specs=[((1,), "int32")])
    assert low.input_shapes == () and not _reads(low.forward, "a0")
    np.testing.assert_allclose(np.asarray(low.row_shift((off,), ())).ravel(),
                               0.01 * (np.arange(S) + 7), rtol=1e-6)
    _check_equal(config, low, mod, (off,))


def test_a_disjunction_of_masks_keeps_one_row_shift():
    mod = lambda s, b, h, q, k: s + 0.1 * (q - k)  # noqa: E731
    mask_mod = lambda b, h, q, k: (k <= q) | (k < 4)  # noqa: E731
    config, low = _lower(mod, mask_mod=mask_mod)
    assert low.row_terms == "0.1*q" and "max:" in low.forward
    _check_equal(config, low, mod, mask_mod=mask_mod)


@pytest.mark.parametrize("mod", [
    lambda s, b, h, q, k: jnp.tanh(s + 0.1 * q),         # inside a nonlinear function
    lambda s, b, h, q, k: s * (1.0 + 0.01 * q),          # scales the score
    lambda s, b, h, q, k: s + jnp.floor(q / 4.0) - 0.1 * k,  # a nonlinear query term
    lambda s, b, h, q, k: s + 0.1 * k,                   # nothing that depends on q alone
    lambda s, b, h, q, k: jnp.tanh(s) + 0.1 * q,         # the bprop reads forward values
], ids=["tanh", "scale", "floor", "key-only", "bprop-reads-forward"])
def test_what_is_not_a_plain_row_term_stays(mod):
    config, low = _lower(mod)
    assert low.row_terms == "" and low.row_shift((), ()) is None
    _check_equal(config, low, mod)
