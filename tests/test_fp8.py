"""FP8 attention on CPU: the XLA emulation against the float64 oracle (both API
levels), validation, dispatch reasons, the delayed-scaling recipe, and lowering of
the cuDNN FP8 calls for CUDA without a GPU. The same cases run on cuDNN in
tests/gpu/test_fp8_gpu.py."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from support import fp8_cases as fc
import fusedattn
from fusedattn import dispatch, fp8
from fusedattn.backends import cudnn
from fusedattn.backends.cudnn import fp8 as cudnn_fp8

CASES = [
    fc.Fp8Case(),
    fc.Fp8Case(mask="causal", h_kv=2),
    fc.Fp8Case(padding=True, layout="sbhd"),
    fc.Fp8Case(mask="causal", padding=True, dtype="float16", d=32),
]


@pytest.mark.parametrize("case", CASES, ids=fc.Fp8Case.label)
def test_current_scaling_matches_the_oracle(case):
    fc.check_current_scaling(case, backend="xla")


@pytest.mark.parametrize("out_dtype", [fp8.E4M3, jnp.bfloat16], ids=["fp8_out", "bf16_out"])
@pytest.mark.parametrize("case", CASES[:2], ids=fc.Fp8Case.label)
def test_explicit_fp8_matches_the_oracle(case, out_dtype):
    errors = fc.check_explicit(case, out_dtype, backend="xla")
    # The emulation's S is exact fp32; its dP uses the FP8 o (as the kernels do), so
    # its amax is the oracle's to within o's rounding.
    assert errors["amax_s"] <= 1.0 + 1e-6
    assert abs(errors["amax_dp"] - errors["oracle_amax_dp"]) <= fc.OUT_TOL * errors["oracle_amax_dp"]


def test_quantize_saturates_and_round_trips():
    x = jnp.array([0.0, 1.0, -3.0, 1e6, -1e6], jnp.float32)
    q8 = fp8.quantize(x, jnp.float32(2.0))
    assert q8.dtype == jnp.dtype(fp8.E4M3)
    np.testing.assert_array_equal(np.asarray(q8.astype(jnp.float32)), [0, 2, -6, 448, -448])
    np.testing.assert_array_equal(np.asarray(fp8.dequantize(q8, 2.0, jnp.float32)),
                                  [0, 1, -3, 224, -224])
    assert float(fp8.scale_for(jnp.float32(0.0))) == 1.0
    assert float(fp8.scale_for(jnp.float32(2.0), "e5m2")) == 57344.0 / 2


def test_bounded_scales_never_saturate():
    """The backward's bound-based scales keep the real gradients inside the format."""
    case = fc.Fp8Case(mask="causal", h_kv=2)
    q, k, v, d_out, seq = fc.inputs(case)
    config, _ = fusedattn.validation.build_call(q, k, v, mask="causal", precision="fp8")
    fwd, stats = fp8.forward_scales(q, k, v)
    bwd = fp8.backward_scales(config, fwd, stats, d_out)
    ref = fc.reference(case, *fc.current_scaling_inputs(q, k, v), d_out, seq)
    top = fp8.FP8_MAX[config.fp8_grad]
    for name, grad in (("dq", ref.dq), ("dk", ref.dk), ("dv", ref.dv)):
        assert np.abs(grad).max() * float(getattr(bwd, name)) <= top, name
    assert np.abs(ref.out).max() * float(fwd.o) <= 448


def test_one_argument_mode_trains_like_bf16():
    """A toy regression: a few SGD steps through precision='fp8' lower the loss as BF16 does."""
    bf16, f8 = fc.toy_training(seed=3, b=2, s=32, h=2, d=8, width=16, init=0.3, lr=2.0, steps=8)
    assert f8[-1] < 0.9 * f8[0]
    assert abs(f8[-1] - bf16[-1]) < 0.1 * bf16[0]


