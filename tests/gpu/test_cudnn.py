"""The cuDNN backend on a CUDA GPU: forward, LSE and every gradient against the
project's float64 oracle (tests/oracle.py, through tests/attn_cases.py) and
against the XLA backend, over masks x padding / packing x window x bias x
softmax variants x GQA x head dims x dtypes x layouts x the built-in score_mods
(ALiBi, soft-capping); padded positions exactly 0; deterministic backward bitwise
repeatable; dropout's forward and backward masks agree; explain() reasons; the
support probe (its three graphs built at once, one builder per cache entry,
handles pooled).

The backend under test is FUSEDATTN_TEST_BACKEND (default "cudnn"). To check
the harness itself on a machine without a GPU, run the tests marked
`harness_on_cpu` against the XLA backend (tests/gpu/conftest.py lifts its skip):
  FUSEDATTN_GPU_TESTS_ON_CPU=1 FUSEDATTN_TEST_BACKEND=xla PYTHONPATH=src \
    python -m pytest -q tests/gpu/test_cudnn.py -p no:cacheprovider
"""
from __future__ import annotations

import dataclasses
import importlib
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from support import attn_cases as ac
import fusedattn
from fusedattn import dispatch, score_mods
from fusedattn.backends import cudnn
from fusedattn.backends import extension as native
from fusedattn.config import AttnConfig
from fusedattn.sequence import SequenceDescriptor
from fusedattn.validation import build_call

BACKEND = os.environ.get("FUSEDATTN_TEST_BACKEND", "cudnn")

pytestmark = pytest.mark.gpu
harness_on_cpu = pytest.mark.harness_on_cpu  # runs with any backend; see tests/gpu/conftest.py


@pytest.fixture(autouse=True)
def _on_cuda(request):
    uses_cudnn = BACKEND == "cudnn" or request.node.get_closest_marker("harness_on_cpu") is None
    if uses_cudnn and dispatch.current_platform() != "cuda":
        pytest.skip("needs a CUDA GPU (cuDNN)")


def _case(name: str, deterministic: bool = False, **fields):
    """A cuDNN-sized attn_cases.Case (bf16, b 2, s 128, 4 heads, d 64 unless said)."""
    case = ac.Case(**{**dict(b=2, s_q=128, s_kv=128, h_q=4, h_kv=4, d_qk=64, d_v=64,
                             dtype="bfloat16"), **fields})
    assert case.fixed() == case, name  # run exactly what is written here
    return pytest.param(case, deterministic, id=name)


