"""block_sparse_attention's list-walking reference (the CPU path) against the
float64 oracle: forward, lse (-inf on rows with no key) and gradients for every
mask family, GQA, and a score_mod. On CPU these run `block_sparse.reference`,
which walks the same partial / full, query- and key-major lists as the kernels."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from support.block_sparse_cases import FAMILIES, block_map, dense_visibility, oracle, rel_error
from fusedattn.block_sparse.attention import (block_sparse_attention,
                                              block_sparse_attention_with_lse)
from fusedattn.block_sparse.kernel_mask import Unsupported, kernel_mask

B, S, H, H_KV, D = 2, 256, 4, 2, 32


def _inputs(dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(0), 4)
    return [jax.random.normal(kk, (B, S, hh, D), dtype) for kk, hh in zip(keys, (H, H_KV, H_KV, H))]


def _run(family, score_mod=None, dtype=jnp.float32):
    q, k, v, do = _inputs(dtype)
    bm = block_map(family, B, H, S)
    out, lse = block_sparse_attention_with_lse(q, k, v, bm, score_mod=score_mod,
                                               implementation="reference")
    _, vjp = jax.vjp(lambda q, k, v: block_sparse_attention(
        q, k, v, bm, score_mod=score_mod, implementation="reference"), q, k, v)
    grads = vjp(do)
    ref = oracle(q, k, v, dense_visibility(bm, B, H, S), D ** -0.5, score_mod, do)
    return out, np.asarray(lse), grads, ref


@pytest.mark.parametrize("family", FAMILIES)
def test_matches_oracle(family):
    out, lse, grads, (ref_out, ref_lse, ref_grads) = _run(family)
    finite = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(lse), finite)
    assert np.all(lse[~finite] == -np.inf)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], atol=1e-4)
    assert rel_error(out, ref_out) < 1e-4
    for g, r in zip(grads, ref_grads):
        assert rel_error(g, r) < 1e-4


def test_rows_without_keys_give_zero():
    out, lse, grads, (_, ref_lse, _) = _run("random_dense")
    empty = ~np.isfinite(ref_lse)                       # [b, h, s]
    assert empty.any()
    got = np.asarray(out).transpose(0, 2, 1, 3)[empty]
    assert np.all(got == 0) and np.all(np.isfinite(np.asarray(grads[0])))


@pytest.mark.parametrize("s", [256, 300])
def test_unseen_rows_can_take_the_mean_of_the_values(s):
    """unseen_rows="mean" (jax.nn's rule, the drop-ins' ask): a row that sees no key
    gives the mean of all values (its lse stays -inf), and that mean's gradient reaches
    every key's dv; under GQA, with a ragged last block."""
    keys = jax.random.split(jax.random.key(2), 4)
    q, k, v, do = (jax.random.normal(kk, (B, s, hh, D)) for kk, hh in zip(keys, (H, H_KV, H_KV, H)))
    bm = block_map("random_dense", B, H, s)
    call = lambda q, k, v: block_sparse_attention_with_lse(  # noqa: E731
        q, k, v, bm, implementation="reference", unseen_rows="mean")
    (out, lse), vjp = jax.vjp(call, q, k, v)
    grads = vjp((do, jnp.zeros_like(lse)))
    ref_out, ref_lse, ref_grads = oracle(q, k, v, dense_visibility(bm, B, H, s), D ** -0.5,
                                         None, do, unseen_rows="mean")
    unseen = ~np.isfinite(ref_lse)
    assert unseen.any() and np.all(np.asarray(lse)[unseen] == -np.inf)
    assert rel_error(out, ref_out) < 1e-4
    for g, r in zip(grads, ref_grads):
        assert rel_error(g, r) < 1e-4
    with pytest.raises(ValueError, match="unseen_rows must be one of"):
        block_sparse_attention(q, k, v, bm, implementation="reference", unseen_rows="nan")


def test_score_mod_composes_with_mask():
    rel = lambda s, b, h, i, j: s + 0.05 * (i - j).astype(s.dtype)
    out, lse, grads, (ref_out, _, ref_grads) = _run("documents_causal", rel)
    assert rel_error(out, ref_out) < 1e-4
    for g, r in zip(grads, ref_grads):
        assert rel_error(g, r) < 1e-4


def test_bf16_within_tolerance():
    out, _, grads, (ref_out, _, ref_grads) = _run("sliding_window", dtype=jnp.bfloat16)
    assert rel_error(out, ref_out) < 2e-2
    for g, r in zip(grads, ref_grads):
        assert rel_error(g, r) < 4e-2


def test_mask_mod_gathering_by_both_positions_is_refused_by_name():
    """A kernel cannot gather: a read indexed by query and key together has no
    in-kernel form (reads by one position are hoisted: tests/test_block_sparse_hoisting.py)."""
    from fusedattn import block_sparse as bs
    pairs = jnp.ones((S, S), bool)
    bm = bs.block_map(lambda b, h, i, j, m: m[i, j], s_q=S, s_kv=S, args=(pairs,))
    with pytest.raises(Unsupported, match="reads arrays"):
        kernel_mask(bm.element)