def test_delayed_scaling_recipe_is_pure_and_jittable():
    state = fp8.DelayedScaling.init(history_len=3)
    fwd = fp8.ForwardAmax(jnp.float32(1.0), jnp.float32(2.0))
    bwd = fp8.BackwardAmax(*(jnp.float32(x) for x in (3.0, 4.0, 5.0, 6.0)))
    update = jax.jit(lambda s, a: s.update(fwd, bwd, a, 8.0, 16.0, 7.0))
    state = update(state, jnp.float32(4.0))
    state = update(state, jnp.float32(1.0))
    np.testing.assert_array_equal(np.asarray(state.history.q), [1.0, 4.0, 0.0])
    scales = jax.jit(lambda s: s.scales(margin=1))(state)
    assert float(scales.q) == pytest.approx(448 / 4.0 / 2)  # max of the history, margin 2^1
    assert float(scales.do) == pytest.approx(57344 / 7.0 / 2)
    assert float(scales.s) == 448
    with pytest.raises(ValueError, match="history_len"):
        fp8.DelayedScaling.init(0)


def test_explicit_api_validation():
    case = fc.Fp8Case(s=16, d=16)
    q, k, v, d_out, _ = fc.inputs(case)
    scales = fp8.Fp8Scales.ones()
    q8 = fp8.quantize(q, 1.0)
    with pytest.raises(TypeError, match="q must be float8_e4m3fn"):
        fp8.attention(q, q8, q8, scales)
    with pytest.raises(TypeError, match="scales must be a fusedattn.fp8.Fp8Scales"):
        fp8.attention(q8, q8, q8, {"q": 1.0})
    with pytest.raises(ValueError, match=r"scales.o must be a scalar"):
        fp8.attention(q8, q8, q8, scales._replace(o=jnp.ones((2,))))
    with pytest.raises(TypeError, match="out_dtype"):
        fp8.attention(q8, q8, q8, scales, out_dtype=jnp.float32)
    with pytest.raises(ValueError, match="d_out_format"):
        fp8.attention(q8, q8, q8, scales, d_out_format="e3m4")
    with pytest.raises(ValueError, match="precision must be"):
        fusedattn.fused_attn(q, k, v, precision="fp4")
    with pytest.raises(TypeError, match="precision='fp8' takes bfloat16 or float16"):
        fusedattn.fused_attn(q.astype(jnp.float32), k.astype(jnp.float32),
                             v.astype(jnp.float32), precision="fp8")


def test_dispatch_reasons_for_fp8(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_PLATFORM, "cuda")
    dispatch.clear_cache()
    q = jax.ShapeDtypeStruct((2, 128, 4, 128), jnp.bfloat16)
    with cudnn.assume_supported(workspace_bytes=4096):
        plan = fusedattn.explain(q, q, q, precision="fp8", mask="causal")
        reasons = dict(plan.reasons)
        assert plan.chosen == "cudnn", str(plan)
        assert "has no FP8 kernels" in reasons["small_seq"]
        bias = jax.ShapeDtypeStruct((1, 4, 128, 128), jnp.bfloat16)
        plan = fusedattn.explain(q, q, q, bias=bias, precision="fp8")
        assert plan.chosen is None
        assert "FP8 attention takes no bias" in dict(plan.reasons)["cudnn"]
        assert "FP8 attention takes no bias" in dict(plan.reasons)["xla"]
    dispatch.clear_cache()


def _causal_fp8_step_for_cuda(monkeypatch, shape):
    """(StableHLO text of a causal precision='fp8' training step lowered for CUDA without
    a GPU, its cuDNN graph key, explain()'s text)."""
    monkeypatch.setenv(dispatch.ENV_PLATFORM, "cuda")
    dispatch.clear_cache()
    q = jnp.zeros(shape, jnp.bfloat16)

    def step(q, k, v):
        return jax.grad(lambda q, k, v: fusedattn.fused_attn(
            q, k, v, mask="causal", precision="fp8").astype(jnp.float32).sum(), (0, 1, 2))(q, k, v)
    with cudnn.assume_supported(workspace_bytes=4096):
        text = jax.jit(step).trace(q, q, q).lower(lowering_platforms=("cuda",)).as_text()
        key = cudnn.graph_key(fusedattn.validation.build_call(q, q, q, mask="causal",
                                                              precision="fp8")[0])
        plan = str(fusedattn.explain(q, q, q, mask="causal", precision="fp8"))
    dispatch.clear_cache()
    return text, key, plan