CASES = [
    _case("dense"),
    _case("causal-fp16-d128", mask="causal", dtype="float16", d_qk=128, d_v=128),
    _case("bottom-right-sq<skv", mask="causal_bottom_right", s_q=64, s_kv=128),
    _case("window-both-sides", window=(32, 16)),
    _case("causal-window-d128", mask="causal", window=(40, 0), d_qk=128, d_v=128),
    _case("bias-1h", bias=(False, True)),
    _case("bias-bh-causal", bias=(True, True), mask="causal"),
    _case("off-by-one", softmax="off_by_one"),
    _case("learnable-fp16-d128", softmax="learnable", dtype="float16", d_qk=128, d_v=128),
    _case("gqa-8/2-causal-d128", h_q=8, h_kv=2, mask="causal", d_qk=128, d_v=128),
    _case("mqa-4/1", h_kv=1),
    _case("d256-causal", d_qk=256, d_v=256, mask="causal"),
    _case("dqk128-dv64", d_qk=128, d_v=64),
    _case("padding-causal", sequence="padding", mask="causal"),
    _case("padding-bottom-right", sequence="padding", mask="causal_bottom_right", s_q=64),
    _case("padding-window-fp16", sequence="padding", window=(24, 8), dtype="float16"),
    _case("padding-learnable", sequence="padding", softmax="learnable"),
    _case("packed-causal", sequence="packed", mask="causal"),
    _case("packed-gqa", sequence="packed", h_q=8, h_kv=2),
    _case("packed-bottom-right-window", sequence="packed", mask="causal_bottom_right",
          window=(16, 0)),
    _case("sbhd-causal", layout="sbhd", mask="causal"),
    _case("bs3hd", layout="bs3hd", mask="causal"),
    _case("bshd-bs2hd-gqa", layout="bshd_bs2hd", h_q=8, h_kv=2),
    _case("deterministic-bias", deterministic=True, bias=(False, True), mask="causal"),
    # built-in score_mods, lowered to cuDNN's ALiBi mask and soft-capping score_mod
    _case("alibi-causal", mask="causal", score_mod=score_mods.alibi(4)),
    _case("alibi-causal-padding", mask="causal", sequence="padding",
          score_mod=score_mods.alibi(4)),
    _case("alibi-padding-bottom-right", sequence="padding", mask="causal_bottom_right",
          s_q=64, score_mod=score_mods.alibi(4)),
    _case("alibi-gqa-8/2-causal-d128", h_q=8, h_kv=2, d_qk=128, d_v=128, mask="causal",
          score_mod=score_mods.alibi(8)),
    _case("alibi-packed-causal-fp16", sequence="packed", mask="causal", dtype="float16",
          score_mod=score_mods.alibi(4)),
    _case("alibi-window-bias", window=(48, 0), bias=(False, True), score_mod=score_mods.alibi(4)),
    _case("softcap", score_mod=score_mods.softcap(2.0), scale=1.0),
    _case("softcap-gqa-8/2-fp16-d128", h_q=8, h_kv=2, d_qk=128, d_v=128, dtype="float16",
          score_mod=score_mods.softcap(2.0), scale=0.25),
    _case("softcap-learnable-sq<skv", s_q=64, softmax="learnable",
          score_mod=score_mods.softcap(2.0), scale=1.0),
]
SCORE_MOD_CASES = [p for p in CASES if p.values[0].score_mod is not None]


