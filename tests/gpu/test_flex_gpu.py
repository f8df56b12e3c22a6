"""Lowered score_mods / mask_mods on cuDNN (tests/support/flex_cases.py): forward, LSE and every
gradient (score_mod_args included) against the float64 oracle, each mod alone and
with a causal mask (top-left and bottom-right), a sliding window, padding and GQA;
padded rows exactly 0. A case cuDNN is known to refuse
(`EXPECTED_REFUSALS`, with the reason explain() must give) is skipped, saying so;
any other refusal fails.
Tolerance: the project's bf16 one (tests/support/attn_cases.py, 4e-2 relative L2)."""
from __future__ import annotations

import dataclasses
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from support import attn_cases as ac  # noqa: E402
from support import flex_cases as fc  # noqa: E402
import fusedattn  # noqa: E402
from fusedattn import dispatch, score_mods  # noqa: E402
from fusedattn.backends.cudnn import causal_chunks  # noqa: E402
from fusedattn.validation import build_call  # noqa: E402
from fusedattn.backends import block_sparse as block_sparse_backend  # noqa: E402
from fusedattn.backends import cudnn  # noqa: E402
from fusedattn.backends.cudnn import flex as cudnn_flex  # noqa: E402
from fusedattn.backends.cudnn.lowering import ranges as flex_ranges  # noqa: E402

pytestmark = pytest.mark.gpu

VARIANTS = {"alone": {}, "causal": dict(mask="causal"), "padding": dict(sequence="padding"),
            "gqa": dict(h_kv=2, mask="causal"),
            # composed in int32, in the forms of cuDNN's own masks (flex_lowering)
            "bottom_right": dict(mask="causal_bottom_right", s_q=128),
            "window": dict(window=(32, 16))}


def _case(name: str, **change) -> ac.Case:
    mod, mask_mod, args, _ = fc.MODS[name]
    b, s, h = 2, 256, 4
    score_mod = mod if mask_mod is None else score_mods.Masked(mod, mask_mod)
    return ac.Case(**dict(dict(b=b, s_q=s, s_kv=s, h_q=h, h_kv=h, d_qk=64, d_v=64,
                               dtype="bfloat16", score_mod=score_mod,
                               score_mod_args=tuple(np.asarray(a) for a in args(h, b, s))),
                          **change))


def _run(built: ac.Built, backend="cudnn"):
    """(out, dq, dk, dv, d_args) of fused_attn on `backend`, bshd float64."""
    opts = built.options()
    args = built.score_mod_args
    floats = [i for i, a in enumerate(args) if jnp.issubdtype(a.dtype, jnp.floating)]

    def f(q, k, v, float_args):
        full = list(args)
        for i, a in zip(floats, float_args):
            full[i] = a
        return fusedattn.fused_attn(q, k, v, **dict(opts, score_mod_args=tuple(full),
                                                   backend=backend))
    out, vjp = jax.jit(lambda *a: jax.vjp(f, *a))(built.q, built.k, built.v,
                                                   [args[i] for i in floats])
    dq, dk, dv, d_args = vjp(built.d_out)
    f64 = lambda x: np.asarray(jnp.asarray(x, jnp.float32), np.float64)  # noqa: E731
    return f64(out), f64(dq), f64(dk), f64(dv), [f64(g) for g in d_args]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("name", fc.LOWERED)
def test_lowered_mod_matches_the_oracle(name, variant):
    _check_against_the_oracle(name, variant, VARIANTS[variant])