def test_fp8_lowers_for_cuda_without_a_gpu(monkeypatch):
    text, key, _ = _causal_fp8_step_for_cuda(monkeypatch, (2, 128, 4, 128))
    assert "fusedattn_cudnn_fp8_fwd" in text and "fusedattn_cudnn_fp8_bwd" in text
    assert "f8E4M3FN" in text and "f8E5M2" in text
    fields = dict(item.split("=") for item in key.split(";"))
    assert (fields["fp8"], fields["fp8_do"], fields["fp8_grad"]) == ("1", "1", "1")


# ---- cuDNN's causal FP8 backward in small calls (backends/cudnn_fp8.py) -----------------
def _fp8_config(b, h_q, h_kv, mask="causal"):
    q = jax.ShapeDtypeStruct((b, 256, h_q, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((b, 256, h_kv, 128), jnp.bfloat16)
    return fusedattn.validation.build_call(q, kv, kv, mask=mask, precision="fp8")[0]


def test_causal_fp8_backward_groups(monkeypatch):
    groups = cudnn_fp8.backward_groups
    assert groups(_fp8_config(4, 16, 16)) == (((0, 2), (0, 16)), ((2, 4), (0, 16)))
    assert groups(_fp8_config(5, 16, 16))[-1] == ((4, 5), (0, 16))
    assert groups(_fp8_config(2, 16, 16)) == (((0, 2), (0, 16)),)      # 32 pairs: one call
    assert groups(_fp8_config(4, 16, 16, mask="none")) == (((0, 4), (0, 16)),)
    # More query heads than a call takes: whole kv-head groups (GQA 64/8: 4 kv heads each).
    assert groups(_fp8_config(1, 64, 8)) == (((0, 1), (0, 4)), ((0, 1), (4, 8)))
    assert cudnn_fp8.group_config(_fp8_config(1, 64, 8), ((0, 1), (4, 8))).h_q == 32
    monkeypatch.setenv(cudnn_fp8.ENV_CAUSAL_PAIRS, "0")
    assert groups(_fp8_config(4, 16, 16)) == (((0, 4), (0, 16)),)
    monkeypatch.setenv(cudnn_fp8.ENV_CAUSAL_PAIRS, "x")
    with pytest.raises(ValueError, match=cudnn_fp8.ENV_CAUSAL_PAIRS):
        groups(_fp8_config(4, 16, 16))


def test_a_refused_split_runs_one_call_and_says_why(monkeypatch):
    monkeypatch.setattr(cudnn_fp8, "supports",
                        lambda c: "too small here" if c.batch < 4 else None)
    groups, why = cudnn_fp8.backward_split(_fp8_config(4, 16, 16))
    assert groups == (((0, 4), (0, 16)),)
    assert "FP8 backward in one call: cuDNN refuses" in why and "too small here" in why


def test_causal_fp8_backward_lowers_to_small_calls(monkeypatch):
    """b4 h16 causal on cuDNN: one forward, the backward as two calls of b2 h16 (and
    explain() says why)."""
    text, _, plan = _causal_fp8_step_for_cuda(monkeypatch, (4, 256, 16, 128))
    calls = re.findall(r"custom_call @(fusedattn_cudnn_fp8_\w+)", text)
    assert sorted(calls) == ["fusedattn_cudnn_fp8_bwd"] * 2 + ["fusedattn_cudnn_fp8_fwd"], calls
    assert "FP8 backward in 2 calls of at most 32 (batch, head) pairs" in plan, plan


# ---- partitioning (8 host devices, tests/conftest.py) ------------------------------------
def _mesh(shape, names):
    return jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape))