def _sequence(case: ac.Case, rng: np.random.Generator):
    """Padding / packing in the shapes cuDNN takes: (descriptor, oracle kwargs)."""
    if case.sequence == "padding":
        q_len = rng.integers(1, case.s_q + 1, case.b)
        q_len[0] = case.s_q  # one full row, one ragged
        kv_len = np.maximum(q_len * case.s_kv // case.s_q, 1) if case.s_kv != case.s_q else q_len
        if case.mask == "causal_bottom_right":  # every query sees a key
            kv_len = np.minimum(q_len + rng.integers(0, case.s_kv - case.s_q + 1, case.b), case.s_kv)
        return (SequenceDescriptor.from_lengths(jnp.asarray(q_len, jnp.int32),
                                                jnp.asarray(kv_len, jnp.int32)),
                dict(q_lengths=q_len, kv_lengths=kv_len))
    if case.sequence == "packed":
        ids = np.zeros((case.b, case.s_q), np.int32)
        for r in range(case.b):  # 3 non-empty segments, then trailing padding
            cuts = np.sort(rng.choice(np.arange(8, case.s_q - 8), 3, replace=False))
            ids[r, :cuts[0]] = 1
            ids[r, cuts[0]:cuts[1]] = 2
            ids[r, cuts[1]:cuts[2]] = 3
        return (SequenceDescriptor.from_segment_ids(jnp.asarray(ids), max_segments=3),
                dict(q_segment_ids=ids, kv_segment_ids=ids))
    return None, {}


def _build(case: ac.Case) -> ac.Built:
    return ac.build(case, sequence=_sequence)


def _run(built: ac.Built, deterministic: bool = False, backend: str = BACKEND, **extra):
    """(out, dq, dk, dv, dbias, d_offset) from one jitted vjp of `fused_attn` on the
    backend, as bshd float64 NumPy (None where the input is absent)."""
    case = built.case
    uq, uk, uv = ac._to_user_layout(case, built.q, built.k, built.v)
    opts = dict(built.options(), deterministic=deterministic, backend=backend)
    opts.update(extra)

    def f(uq, uk, uv, bias, offset):
        out = fusedattn.fused_attn(uq, uk, uv, **dict(opts, bias=bias, softmax_offset=offset))
        return jnp.swapaxes(out, 0, 1) if case.layout in ac.SEQ_FIRST else out

    out, vjp = jax.jit(lambda *a: jax.vjp(f, *a))(uq, uk, uv, built.bias, built.offset)
    gq, gk, gv, gbias, goffset = vjp(built.d_out)
    as64 = lambda x: None if x is None else np.asarray(x.astype(jnp.float32), np.float64)  # noqa: E731
    dq, dk, dv = ac._grads_to_bshd(case, as64(gq), as64(gk), as64(gv))
    return as64(out), dq, dk, dv, as64(gbias), as64(goffset)


@harness_on_cpu
@pytest.mark.parametrize("case,deterministic", CASES)
def test_against_float64_reference_and_xla(case: ac.Case, deterministic: bool):
    built = _build(case)
    ref = ac.oracle_for(built)
    out, dq, dk, dv, dbias, d_offset = _run(built, deterministic)
    tol = ac.TOLERANCE[case.dtype]
    checks = {"out": (out, ref.out), "dq": (dq, ref.dq), "dk": (dk, ref.dk), "dv": (dv, ref.dv)}
    if built.bias is not None:
        checks["dbias"] = (dbias, ref.dbias)
    if built.offset is not None:
        checks["doffset"] = (d_offset, ref.d_offset)
    errors = {name: ac.rel_error(got, want) for name, (got, want) in checks.items()}
    assert all(np.isfinite(list(errors.values()))), errors
    assert max(errors.values()) < tol, errors

    # padded / unused positions are exactly zero
    q_pad, kv_pad = ac.padded_query_mask(built), ac.padded_key_mask(built)
    assert np.all(out[q_pad] == 0) and np.all(dq[q_pad] == 0)
    assert np.all(dk[kv_pad] == 0) and np.all(dv[kv_pad] == 0)

    # the LSE at real query positions, and the XLA backend on the same inputs
    uq, uk, uv = ac._to_user_layout(case, built.q, built.k, built.v)
    opts = built.options()
    config, inputs = build_call(uq, uk, uv, **opts)
    with_lse = importlib.import_module(f"fusedattn.backends.{BACKEND}").attention_with_lse
    _, lse = jax.jit(lambda i: with_lse(config, i))(inputs)
    valid_rows = np.broadcast_to(~q_pad[:, None, :], ref.lse.shape)
    assert ac.rel_error(np.asarray(lse)[valid_rows], ref.lse[valid_rows]) < 1e-3
    xla_out = fusedattn.fused_attn(uq, uk, uv, backend="xla", **opts)
    if case.layout in ac.SEQ_FIRST:
        xla_out = jnp.swapaxes(xla_out, 0, 1)
    assert ac.rel_error(out, np.asarray(xla_out.astype(jnp.float32))) < tol


@harness_on_cpu
@pytest.mark.parametrize("case,deterministic", SCORE_MOD_CASES)
def test_builtin_score_mods_are_applied(case: ac.Case, deterministic: bool):
    """The backend's output is far from what attention without the score_mod gives,
    so the comparisons above would catch a backend that dropped it."""
    built = _build(case)
    plain = ac.oracle_for(ac.build(dataclasses.replace(case, score_mod=None), sequence=_sequence))
    out = _run(built, deterministic)[0]
    tol = ac.TOLERANCE[case.dtype]
    assert ac.rel_error(out, ac.oracle_for(built).out) < tol
    assert ac.rel_error(out, plain.out) > 2 * tol


@harness_on_cpu
def test_deterministic_backward_is_bitwise_repeatable():
    case = ac.Case(b=2, s_q=512, s_kv=512, h_q=8, h_kv=2, d_qk=128, d_v=128, dtype="bfloat16",
                   mask="causal", seed=3)
    built = _build(case)
    first = _run(built, deterministic=True)
    for _ in range(3):
        again = _run(built, deterministic=True)
        for a, b in zip(first[:4], again[:4]):
            np.testing.assert_array_equal(a, b)


@harness_on_cpu
def test_dropout_masks_agree_between_forward_and_backward():
    """O is linear in V (O = A V with A the dropped-out probabilities), so
    <dV, V> == <dO, O> holds only if the backward regenerates the forward's mask."""
    case = ac.Case(b=2, s_q=256, s_kv=256, h_q=4, h_kv=4, d_qk=64, d_v=64, dtype="bfloat16",
                   mask="causal", seed=5)
    built = _build(case)
    q, k, v, d_out = built.q, built.k, built.v, built.d_out
    key = jax.random.PRNGKey(7)
    out, _, _, dv, _, _ = _run(built, dropout=0.25, rng=key)
    lhs = float(np.vdot(dv, np.asarray(v.astype(jnp.float32), np.float64)))
    rhs = float(np.vdot(np.asarray(d_out.astype(jnp.float32), np.float64), out))
    assert abs(lhs - rhs) <= 2e-2 * max(abs(rhs), 1.0), (lhs, rhs)
    run = jax.jit(lambda q, k, v, key: fusedattn.fused_attn(
        q, k, v, mask="causal", dropout=0.25, rng=key, backend=BACKEND))
    a, b, c = run(q, k, v, key), run(q, k, v, key), run(q, k, v, jax.random.PRNGKey(8))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(a), np.asarray(c))
    plain = fusedattn.fused_attn(q, k, v, mask="causal", backend=BACKEND)
    assert ac.rel_error(a.astype(jnp.float32), plain.astype(jnp.float32)) > 0.05  # dropout did something