@pytest.mark.parametrize("name", fc.LOWERED)
def test_causal_mods_in_query_chunks_match_the_oracle(name, monkeypatch):
    """fusedattn.causal_chunks: 4 chunks of 64 queries, GQA, bottom-right over longer kv.
    A chunk may have no cuDNN engine (prefix-LM's first chunk: three masks; a mask
    inside the score_mod beside the chunk's), and then the call runs whole, as checked
    here too (H100, cuDNN 9.19); the refusal must be cuDNN's."""
    monkeypatch.setenv(causal_chunks.ENV_CHUNKS, "4")
    plan = _check_against_the_oracle(name, "chunks", dict(h_kv=2, mask="causal_bottom_right",
                                                          s_kv=320))
    if "4 query chunks of 64 rows" not in str(plan):  # then cuDNN refused a chunk's graph
        config, _ = build_call(*(jnp.zeros(s, jnp.bfloat16) for s in
                                 ((2, 256, 4, 64), (2, 320, 2, 64), (2, 320, 2, 64))),
                               **dict(ac.build(_case(name)).options(), mask="causal_bottom_right"))
        refusals = [cudnn.BACKEND.supports(ch.config) for ch in causal_chunks.chunks(config, 4)]
        assert any(r and r.startswith("cuDNN:") for r in refusals), (str(plan), refusals)
        print(name, "chunks refused by cuDNN:", [r and r[:150] for r in refusals])


@pytest.mark.parametrize("name", ["document_blocks", "relpos_documents", "prefix_lm",
                                  "window_plus_sink", "softcap_prefix_lm"])
def test_mask_mods_in_block_chunks_match_the_oracle(name, monkeypatch):
    """fusedattn.mask_chunks: chunks of 64 rows on the keys their rows see (documents of
    64: one batched plain call, or with a score_mod one call each without the mask),
    with GQA."""
    monkeypatch.setattr(causal_chunks, "MIN_CHUNK_ROWS", 64)
    plan = _check_against_the_oracle(name, "mask chunks", dict(h_kv=2))
    if name in ("document_blocks", "relpos_documents"):
        assert "mask_mod in 4 query chunks of 64 rows" in str(plan), str(plan)


# The refusals these cases are known to get, each with the words its reason must hold.
# Any other refusal fails: a lowering regression shows up as a failure, not as a skip.
NO_ENGINE = "cuDNN: the score_mod lowered to pointwise operations has no engine"
EXPECTED_REFUSALS = {
    "clip": (NO_ENGINE, "backward"),       # cuDNN's engines refuse clipping's bprop
    "strided": (NO_ENGINE, "forward"),     # ... and the strided mask's forward
    "log1p_abs": (NO_ENGINE, "backward"),  # ... and the bprop of log1p(|s|)
}


# Where `auto` runs the cases of `flex_cases` above instead: the block-sparse kernels on
# Hopper, where the mod has an in-kernel form (log1p has none there: XLA runs it).
FALLBACK = {"clip": "block_sparse", "strided": "block_sparse"}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("name", sorted(FALLBACK))
def test_what_cudnn_refuses_runs_on_the_next_backend(name, variant):
    """Under `auto`: a mask_mod on the block-sparse kernels, a score_mod alone on cuDNN
    where it runs, else on `FALLBACK`; forward and every gradient against the oracle."""
    built = ac.build(_case(name, **VARIANTS[variant]))
    plan = fusedattn.explain(built.q, built.k, built.v, **built.options())
    on_cudnn = dict(plan.reasons)["cudnn"] is None
    if not block_sparse_backend.on_hopper():   # (block_sparse_xla walks a mask_mod's map)
        expected = "cudnn" if on_cudnn else \
            "block_sparse_xla" if fc.MODS[name][1] is not None else "xla"
    elif fc.MODS[name][1] is not None:    # a mask_mod
        expected = "block_sparse"
    else:
        expected = "cudnn" if on_cudnn else FALLBACK[name]
    assert plan.chosen == expected, str(plan)
    ref = ac.oracle_for(built)
    out, dq, dk, dv, _ = _run(built, backend="auto")
    errors = {"out": ac.rel_error(out, ref.out), "dq": ac.rel_error(dq, ref.dq),
              "dk": ac.rel_error(dk, ref.dk), "dv": ac.rel_error(dv, ref.dv)}
    print(name, variant, plan.chosen, {k: round(v, 4) for k, v in errors.items()})
    assert max(errors.values()) < ac.TOLERANCE["bfloat16"], errors
    q_pad = ac.padded_query_mask(built)
    assert np.all(out[q_pad] == 0) and np.all(dq[q_pad] == 0)