def test_fp8_calls_split_over_batch_and_heads_with_scalar_all_reduces_only():
    """precision='fp8' under jit with dp x tp NamedSharding inputs: no gather; the only
    all-reduces are of scalars (the amaxes behind the global scales, and the loss);
    numbers equal the unsplit call."""
    from support import sharding_cases as sc
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    mesh = _mesh((2, 4), ("dp", "tp"))
    case = fc.Fp8Case(b=4, s=32, h_q=8, h_kv=4, d=16, mask="causal", dtype="bfloat16")
    q, k, v, d_out, _ = fc.inputs(case)

    def f(q, k, v):
        return fusedattn.fused_attn(q, k, v, mask="causal", precision="fp8", backend="xla")
    shard = NamedSharding(mesh, P("dp", None, "tp"))
    single, sharded, counts, text = sc.run(f, [q, k, v], [shard] * 3, d_out)
    assert counts["all-gather"] == counts["all-to-all"] == counts["collective-permute"] == 0, \
        counts
    assert counts["all-reduce"] >= 1
    for shape in sc.all_reduce_shapes(text):  # e.g. "f32[]" or "(f32[], f32[])"
        assert all(dims == "" for dims in re.findall(r"\w+\[([^\]]*)\]", shape)), shape
    sc.assert_same(single, sharded, 1e-2)


def test_explicit_fp8_amaxes_under_a_split_equal_the_unsplit_ones():
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    mesh = _mesh((4,), ("dp",))
    case = fc.Fp8Case(b=4, s=32, d=16, mask="causal")
    q, k, v, d_out, _ = fc.inputs(case)
    scales, _ = fp8.forward_scales(q, k, v)
    q8, k8, v8 = (fp8.quantize(x, s) for x, s in ((q, scales.q), (k, scales.k), (v, scales.v)))

    def step(q8, k8, v8):
        def f(q8, k8, v8, bwd):
            return fp8.attention(q8, k8, v8, scales, bwd, out_dtype=jnp.bfloat16, mask="causal",
                                 backend="xla")
        (out, fwd_amax), vjp = jax.vjp(f, q8, k8, v8, fp8.BackwardAmax.zeros())
        zero = jnp.float32(0)
        return out, fwd_amax, vjp((d_out, fp8.ForwardAmax(zero, zero)))[3]
    want = jax.jit(step)(q8, k8, v8)
    shard = NamedSharding(mesh, P("dp"))
    got = jax.jit(step)(*(jax.device_put(x, shard) for x in (q8, k8, v8)))
    for a, b in zip(jax.tree_util.tree_leaves(want[1:]), jax.tree_util.tree_leaves(got[1:])):
        assert float(a) == pytest.approx(float(b), rel=1e-5)
    assert fc.rel(got[0], want[0]) < 1e-2


def test_fp8_calls_lowered_for_cuda_carry_the_rule(monkeypatch):
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    monkeypatch.setenv(dispatch.ENV_PLATFORM, "cuda")
    dispatch.clear_cache()
    mesh = _mesh((2, 4), ("dp", "tp"))
    q = jax.ShapeDtypeStruct((8, 128, 8, 128), jnp.bfloat16,
                             sharding=NamedSharding(mesh, P("dp", None, "tp")))

    def loss(q, k, v):
        return fusedattn.fused_attn(q, k, v, precision="fp8").astype(jnp.float32).sum()
    with cudnn.assume_supported(workspace_bytes=1 << 20):
        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, q, q).lower(
            lowering_platforms=("cuda",)).as_text()
    dispatch.clear_cache()
    assert text.count("CustomSPMDPartitioning") == 2  # FP8 training forward and backward
    assert text.count("sdy.sharding_rule") >= 2