def test_explain_names_cudnn_or_gives_the_frontend_reason():
    q = jax.ShapeDtypeStruct((2, 256, 8, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 256, 2, 128), jnp.bfloat16)
    plan = fusedattn.explain(q, kv, kv, mask="causal")
    # usable; auto may still pick flash by measured speed (backend_choice)
    assert dict(plan.reasons)["cudnn"] is None and plan.chosen in ("cudnn", "flash"), str(plan)
    odd = jax.ShapeDtypeStruct((2, 256, 8, 36), jnp.bfloat16)  # head dim not a multiple of 8
    plan = fusedattn.explain(odd, odd, odd)
    reason = dict(plan.reasons)["cudnn"]
    assert plan.chosen != "cudnn" and reason.startswith("cuDNN:"), str(plan)
    assert "8" in reason, reason


TABLE = jnp.linspace(0.0, 1.0, 8)  # a lookup by position: a gather, which cuDNN has not


def test_explain_names_cudnn_for_the_builtin_score_mods():
    q = jax.ShapeDtypeStruct((2, 256, 8, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 256, 2, 128), jnp.bfloat16)
    padded = SequenceDescriptor.from_lengths(jnp.array([256, 100]), jnp.array([256, 90]))
    for options, how in ((dict(mask="causal", score_mod=score_mods.alibi(8)), "lowered"),
                         (dict(mask="causal_bottom_right", score_mod=score_mods.alibi(8)),
                          "lowered"),
                         (dict(mask="causal", window=(64, 0), score_mod=score_mods.alibi(8)),
                          "lowered"),
                         (dict(mask="causal", score_mod=score_mods.softcap(30.0)), "lowered"),
                         (dict(mask="causal", sequence=padded, score_mod=score_mods.alibi(8)),
                          "alibi=1"),
                         # cuDNN's ALiBi form is top-left only: the lowered program runs,
                         # one batch entry at a time for the padding lengths
                         (dict(mask="causal_bottom_right", sequence=padded,
                               score_mod=score_mods.alibi(8)), "each batch entry")):
        plan = fusedattn.explain(q, kv, kv, **options)
        assert plan.chosen == "cudnn", str(plan)
        assert how in str(plan) or how in cudnn.graph_key(plan.config), str(plan)
    # what cuDNN cannot do runs elsewhere, with cuDNN's reason
    plan = fusedattn.explain(q, kv, kv, score_mod=lambda s, b, h, i, j: s + TABLE[(i - j) % 8])
    assert plan.chosen in ("block_sparse", "xla"), str(plan)
    assert "gather" in dict(plan.reasons)["cudnn"], str(plan)


