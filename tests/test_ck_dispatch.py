"""The ROCm side on a CPU machine: dispatch with the platform faked, the CK
backend's reasons, and the CK calls lowered for ROCm (no AMD GPU is needed to
trace and lower; running them needs one, see docs/ROCM.md)."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fusedattn

from fusedattn import dispatch
from fusedattn.backends import ck
from fusedattn.sequence import SequenceDescriptor
from fusedattn.validation import build_call


def _arrays(b=2, s_q=64, s_kv=64, h_q=4, h_kv=4, d=64, d_v=None, dtype=jnp.bfloat16, layout="bshd"):
    d_v = d if d_v is None else d_v
    ks = jax.random.split(jax.random.key(0), 3)

    def make(key, s, h, dd):
        shape = (b, s, h, dd) if layout == "bshd" else (s, b, h, dd)
        return jax.random.normal(key, shape, dtype)
    return make(ks[0], s_q, h_q, d), make(ks[1], s_kv, h_kv, d), make(ks[2], s_kv, h_kv, d_v)


def _config(**kw):
    shape_kw = {n: kw.pop(n) for n in list(kw) if n in ("b", "s_q", "s_kv", "h_q", "h_kv", "d", "d_v",
                                                       "dtype", "layout")}
    q, k, v = _arrays(**shape_kw)
    return build_call(q, k, v, layout=shape_kw.get("layout", "bshd"), **kw)


# ---- platform and dispatch ----------------------------------------------------
@pytest.fixture(autouse=True)
def _fresh_plans():
    dispatch.clear_cache()
    yield
    dispatch.clear_cache()


def test_platform_env_fakes_rocm(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_PLATFORM, "rocm")
    assert dispatch.current_platform() == "rocm"


def test_rocm_preference_and_fallback(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_PLATFORM, "rocm")
    config, _ = _config()
    plan = dispatch.plan(config)
    assert plan.platform == "rocm"
    names = [n for n, _ in plan.reasons]
    assert names[:3] == ["small_seq", "ck", "xla"]
    # No ROCm extension on a CPU machine: ck says so, and XLA serves.
    reason = dict(plan.reasons)["ck"]
    assert reason is not None and "fusedattn._rocm" in reason
    assert plan.chosen == "xla"


def test_forcing_ck_on_rocm_without_extension_names_the_reason(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_PLATFORM, "rocm")
    config, _ = _config()
    plan = dispatch.plan(config, backend="ck")
    assert plan.chosen is None
    with pytest.raises(dispatch.UnsupportedError, match="fusedattn._rocm"):
        plan.backend


def test_ck_refuses_other_platforms(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_PLATFORM, "cuda")
    config, _ = _config()
    plan = dispatch.plan(config, backend="ck")
    assert plan.chosen is None
    assert "runs on rocm, not cuda" in dict(plan.reasons)["ck"]


def test_dispatch_uses_ck_when_it_is_usable(monkeypatch):
    """With the extension reported present, a CK-shaped config goes to ck, the rest to XLA."""
    monkeypatch.setenv(dispatch.ENV_PLATFORM, "rocm")
    monkeypatch.setattr(ck, "extension_reason", lambda: None)
    config, _ = _config()
    assert dispatch.plan(config).chosen == "ck"
    big, _ = _config(d=512)
    plan = dispatch.plan(big)
    assert plan.chosen != "ck" and "head dim 512 > 256" in dict(plan.reasons)["ck"]


def test_fp8_reason_says_what_ck_offers_and_why_it_is_not_wrapped(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_PLATFORM, "rocm")
    monkeypatch.setattr(ck, "extension_reason", lambda: None)
    q = jnp.zeros((2, 64, 4, 64), jnp.bfloat16)
    plan = fusedattn.explain(q, q, q, precision="fp8")
    reason = dict(plan.reasons)["ck"]
    assert "host floats" in reason and "no FP8 backward" in reason, reason
    assert plan.chosen == "xla"  # the emulation


# ---- supports() reasons ---------------------------------------------------------
@pytest.mark.parametrize("kw, pattern", [
    (dict(dtype=jnp.float32), r"float16/bfloat16 only, not float32"),
    (dict(d=512), r"head dim 512 > 256.*small-seq or XLA"),
    (dict(d=64, d_v=320), r"head dim 320 > 256"),
    (dict(d=60), r"d_qk=60 is not a multiple of 8"),
    (dict(softmax="off_by_one"), r"no softmax sink"),
    (dict(deterministic=True), r"atomics"),
    (dict(score_mod=lambda s, b, h, i, j: s), r"score_mod"),
])
def test_config_reasons(kw, pattern):
    config, _ = _config(**kw)
    reason = ck.config_reason(config)
    assert reason is not None and re.search(pattern, reason), reason


def test_packed_bias_reason():
    q, k, v = _arrays(b=1, s_q=32, s_kv=32)
    ids = jnp.array([[1] * 16 + [2] * 16])
    seq = SequenceDescriptor.from_segment_ids(ids, max_segments=2)
    config, _ = build_call(q, k, v, sequence=seq, bias=jnp.zeros((1, 4, 32, 32), jnp.bfloat16))
    assert "packed" in ck.config_reason(config)


@pytest.mark.parametrize("kw", [
    dict(), dict(dtype=jnp.float16), dict(d=256), dict(d=128, d_v=64), dict(h_q=8, h_kv=2),
    dict(mask="causal"), dict(mask="causal_bottom_right", s_q=32),
    dict(window=(16, 0), mask="causal"), dict(window=(8, 8)), dict(dropout=0.1, rng=jax.random.key(1)),
])
def test_ck_shaped_configs_have_no_config_reason(kw):
    config, _ = _config(**kw)
    assert ck.config_reason(config) is None


def test_ragged_reason():
    from fusedattn.config import AttnConfig
    config = AttnConfig(batch=4, s_q=1, s_kv=16, h_q=2, h_kv=2, d_qk=128, d_v=128,
                        dtype="bfloat16", sequence="ragged", api="small_seq")
    assert "'ragged'" in ck.config_reason(config)


def test_int32_overflow_reason():
    from fusedattn.config import AttnConfig
    config = AttnConfig(batch=1024, s_q=65536, s_kv=64, h_q=64, h_kv=8, d_qk=128, d_v=128,
                        dtype="bfloat16")
    assert "32-bit indexing" in ck.config_reason(config)


# ---- the CK calls, lowered for ROCm on this CPU machine ---------------------------
def _lower_rocm(config, inputs):
    """StableHLO text of forward + backward for ROCm (nothing runs)."""
    def loss(q, k, v, bias):
        out = ck.attention(config, inputs._replace(q=q, k=k, v=v, bias=bias))
        return out.astype(jnp.float32).sum(), out
    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
    lowered = fn.trace(inputs.q, inputs.k, inputs.v, inputs.bias).lower(
        lowering_platforms=("rocm",))
    out_info = jax.eval_shape(fn, inputs.q, inputs.k, inputs.v, inputs.bias)
    return lowered.as_text(), out_info


def _custom_calls(text):
    return re.findall(r"stablehlo\.custom_call @(\w+)\((.*?)\) \{(.*?)\} : \((.*?)\) -> (.*)", text)


@pytest.mark.parametrize("layout", ["bshd", "sbhd"])
def test_lowering_dense_gqa_causal(layout):
    config, inputs = _config(b=2, s_q=48, s_kv=80, h_q=8, h_kv=2, d=64, layout=layout,
                             mask="causal_bottom_right")
    text, ((_, out), grads) = _lower_rocm(config, inputs)
    calls = {c[0]: c for c in _custom_calls(text)}
    assert set(calls) == {ck.TARGET_FWD, ck.TARGET_BWD}
    fwd_attrs = calls[ck.TARGET_FWD][2]
    assert "mask = 2" in fwd_attrs and f"layout = {0 if layout == 'bshd' else 1}" in fwd_attrs
    assert "window_right = 0" in fwd_attrs and "window_left = -1" in fwd_attrs
    # lse [b, h_q, s_q] in batch mode; dk/dv come back per query head.
    assert "tensor<2x8x48xf32>" in calls[ck.TARGET_FWD][4]
    bwd_results = calls[ck.TARGET_BWD][4]
    k_per_query_head = "2x80x8x64xbf16" if layout == "bshd" else "80x2x8x64xbf16"
    assert f"tensor<{k_per_query_head}>" in bwd_results
    assert out.shape == inputs.q.shape
    assert [g.shape for g in grads[:3]] == [inputs.q.shape, inputs.k.shape, inputs.v.shape]


def test_lowering_padding_bias_dropout():
    q, k, v = _arrays(b=3, s_q=40, s_kv=40, h_q=4, h_kv=4, d=128, dtype=jnp.float16)
    seq = SequenceDescriptor.from_lengths(jnp.array([40, 17, 0]), jnp.array([40, 23, 5]))
    bias = jnp.zeros((1, 4, 40, 40), jnp.float32)
    config, inputs = build_call(q, k, v, sequence=seq, bias=bias, dropout=0.2,
                                rng=jax.random.key(3), window=(4, 4))
    text, (_, grads) = _lower_rocm(config, inputs)
    calls = {c[0]: c for c in _custom_calls(text)}
    fwd = calls[ck.TARGET_FWD]
    assert "sequence = 1" in fwd[2] and "mask = 1" in fwd[2]
    assert "window_left = 4" in fwd[2] and "window_right = 4" in fwd[2]
    assert "bias_batch_stride = 0" in fwd[2] and "bias_row_stride = 40" in fwd[2]
    assert "bias_head_stride = 1600" in fwd[2]
    # operands: q, k, v, bias [1, 4, 40, 40] f16, seq [4, b + 1] i32, dropout words [4] u32
    assert "tensor<1x4x40x40xf16>" in fwd[3] and "tensor<4x4xi32>" in fwd[3]
    assert "tensor<4xui32>" in fwd[3]
    assert grads[3].shape == bias.shape and grads[3].dtype == bias.dtype


def test_lowering_packed_group_mode():
    q, k, v = _arrays(b=2, s_q=32, s_kv=32, h_q=4, h_kv=1, d=96)
    ids = jnp.array([[1] * 10 + [2] * 20 + [0] * 2, [1] * 32])
    seq = SequenceDescriptor.from_segment_ids(ids, max_segments=2)
    config, inputs = build_call(q, k, v, sequence=seq, mask="causal")
    text, (_, grads) = _lower_rocm(config, inputs)
    calls = {c[0]: c for c in _custom_calls(text)}
    fwd = calls[ck.TARGET_FWD]
    assert "sequence = 2" in fwd[2]
    # One row of 64 tokens; seq is [4, G + 1] with G = 2 rows x 2 segments.
    assert "tensor<1x64x4x96xbf16>" in fwd[3] and "tensor<4x5xi32>" in fwd[3]
    assert "tensor<4x64xf32>" in fwd[4]  # lse [h, tokens] in group mode
    assert [g.shape for g in grads[:3]] == [q.shape, k.shape, v.shape]


# ---- the host-side arrays the kernels read, checked by value ---------------------
def test_seq_array_padding_and_packed_values():
    cfg, inputs = build_call(*_arrays(b=3, s_q=8, s_kv=8),
                             sequence=SequenceDescriptor.from_lengths(jnp.array([8, 3, 0]),
                                                                      jnp.array([5, 8, 2])))
    seq = np.asarray(ck._seq_array(cfg, inputs.sequence))
    np.testing.assert_array_equal(seq[0], [0, 8, 11, 11])
    np.testing.assert_array_equal(seq[1], [0, 5, 13, 15])
    ids = jnp.array([[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 1, 1]])
    cfg, inputs = build_call(*_arrays(b=2, s_q=6, s_kv=6),
                             sequence=SequenceDescriptor.from_segment_ids(ids, max_segments=2))
    seq = np.asarray(ck._seq_array(cfg, inputs.sequence))
    np.testing.assert_array_equal(seq[0], [0, 3, 6, 12, 12])   # start tokens, then the total
    np.testing.assert_array_equal(seq[2], [3, 2, 6, 0, 0])     # true lengths (unused: 0)


def test_keep_masks_rows_without_keys():
    # Row 1 has 4 queries and 0 keys; window (0, 0) top-left: query i sees key i only.
    cfg, inputs = build_call(*_arrays(b=2, s_q=6, s_kv=6),
                             sequence=SequenceDescriptor.from_lengths(jnp.array([6, 4]),
                                                                      jnp.array([3, 0])),
                             window=(0, 0))
    q_keep, kv_keep = (np.asarray(x) for x in ck._keep_masks(cfg, inputs.sequence))
    np.testing.assert_array_equal(q_keep, [[1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(kv_keep, [[1, 1, 1, 0, 0, 0], [0] * 6])


def test_keep_masks_bottom_right_causal():
    # s_q=4 > len_kv=2 bottom-right: query i sees keys j <= i - 2, so rows 0 and 1 see none.
    cfg, inputs = build_call(*_arrays(b=1, s_q=4, s_kv=4),
                             sequence=SequenceDescriptor.from_lengths(jnp.array([4]), jnp.array([2])),
                             mask="causal_bottom_right")
    q_keep, _ = ck._keep_masks(cfg, inputs.sequence)
    np.testing.assert_array_equal(np.asarray(q_keep), [[0, 0, 1, 1]])