def _expected_refusal(name, variant):
    return EXPECTED_REFUSALS.get(name)


def _check_against_the_oracle(name, variant, change, case=None):
    case = case or _case(name, **change)
    built = ac.build(case)
    uq, uk, uv = built.q, built.k, built.v
    plan = fusedattn.explain(uq, uk, uv, **built.options())
    if plan.groups or ((plan.rewritten or plan.chosen != "cudnn")
                       and dict(plan.reasons)["cudnn"] is None):
        # a backend ahead of cudnn took it (block_sparse, a mask_mod of positions), or
        # auto ran a mask_mod as built-in masks (of all rows, or of runs of rows):
        # cuDNN's own plan of the call as written is what is checked here
        plan = fusedattn.explain(uq, uk, uv, **dict(built.options(), backend="cudnn"))
    if plan.chosen != "cudnn":
        reason = dict(plan.reasons)["cudnn"]
        expected = _expected_refusal(name, variant)
        assert expected is not None, f"{name} {variant}: unexpected refusal: {reason}"
        assert all(words in reason for words in expected), (expected, reason)
        pytest.skip(f"{name} {variant}: expected refusal: {reason[:200]}")
    ref = ac.oracle_for(built)
    out, dq, dk, dv, d_args = _run(built)
    tol = ac.TOLERANCE[case.dtype]
    errors = {"out": ac.rel_error(out, ref.out), "dq": ac.rel_error(dq, ref.dq),
              "dk": ac.rel_error(dk, ref.dk), "dv": ac.rel_error(dv, ref.dv)}
    errors.update({f"d_arg{i}": ac.rel_error(g, r) for i, (g, r) in
                   enumerate(zip(d_args, ref.d_score_mod_args))})
    print(name, variant, {k: round(v, 4) for k, v in errors.items()})
    assert all(np.isfinite(list(errors.values()))), errors
    assert max(errors.values()) < tol, errors
    q_pad = ac.padded_query_mask(built)
    assert np.all(out[q_pad] == 0) and np.all(dq[q_pad] == 0)
    # The LSE of the score_mod itself (query-only terms the program leaves out added
    # back, flex_hoist), at rows with a visible key.
    config, inputs = build_call(uq, uk, uv, **built.options())
    _, lse = jax.jit(lambda i: cudnn.attention_with_lse(config, i))(inputs)
    rows = np.isfinite(ref.lse) & ~q_pad[:, None, :]
    assert ac.rel_error(np.asarray(lse)[rows], ref.lse[rows]) < 1e-3
    return plan


def test_cudnn_still_misreads_per_batch_score_mod_tensors(monkeypatch):
    """Why cudnn_flex refuses score_mods whose inputs vary over the batch: with the
    refusal lifted, cuDNN's result is far from the oracle. When a cuDNN release fixes
    it, this test fails: lift the refusal for that version."""
    from fusedattn import dispatch
    monkeypatch.setattr(cudnn_flex, "PER_BATCH_INPUTS_OK", True)
    dispatch.clear_cache()
    try:
        built = ac.build(_case("per_batch_scale"))
        plan = fusedattn.explain(built.q, built.k, built.v, **built.options())
        if plan.chosen != "cudnn":
            pytest.skip(f"cuDNN refuses the graph itself: {dict(plan.reasons)['cudnn'][:200]}")
        out = _run(built)[0]
        error = ac.rel_error(out, ac.oracle_for(built).out)
        print("per_batch_scale on cuDNN, refusal lifted: out error", round(error, 3))
        assert error > 0.3
    finally:
        dispatch.clear_cache()


