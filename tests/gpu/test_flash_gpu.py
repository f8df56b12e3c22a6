"""The flash backend (FlashAttention-3 through flash-attn3-jax) on an H100: forward,
LSE and every gradient against the float64 oracle; a plan that runs cudnn for
inference and flash for training; the measured choice in auto dispatch.

Tolerance: the project's bf16 / fp16 relative L2 (tests/attn_cases.TOLERANCE), as
for cudnn. Skips with the backend's own reason where FA3 cannot run (no Hopper
GPU, package absent)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from support import attn_cases as ac
import fusedattn
from fusedattn import dispatch
from fusedattn.dispatch import measure as backend_choice
from fusedattn.backends import flash
from fusedattn.backends import native_op as native_call
from fusedattn.validation import build_call

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _needs_flash():
    if dispatch.current_platform() != "cuda":
        pytest.skip("needs a CUDA GPU")
    why = flash.availability_reason()
    if why is not None:
        pytest.skip(why)


def _case(name, **fields):
    case = ac.Case(**{**dict(b=2, s_q=256, s_kv=256, h_q=4, h_kv=4, d_qk=128, d_v=128,
                             dtype="bfloat16"), **fields})
    return pytest.param(case, id=name)


CASES = [
    _case("dense"),
    # s 1000 rounds up to 1040 rows for the d128 dense backward's 80-row tiles, past
    # the 1024 that flash-attn3-jax 0.2.3's own backward allocates.
    _case("dense-s1000-gqa", b=1, s_q=1000, s_kv=1000, h_q=8, h_kv=2),
    _case("dense-fp16", dtype="float16"),
    _case("causal", mask="causal"),
    _case("causal-fp16", mask="causal", dtype="float16"),
    _case("d64", d_qk=64, d_v=64),
    _case("gqa-8/2-causal", h_q=8, h_kv=2, mask="causal"),
    _case("mqa-4/1", h_kv=1),
    _case("bottom-right-sq<skv", mask="causal_bottom_right", s_q=128),
    _case("window-both-sides", window=(48, 16)),
    _case("causal-window", mask="causal", window=(64, 0)),
    _case("scale", scale=0.3),
    # packed (THD): each segment one of FA3's variable-length sequences, padding at the
    # end of rows, segments without keys (kv segments of their own)
    _case("packed", sequence="packed", max_segments=3),
    _case("packed-gqa-bottom-right", sequence="packed", mask="causal_bottom_right", h_q=8,
          h_kv=2, s_kv=320),
    _case("packed-shared-causal", sequence="packed-shared", mask="causal", max_segments=4),
    _case("packed-shared-causal-window", sequence="packed-shared", mask="causal",
          window=(40, 0), dtype="float16"),
]


def test_packed_top_left_causal_needs_shared_segments():
    built = ac.build(ac.Case(b=2, s_q=256, s_kv=256, h_q=4, h_kv=4, d_qk=128, d_v=128,
                             dtype="bfloat16", sequence="packed", mask="causal"))
    config, _ = build_call(built.q, built.k, built.v, **built.options())
    assert "FA3 aligns them bottom-right" in flash.config_reason(config)


def _poison_free_memory():
    """Fill memory the allocator hands out next with NaN: FA3 leaves nothing of a packed
    call unwritten (padding gets its zeros from the kernels' empty tiles), so a NaN that
    survives into an output fails the comparison."""
    jnp.full((1 << 28,), jnp.nan, jnp.float32).block_until_ready().delete()


def _grads(built, run):
    _poison_free_memory()
    out, vjp = jax.jit(lambda *a: jax.vjp(run, *a))(built.q, built.k, built.v)
    as64 = lambda x: np.asarray(x.astype(jnp.float32), np.float64)  # noqa: E731
    return (as64(out),) + tuple(as64(g) for g in vjp(built.d_out))


def _check(built, out, dq, dk, dv):
    ref = ac.oracle_for(built)
    tol = ac.TOLERANCE[built.case.dtype]
    errors = {"out": ac.rel_error(out, ref.out), "dq": ac.rel_error(dq, ref.dq),
              "dk": ac.rel_error(dk, ref.dk), "dv": ac.rel_error(dv, ref.dv)}
    assert max(errors.values()) < tol, errors
    return ref


@pytest.mark.parametrize("case", CASES)
def test_against_float64_reference(case):
    """Forward, LSE and every gradient."""
    built = ac.build(case)
    opts = built.options()
    config, inputs = build_call(built.q, built.k, built.v, **opts)
    ref = ac.oracle_for(built)
    _poison_free_memory()
    out, lse = jax.jit(lambda i: native_call.attention("flash", config, i, need_lse=True))(inputs)
    out = np.asarray(out.astype(jnp.float32), np.float64)
    assert ac.rel_error(out, ref.out) < ac.TOLERANCE[case.dtype]
    seen = np.isfinite(ref.lse)   # (rows that see no key: -inf, packed padding)
    assert np.array_equal(np.isfinite(np.asarray(lse)), seen)
    assert ac.rel_error(np.where(seen, lse, 0.0), np.where(seen, ref.lse, 0.0)) < 1e-3

    def run(q, k, v):
        return fusedattn.fused_attn(q, k, v, backend="flash", **opts)
    _check(built, *_grads(built, run))


def test_a_plan_can_run_cudnn_for_inference_and_flash_for_training():
    built = ac.build(next(c.values[0] for c in CASES if c.id == "causal"))
    config, inputs = build_call(built.q, built.k, built.v, mask="causal")

    @dataclasses.dataclass(frozen=True)
    class Fixed:  # what a measurement picking cudnn to infer and flash to train gives
        def for_step(self, step):
            return {"inference": "cudnn", "training": "flash"}[step]
    plan = dataclasses.replace(dispatch.plan(config, "cudnn"), rivals=Fixed())

    def run(q, k, v):
        return plan.run(inputs._replace(q=q, k=k, v=v))
    fwd_text = jax.jit(run).lower(built.q, built.k, built.v).as_text()
    assert "fusedattn_cudnn_fwd" in fwd_text and "flash_mha" not in fwd_text
    step_text = jax.jit(lambda *a: jax.vjp(run, *a)[1](built.d_out)).lower(
        built.q, built.k, built.v).as_text()
    assert "flash_mha_fwd" in step_text and "flash_mha_bwd" in step_text
    assert "fusedattn_cudnn" not in step_text
    _check(built, *_grads(built, run))


def test_auto_measures_cudnn_against_flash_once_per_step(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSEDATTN_CACHE_DIR", str(tmp_path))
    backend_choice.clear()
    dispatch.clear_cache()
    q = jax.ShapeDtypeStruct((2, 1024, 8, 128), jnp.bfloat16)
    plan = fusedattn.explain(q, q, q, mask="causal")
    assert plan.rivals is not None, str(plan)
    text = str(plan)  # explain's text measures both steps
    choices = [plan.rivals.choice(step) for step in backend_choice.STEPS]
    assert all({name for name, _ in c.timings} == {"cudnn", "flash"} for c in choices), text
    assert plan.chosen == choices[1].backend
    assert "measured now" in text
    backend_choice.clear()  # as a new process would: the stored choices are read back
    dispatch.clear_cache()
    again = fusedattn.explain(q, q, q, mask="causal")
    for step, before in zip(backend_choice.STEPS, choices):
        stored = again.rivals.choice(step)
        assert stored.source == "persistent cache" and stored.timings == before.timings
    print(plan)