def test_alibi_graphs_copy_from_host_and_avoid_command_buffers():
    """The probe sees the host-to-device slope copies of cuDNN's ALiBi (padding: no
    program runs) and none elsewhere, and those calls lower to the targets XLA does
    not capture; a lowered ALiBi has no copies."""
    base = AttnConfig(batch=2, s_q=256, s_kv=256, h_q=8, h_kv=8, d_qk=64, d_v=64,
                      dtype="bfloat16", scale=0.125, mask="causal")
    with_alibi = dataclasses.replace(base, sequence="padding", score_mod=score_mods.alibi(8))
    assert cudnn.probe(with_alibi).host_copies == (True, True, True)
    assert cudnn.probe(base).host_copies == (False, False, False)
    for lowered in (score_mods.alibi(8), score_mods.softcap(8.0)):
        assert cudnn.probe(dataclasses.replace(base, score_mod=lowered)).host_copies == \
            (False, False, False)
    q = jnp.ones((2, 256, 8, 64), jnp.bfloat16)
    padded = SequenceDescriptor.from_lengths(jnp.array([256, 100]), jnp.array([256, 90]))

    def loss(q):
        out = fusedattn.fused_attn(q, q, q, mask="causal", sequence=padded,
                                   score_mod=score_mods.alibi(8))
        return jnp.sum(out.astype(jnp.float32))
    text = jax.jit(jax.grad(loss)).lower(q).as_text()
    assert "fusedattn_cudnn_fwd_nocmdbuf" in text and "fusedattn_cudnn_bwd_nocmdbuf" in text
    assert "@fusedattn_cudnn_fwd(" not in text and "@fusedattn_cudnn_bwd(" not in text


def _fresh_config(n: int) -> AttnConfig:
    """A config no other test builds (an odd scale makes the key unique)."""
    return AttnConfig(batch=2, s_q=1024, s_kv=1024, h_q=8, h_kv=8, d_qk=128, d_v=128,
                      dtype="bfloat16", scale=0.0883 + n * 1e-7, mask="causal")


def test_probe_builds_its_three_graphs_at_once():
    found = cudnn.probe(_fresh_config(1))
    assert found.ok, found.message
    slowest, total = max(found.build_seconds), sum(found.build_seconds)
    assert all(t > 0 for t in found.build_seconds), found
    # concurrent builds: the probe took about the slowest graph, not the sum of all three
    assert slowest <= found.wall_seconds + 1e-3 and found.wall_seconds < total, found


def test_one_builder_per_graph_and_a_bounded_number_of_handles():
    """Four threads probe one fresh key at once: each of its three graphs is built once
    (the cache grows by exactly 3), all threads get the same answer, and the handles
    stay pooled: short-lived build threads leave none behind."""
    import threading
    module = native.module("cuda")
    device = jax.devices()[0].id
    before_cache, before_handles = module.cudnn_cache_size(), module.cudnn_handle_count(device)
    key = cudnn.graph_key(_fresh_config(2))
    results = [None] * 4

    def probe(i):
        results[i] = module.cudnn_check_support(key)
    threads = [threading.Thread(target=probe, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r["ok"] for r in results), results
    assert len({tuple(sorted(r["workspace"].items())) for r in results}) == 1
    assert module.cudnn_cache_size() == before_cache + 3
    # more fresh configs, one after another: no handle per build thread
    for n in range(3, 8):
        assert cudnn.probe(_fresh_config(n)).ok
    # at most 3 builds ran at once after the 4 threads' probes (4 threads x 3 graphs,
    # but one builder per graph; the others wait without a handle)
    assert module.cudnn_handle_count(device) <= max(before_handles, 3)


def test_one_libcudnn_in_the_process():
    fusedattn.fused_attn(jnp.ones((1, 64, 2, 64), jnp.bfloat16), jnp.ones((1, 64, 2, 64), jnp.bfloat16),
                         jnp.ones((1, 64, 2, 64), jnp.bfloat16), backend="cudnn").block_until_ready()
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if re.search(r"libcudnn\.so\.9$", line.strip())}
    assert len(paths) == 1, paths
    assert os.path.realpath(native.versions()["cudnn_library"]) == os.path.realpath(paths.pop())


def test_probe_reports_workspace_and_is_cached():
    cfg = AttnConfig(batch=2, s_q=512, s_kv=512, h_q=8, h_kv=8, d_qk=64,
                                      d_v=64, dtype="bfloat16", scale=0.125, mask="causal")
    first = cudnn.probe(cfg)
    assert first.ok and all(w >= 0 for w in first.workspace)
    assert cudnn.probe(cfg) is first