def test_cudnn_still_loses_large_scores(monkeypatch):
    """Why cudnn_flex refuses programs whose values provably reach past ranges.LIMIT:
    with the refusal lifted, ``2 s + 1e5 k`` (scores near 1.3e7) gets a dV far from the
    oracle while the forward is right. When a cuDNN release fixes it, this test fails:
    raise the limit for that version."""
    monkeypatch.setattr(flex_ranges, "LIMIT", math.inf)
    dispatch.clear_cache()
    try:
        case = ac.Case(b=2, s_q=128, s_kv=128, h_q=4, h_kv=4, d_qk=64, d_v=64,
                       dtype="bfloat16", mask="causal",
                       score_mod=lambda s, b, h, q, k: 2.0 * s + 1e5 * k.astype(jnp.float32))
        built = ac.build(case)
        plan = fusedattn.explain(built.q, built.k, built.v, **built.options())
        assert plan.chosen == "cudnn", str(plan)
        out, _, _, dv, _ = _run(built)
        ref = ac.oracle_for(built)
        errors = ac.rel_error(out, ref.out), ac.rel_error(dv, ref.dv)
        print("2 s + 1e5 k on cuDNN, refusal lifted: out, dv errors", errors)
        assert errors[0] < ac.TOLERANCE["bfloat16"] < errors[1]
    finally:
        dispatch.clear_cache()


def test_a_lowered_mod_changes_the_result():
    """The comparison above would catch a graph that ignored the score_mod."""
    built = ac.build(_case("relative_position"))
    plain = ac.oracle_for(ac.build(dataclasses.replace(built.case, score_mod=None)))
    out = _run(built)[0]
    assert ac.rel_error(out, plain.out) > 0.1


@pytest.mark.parametrize("name", sorted(n for n, m in fc.MODS.items() if m[3]))
def test_inexpressible_mods_fall_back_with_the_reason(name):
    """cuDNN refuses them with the reason; the block-sparse kernels (gathers hoisted
    out of the kernel) or XLA run them."""
    built = ac.build(_case(name))
    plan = fusedattn.explain(built.q, built.k, built.v, **built.options())
    assert plan.chosen in ("block_sparse", "xla"), str(plan)
    assert fc.MODS[name][3] in dict(plan.reasons)["cudnn"], str(plan)


# Issue 28: ``sin(cos(s)) + 0.5 * cos(s)`` ran on cuDNN with dV 394x off (forward, dQ, dK
# right) while its bprop read an ``id`` of the score that no forward instruction read.
# Its class: every bprop that reads the forward's values, the score itself or positions.
BPROP_READS = {
    "sin_cos": lambda s, b, h, q, k: jnp.sin(jnp.cos(s)) + jnp.cos(s) * 0.5,
    "sin": lambda s, b, h, q, k: jnp.sin(s),
    "square": lambda s, b, h, q, k: 0.5 * s * s,
    "exp_plus_score": lambda s, b, h, q, k: jnp.exp(0.1 * s) + s,
    "score_times_tanh": lambda s, b, h, q, k: s * jnp.tanh(s),
    "cos_shared": lambda s, b, h, q, k: jnp.cos(s) * jnp.cos(s) + s,
    "index_scale": lambda s, b, h, q, k: s * (1.0 + 0.01 * (q - k)),
    "log1p_abs": lambda s, b, h, q, k: s + 0.5 * jnp.log1p(jnp.abs(s)),
    "sigmoid_gate": lambda s, b, h, q, k: s * jax.nn.sigmoid(s),
}


@pytest.mark.parametrize("variant", ["alone", "causal"])
@pytest.mark.parametrize("name", sorted(BPROP_READS))
def test_bprop_reads_match_the_oracle(name, variant):
    case = ac.Case(b=2, s_q=512, s_kv=512, h_q=4, h_kv=4, d_qk=64, d_v=64,
                   dtype="bfloat16", score_mod=BPROP_READS[name],
                   mask="causal" if variant == "causal" else "none")
    _check_against_the_oracle(name, variant, {}, case=case)
