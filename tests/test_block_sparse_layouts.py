"""The block_sparse route through dispatch for other layouts and for packed sequences,
on CPU with the kernels run as the reference list walks (`hopper_reference`):
sequence-first and packed q, k, v, and packed (THD) segments with a mask_mod or
score_mod, which see positions inside each segment. Output and gradients against the
float64 oracle (layouts) or the XLA backend in float32 (packing, tables' gradients
included)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fusedattn
from support.block_sparse_cases import (PACKED, check_packed, doc_ids, in_layout,
                                        jax_nn_oracle, packed_case, prefix_in_segment,
                                        rel_error, slopes_in_segment)

B, S, H, H_KV, D = 2, 256, 4, 2, 64


def _qkvo(h_kv):
    keys = jax.random.split(jax.random.key(0), 4)
    return [jax.random.normal(kk, (B, S, hh, D), jnp.bfloat16)
            for kk, hh in zip(keys, (H, h_kv, h_kv, H))]


def same_doc(b, h, i, j, doc):
    return doc[b, i] == doc[b, j]


@pytest.mark.parametrize("layout", ["sbhd", "bs3hd", "bshd_bs2hd", "sbhd_sb2hd"])
def test_documents_in_other_layouts(hopper_reference, layout):
    """Sequence-first and packed q, k, v run the same kernels (sbhd read in place,
    packed arrays sliced apart): output and gradients in the caller's layout."""
    q, k, v, do = _qkvo(H if "3" in layout else H_KV)
    doc = jnp.asarray(doc_ids(B, S, [S // 8, S // 4, S // 8 + 40]))
    kw = dict(layout=layout, mask_mod=same_doc)
    plan = fusedattn.explain(*in_layout(layout, q, k, v)[0], score_mod_args=(doc,), **kw)
    assert plan.chosen == "block_sparse", str(plan)

    def call(q, k, v, doc):
        args, back = in_layout(layout, q, k, v)
        return back(fusedattn.fused_attn(*args, score_mod_args=(doc,), **kw))
    out, vjp = jax.jit(lambda q, k, v, doc: jax.vjp(
        lambda q, k, v: call(q, k, v, doc), q, k, v))(q, k, v, doc)
    visible = np.asarray(doc[:, None, :, None] == doc[:, None, None, :])
    want = jax_nn_oracle(q, k, v, do, visible)[:4]
    for name, g, w, tol in zip(("out", "dq", "dk", "dv"), (out, *vjp(do)), want,
                               (2e-2, 4e-2, 4e-2, 4e-2)):
        assert g.shape == w.shape and rel_error(np.asarray(g, np.float32), w) < tol, name


@pytest.mark.parametrize("case", sorted(PACKED))
def test_packed_segments_run_here(hopper_reference, case):
    """Packed sequences with a mask_mod or score_mod (positions inside each segment, as
    fused_attn defines them) run the block-sparse kernels; the XLA backend in float32 is
    the reference, gradients of q, k, v and of a table included. Padding gives 0."""
    q, k, v, do = _qkvo(H_KV)
    seq, opts, args = packed_case(case, B, S)
    plan = fusedattn.explain(q, k, v, score_mod_args=args, **opts)
    assert plan.chosen == "block_sparse", str(plan)
    assert "the packed segments" in str(plan)
    check_packed(q, k, v, do, seq, opts, args)


@pytest.mark.parametrize("opts", [
    dict(mask_mod=prefix_in_segment),
    dict(mask="causal_bottom_right", score_mod=slopes_in_segment),
    dict(mask="causal", window=(30, 0), mask_mod=prefix_in_segment)],
    ids=["prefix", "bottom-right + slopes", "causal window + prefix"])
def test_packed_query_and_key_segments_differ(hopper_reference, opts):
    """Cross-attention packing: query segment n of a row sees key segment n, s_q != s_kv,
    and the built-in masks align inside the segments; against the XLA backend."""
    qi, ki = np.zeros((B, S), np.int32), np.zeros((B, S + 128), np.int32)
    qi[0, :200], ki[0] = np.repeat([1, 2], [120, 80]), np.repeat([1, 2], [200, 184])
    qi[1], ki[1, :300] = np.repeat([1, 2, 3], [50, 100, 106]), np.repeat([1, 2, 3], [100] * 3)
    seq = fusedattn.SequenceDescriptor.from_segment_ids(jnp.asarray(qi), jnp.asarray(ki),
                                                        max_segments=3)
    keys = jax.random.split(jax.random.key(1), 4)
    q, do = (jax.random.normal(kk, (B, S, H, D), jnp.bfloat16) for kk in keys[:2])
    k, v = (jax.random.normal(kk, (B, S + 128, H_KV, D), jnp.bfloat16) for kk in keys[2:])
    opts = dict(opts, sequence=seq)
    assert fusedattn.explain(q, k, v, **opts).chosen == "block_sparse"
    check_packed(q, k, v, do, seq, opts, ())


def test_packed_t5_table_runs_by_diagonals_only_over_shared_segments(hopper_reference):
    """A T5 table under packing: with one set of segments for queries and keys it runs
    here (its reads per run of diagonals: `PACKED`'s T5 case checks the numbers); with
    query and key segments of their own, or with a position read besides q_idx - kv_idx,
    it is refused, and the reason says why (not "this call has none")."""
    from fusedattn import score_mods
    seq, _, _ = packed_case("prefix mask_mod", B, S)
    q = jnp.zeros((B, S, H, D), jnp.bfloat16)
    table = (jnp.zeros((H, 32)),)
    t5 = lambda s, b, h, i, j, t: s + t[h, score_mods.t5_bucket(i, j)]  # noqa: E731
    shared = fusedattn.explain(q, q, q, sequence=seq, mask="causal", score_mod=t5,
                               score_mod_args=table)
    assert shared.chosen == "block_sparse", str(shared)
    ids = np.asarray(seq.q_segment_ids)
    cross = fusedattn.SequenceDescriptor.from_segment_ids(jnp.asarray(ids), jnp.asarray(ids),
                                                          max_segments=3)
    near = lambda s, b, h, i, j, t: t5(s, b, h, i, j, t) + (i < 8)  # noqa: E731
    for seq_, fn in ((cross, t5), (seq, near)):
        plan = fusedattn.explain(q, q, q, sequence=seq_, mask="causal", score_mod=fn,
                                 score_mod_args=table)
        why = dict(plan.reasons)["block_sparse"]
        assert plan.chosen != "block_sparse"
        assert "depends on both q_idx and kv_idx" in why and "are the same" in why, why