def test_wrong_block_size_is_refused():
    from fusedattn import block_sparse as bs
    q, k, v, _ = _inputs()
    bm = bs.block_map(lambda b, h, i, j: j <= i, s_q=S, s_kv=S, block=(64, 64))
    with pytest.raises(ValueError, match="128x128"):
        block_sparse_attention(q, k, v, bm)


@pytest.mark.parametrize("family", FAMILIES)
def test_lengths_past_a_block_boundary(family):
    """s = 300 (two whole blocks and a ragged one): padded to whole blocks, the key
    padding masked, the rows cut off; forward, lse and gradients as the oracle's."""
    s = 300
    keys = jax.random.split(jax.random.key(1), 4)
    q, k, v, do = (jax.random.normal(kk, (B, s, hh, D)) for kk, hh in zip(keys, (H, H_KV, H_KV, H)))
    bm = block_map(family, B, H, s)
    out, lse = block_sparse_attention_with_lse(q, k, v, bm, implementation="reference")
    assert out.shape == q.shape and lse.shape == (B, H, s)
    _, vjp = jax.vjp(lambda q, k, v: block_sparse_attention(
        q, k, v, bm, implementation="reference"), q, k, v)
    ref_out, ref_lse, ref_grads = oracle(q, k, v, dense_visibility(bm, B, H, s), D ** -0.5,
                                         None, do)
    finite = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(np.asarray(lse)), finite)
    np.testing.assert_allclose(np.asarray(lse)[finite], ref_lse[finite], atol=1e-4)
    assert rel_error(out, ref_out) < 1e-4
    for g, r in zip(vjp(do), ref_grads):
        assert g.shape == r.shape and rel_error(g, r) < 1e-4


@pytest.mark.parametrize("shape", [(2, 1, 256, 256), (1, 3, 300, 200)])
def test_dense_mask_bits_round_trip(shape):
    """A dense mask travels as int32 words (bit k of word w: key 32w + k), word-major;
    unpacking any tile, in either orientation, gives the mask back, padding invisible."""
    from fusedattn.block_sparse.kernel_mask import pack_bits
    from fusedattn.block_sparse.kernel_parts import WORD, unpack_bits, whole
    mask = np.random.default_rng(3).random(shape) < 0.5
    mask[..., 0, :] = True                         # bit 31 set: the sign bit of a word
    sq, skv = whole(shape[2]), whole(shape[3])
    words = np.asarray(pack_bits(mask, sq, skv))
    assert words.dtype == np.int32 and words.shape == shape[:2] + (skv // WORD, sq)
    padded = np.zeros(shape[:2] + (sq, skv), bool)
    padded[..., :shape[2], :shape[3]] = mask
    for q0, k0 in [(0, 0), (128, 128), (64, 32)]:
        # rows are queries (forward, dq): one word vector per word row, keys on columns
        w = [x[:, None] for x in words[0, 0, k0 // WORD:k0 // WORD + 2, q0:q0 + 64]]
        got = np.asarray(unpack_bits(w, np.arange(64)[None, :]))
        np.testing.assert_array_equal(got, padded[0, 0, q0:q0 + 64, k0:k0 + 64])
        # rows are keys (dk / dv): the same words as column vectors
        w = [x[None, :] for x in words[0, 0, k0 // WORD:k0 // WORD + 2, q0:q0 + 64]]
        got = np.asarray(unpack_bits(w, np.arange(64)[:, None]))
        np.testing.assert_array_equal(got, padded[0, 0, q0:q0 + 64, k0:k0 + 64].T)


@pytest.mark.parametrize("s, unseen_rows", [(256, "zero"), (300, "mean")])
def test_sequence_first_layout_gives_the_bshd_results(s, unseen_rows):
    """``layout="sbhd"`` reads [s, b, h, d] arrays (the kernels in place): output, lse
    and gradients are the bshd call's, transposed; lengths past a block pad axis 0."""
    keys = jax.random.split(jax.random.key(4), 4)
    q, k, v, do = (jax.random.normal(kk, (B, s, hh, D)) for kk, hh in
                   zip(keys, (H, H_KV, H_KV, H)))
    bm = block_map("random_dense", B, H, s)
    sw = lambda x: jnp.swapaxes(x, 0, 1)  # noqa: E731

    def run(layout, to):
        def f(q, k, v):
            out, lse = block_sparse_attention_with_lse(
                *(to(x) for x in (q, k, v)), bm, implementation="reference",
                unseen_rows=unseen_rows, layout=layout)
            return to(out), lse
        (out, lse), vjp = jax.vjp(f, q, k, v)
        return (out, lse, *vjp((do, jnp.zeros_like(lse))))
    for got, want in zip(run("sbhd", sw), run("bshd", lambda x: x)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="layout must be one of"):
        block_sparse_attention(q, k, v, bm, implementation="reference", layout="bhsd")
