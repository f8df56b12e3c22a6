"""FP8 attention on cuDNN (H100 / H200): both API levels against the float64 oracle
on the dequantized inputs (tests/fp8_cases.py states the tolerances), the amaxes,
the refusals cuDNN makes on this GPU, and a toy training run."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from support import fp8_cases as fc
import fusedattn
from fusedattn import fp8
from fusedattn.backends.cudnn import fp8 as cudnn_fp8

pytestmark = pytest.mark.gpu

CASES = [
    fc.Fp8Case(s=256, d=128),
    fc.Fp8Case(s=256, d=128, mask="causal"),
    fc.Fp8Case(s=256, d=128, mask="causal", h_q=8, h_kv=2),
    fc.Fp8Case(s=256, d=128, padding=True),
    fc.Fp8Case(s=256, d=128, mask="causal", padding=True, layout="sbhd", dtype="float16"),
    fc.Fp8Case(b=1, s=2048, h_q=4, h_kv=4, d=128, mask="causal"),
]


def _chosen(case: fc.Fp8Case) -> str:
    q, k, v, _, seq = fc.inputs(case)
    return fusedattn.explain(q, k, v, mask=case.mask, sequence=seq, layout=case.layout,
                             precision="fp8").chosen


@pytest.mark.parametrize("case", CASES, ids=fc.Fp8Case.label)
def test_current_scaling_on_cudnn(case):
    assert _chosen(case) == "cudnn"
    errors = fc.check_current_scaling(case, backend="cudnn")
    print(case.label(), {k: round(v, 4) for k, v in errors.items()})


@pytest.mark.parametrize("out_dtype", [fp8.E4M3, jnp.bfloat16], ids=["fp8_out", "bf16_out"])
@pytest.mark.parametrize("case", CASES[:4], ids=fc.Fp8Case.label)
def test_explicit_fp8_on_cudnn(case, out_dtype):
    errors = fc.check_explicit(case, out_dtype, backend="cudnn")
    print(case.label(), {k: round(v, 4) for k, v in errors.items()})
    # S: the kernel's probabilities (at most 1). dP: the gradient of the scaled logits.
    assert 0.0 < errors["amax_s"] <= 1.0 + 1e-3
    assert errors["amax_dp"] == pytest.approx(errors["oracle_amax_dp"], rel=fc.GRAD_TOL)


SPLIT_CASES = [
    fc.Fp8Case(b=4, s=256, h_q=16, h_kv=16, d=128, mask="causal"),  # 2 calls of b2
    fc.Fp8Case(b=4, s=256, h_q=16, h_kv=16, d=128, mask="causal", padding=True, layout="sbhd"),
    fc.Fp8Case(b=1, s=256, h_q=64, h_kv=16, d=128, mask="causal"),  # 2 calls of 32 heads
]


@pytest.mark.parametrize("case", SPLIT_CASES, ids=fc.Fp8Case.label)
def test_causal_backward_in_small_calls(case, monkeypatch):
    """A causal backward of 64 (batch, head) pairs runs as two calls of 32: explain()
    says so, both API levels meet the oracle, and the gradients are one call's."""
    q, k, v, d_out, seq = fc.inputs(case)
    opts = dict(mask="causal", sequence=seq, layout=case.layout, precision="fp8")
    assert "FP8 backward in 2 calls of at most 32" in str(fusedattn.explain(q, k, v, **opts))
    fc.check_current_scaling(case, backend="cudnn")
    fc.check_explicit(case, fp8.E4M3, backend="cudnn")

    def grads():
        return jax.vjp(lambda q, k, v: fusedattn.fused_attn(q, k, v, backend="cudnn", **opts),
                       q, k, v)[1](d_out)
    split = grads()
    monkeypatch.setenv(cudnn_fp8.ENV_CAUSAL_PAIRS, "0")
    for a, b in zip(split, grads()):
        assert fc.rel(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)) < 1e-2


def test_emulation_matches_cudnn():
    """The XLA emulation (CPU's FP8 path) and cuDNN agree to the tolerance of the
    quantization they share."""
    case = CASES[1]
    q, k, v, d_out, _ = fc.inputs(case)

    def run(backend):
        out, vjp = jax.vjp(lambda q, k, v: fusedattn.fused_attn(
            q, k, v, mask="causal", precision="fp8", backend=backend), q, k, v)
        return (out,) + vjp(d_out)
    for a, b in zip(run("cudnn"), run("xla")):
        assert fc.rel(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)) < fc.GRAD_TOL


@pytest.mark.parametrize("d", [64, 256])
def test_head_dims_cudnn_refuses_on_hopper_are_explained(d):
    """On Hopper cuDNN 9.19's FP8 backward takes head dim 128 only: the reason is
    cuDNN's own, and auto falls back to the emulation."""
    major = jax.devices()[0].compute_capability.split(".")[0] if hasattr(
        jax.devices()[0], "compute_capability") else "9"
    if major != "9":
        pytest.skip("the refusal checked here is Hopper's")
    q = jnp.zeros((2, 256, 4, d), jnp.bfloat16)
    plan = fusedattn.explain(q, q, q, precision="fp8")
    reason = dict(plan.reasons)["cudnn"]
    assert "hidden_dim" in reason, reason
    assert plan.chosen == "xla"


def test_one_argument_mode_trains_like_bf16_on_cudnn():
    bf16, f8 = fc.toy_training(seed=5, b=2, s=256, h=4, d=128, width=64, init=0.1, lr=20.0,
                               steps=10)
    print("bf16", bf16, "\nfp8", f8)
    assert f8[-1] < 0.99 * f8[0]
    assert abs((bf16[0] - bf16[-1]) - (f8[0] - f8[-1])) < 0.2 * (bf16[0] - bf16[-1])
