"""A mask_mod of positions inside packed segments whose rows each see one run of keys
(prefix-LM, a window) becomes per-row key intervals: `recognise.row_runs` finds each
position's run at trace time, `builtin.in_segments` places it in every segment.

Checked differentially over generated mask_mods (ANDs and ORs of position
comparisons, `support.generated_masks`) and random packings, shared or with query and
key segments of their own, padding included: the map and the element mask the
kernels apply equal brute force (positions inside the segments, the mask evaluated
on every pair), and `row_runs` refuses exactly the masks with a gap in some row.
Then the backend: such a call's device map holds no mask_mod, and explain() says so.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fusedattn
from fusedattn.backends import block_sparse as backend
from fusedattn.block_sparse import builtin, recognise
from fusedattn.block_sparse.builders import from_element
from fusedattn.block_sparse.terms import ElementMask, Intervals, MaskMod
from fusedattn.inputs import AttnInputs
from support.block_map_reference import check
from support.block_sparse_cases import prefix_in_segment
from support.generated_masks import brute, generated

B = 3


def _ids(rng, s, n_max):
    """[B, s] sorted 1-based ids with trailing padding (0), one to n_max segments a row."""
    ids = np.zeros((B, s), np.int32)
    for r in range(B):
        used = int(rng.integers(0, s + 1)) if r else s   # (row 0 unpadded)
        cuts = np.sort(rng.choice(np.arange(1, used), size=min(used - 1, int(
            rng.integers(0, n_max))), replace=False)) if used > 1 else []
        for n, (a, b) in enumerate(zip([0, *cuts], [*cuts, used])):
            ids[r, a:b] = n + 1
    return ids


def _packing(rng, s_q, s_kv, shared):
    """A descriptor and its ids and positions as numpy, for a brute-force mask."""
    if shared:
        ids = _ids(rng, s_q, 4)
        seq = fusedattn.SequenceDescriptor.from_segment_ids(jnp.asarray(ids), max_segments=4)
    else:   # (query segment n sees key segment n; lengths differ)
        qi, ki = _ids(rng, s_q, 4), _ids(rng, s_kv, 4)
        seq = fusedattn.SequenceDescriptor.from_segment_ids(jnp.asarray(qi), jnp.asarray(ki),
                                                            max_segments=4)
    return seq, *(np.asarray(getattr(seq, n)) for n in (
        "q_segment_ids", "kv_segment_ids", "q_positions", "kv_positions"))


def _visible(fn, qi, ki, qp, kp):
    """[B, 1, s_q, s_kv]: same non-padding segment, the mask of positions inside it."""
    local = brute(fn, qp.shape[1], kp.shape[1])   # (positions lie in [0, s))
    same = (qi[:, :, None] == ki[:, None, :]) & (qi[:, :, None] > 0)
    return (same & local[qp[:, :, None], kp[:, None, :]])[:, None]


def _gap(m) -> bool:
    """Whether a row of the host mask sees keys with a gap between them."""
    count = m.sum(axis=1)
    first, last = m.argmax(axis=1), m.shape[1] - 1 - m[:, ::-1].argmax(axis=1)
    return bool(((count > 0) & (count != last - first + 1)).any())


def _or_key(fn, c):
    return lambda b, h, i, j: fn(b, h, i, j) | (j == c)


@pytest.mark.parametrize("chunk", range(4))
def test_runs_inside_segments_against_brute_force(chunk):
    rng = np.random.default_rng(chunk)
    placed = refused = 0
    for seed in range(chunk * 50, chunk * 50 + 50):
        fn, s_q, s_kv, text = generated(seed)
        if seed % 4 == 0:   # one more key seen by every row: mostly a gap
            fn, text = _or_key(fn, int(rng.integers(0, s_kv))), f"({text}) | j==c"
        shared = s_q == s_kv and rng.random() < 0.6
        runs = recognise.row_runs(ElementMask([MaskMod.build(fn, (), 1, 1, s_q, s_kv)],
                                              s_q, s_kv))
        assert (runs is None) == _gap(brute(fn, s_q, s_kv)), f"seed {seed}: {text}"
        if runs is None:
            refused += 1
            continue
        placed += 1
        seq, qi, ki, qp, kp = _packing(rng, s_q, s_kv, shared)
        element = ElementMask([builtin.intervals(s_q, s_kv, "none", None, seq),
                               builtin.in_segments(*runs, seq)], s_q, s_kv)
        check(from_element(element, (4, 4)), _visible(fn, qi, ki, qp, kp))
    assert placed and refused   # (both answers exercised)


def test_a_packed_prefix_mask_runs_as_intervals(hopper_reference):
    """The backend's device map of a prefix-LM mask_mod inside packed segments is one
    interval term (no mask_mod evaluated pair by pair, on the map or in the kernels),
    equal to brute force; explain() names the runs."""
    s = 64
    rng = np.random.default_rng(7)
    seq, qi, ki, qp, kp = _packing(rng, s, s, shared=True)
    q = jnp.zeros((B, s, 2, 64), jnp.bfloat16)
    plan = fusedattn.explain(q, q, q, sequence=seq, mask_mod=prefix_in_segment)
    assert plan.chosen == "block_sparse" and "runs of keys" in str(plan), str(plan)
    bm = backend.device_map(plan.config, AttnInputs(q, q, q, sequence=seq))
    assert [type(t) for t in bm.element.terms] == [Intervals]
    check(bm, _visible(prefix_in_segment, qi, ki, qp, kp))


def test_a_mask_with_gaps_keeps_its_pairs():
    """A row seeing two runs (a window with a key prefix, attention sinks) has no
    interval form: `row_runs` refuses it, and the map evaluates the mask_mod."""
    def sinks(b, h, i, j):
        return (j <= i) & ((i - j < 4) | (j < 2))
    assert recognise.row_runs(ElementMask([MaskMod.build(sinks, (), 1, 1, 16, 16)],
                                          16, 16)) is None


def test_a_mask_mod_closing_over_a_traced_value_falls_back(hopper_reference):
    """A packed mask_mod that closes over a value traced in the caller's jit cannot be
    evaluated at trace time: block_sparse refuses it with the reason, and the call runs
    on another backend with the same numbers as the XLA backend."""
    s = 64
    seq, *_ = _packing(np.random.default_rng(3), s, s, shared=True)
    q = jax.random.normal(jax.random.key(0), (B, s, 2, 64), jnp.bfloat16)

    def call(q, w, backend):
        return fusedattn.fused_attn(q, q, q, sequence=seq, backend=backend,
                                    mask_mod=lambda b, h, i, j: (j <= i) & (i - j < w))

    def plan(q, w):
        plan = fusedattn.explain(q, q, q, sequence=seq,
                                 mask_mod=lambda b, h, i, j: (j <= i) & (i - j < w))
        assert plan.chosen != "block_sparse"
        assert dict(plan.reasons)["block_sparse"].startswith("block map:"), str(plan)
        return call(q, w, "auto")
    got = jax.jit(plan)(q, jnp.int32(9))
    want = jax.jit(call, static_argnums=2)(q, jnp.int32(9), "xla")
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
