"""The cuDNN backend's CPU-side logic: reasons, graph keys, THD offsets, and
lowering for the CUDA platform on a host without a GPU (the custom calls are
emitted; nothing needs the device or the native extension)."""
from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fusedattn
from fusedattn import dispatch, score_mods
from fusedattn.backends import cudnn
from fusedattn.backends.cudnn import flex
from fusedattn.inputs import AttnInputs
from fusedattn.config import AttnConfig
from fusedattn.sequence import SequenceDescriptor

BASE = AttnConfig(batch=2, s_q=128, s_kv=128, h_q=4, h_kv=2, d_qk=64, d_v=64, dtype="bfloat16",
                  scale=0.125)


def test_graph_key_carries_every_static_setting():
    cfg = dataclasses.replace(BASE, mask="causal_bottom_right", window=(16, 0),
                              bias_shape=(1, 4, 128, 128), softmax="learnable", dropout=0.1,
                              deterministic=True, d_v=32, layout="sbhd", qkv_packing="kv")
    fields = dict(item.split("=") for item in cudnn.graph_key(cfg).split(";"))
    assert fields["b"] == "2" and fields["hq"] == "4" and fields["hkv"] == "2"
    assert fields["dqk"] == "64" and fields["dv"] == "32" and fields["bf16"] == "1"
    assert (fields["layout"], fields["packing"], fields["mask"]) == ("1", "2", "2")
    assert (fields["wl"], fields["wr"]) == ("16", "0")
    assert [fields[f"bias_{n}"] for n in ("b", "h", "sq", "skv")] == ["1", "4", "128", "128"]
    assert float(fields["scale"]) == 0.125 and float(fields["dropout"]) == 0.1
    assert (fields["softmax"], fields["det"], fields["seq"]) == ("2", "1", "0")


def test_graph_key_carries_the_builtin_score_mods_as_programs():
    def fields(cfg):
        return dict(item.split("=") for item in cudnn.graph_key(cfg).split(";"))
    assert fields(BASE)["flex"] == ""
    alibi = fields(dataclasses.replace(BASE, mask="causal", score_mod=score_mods.alibi(4)))
    assert (alibi["flex"], alibi["alibi"]) == ("mul:a0,k|add:s,v0|ge:q,k|sel:v2,v1,c-inf", "0")
    # padding lengths: no program (cuDNN 9.19 misreads per-batch inputs), cuDNN's ALiBi
    padded = fields(dataclasses.replace(BASE, mask="causal", sequence="padding",
                                        score_mod=score_mods.alibi(4)))
    assert (padded["flex"], padded["alibi"]) == ("", "1"), padded
    capped = fields(dataclasses.replace(BASE, score_mod=score_mods.softcap(30.25)))
    assert capped["flex"] == "div:s,c30.25|tanh:v0|mul:c30.25,v1", capped
    # equal score_mods give equal keys (one graph cache entry), different ones do not
    assert cudnn.graph_key(dataclasses.replace(BASE, score_mod=score_mods.softcap(30))) == \
        cudnn.graph_key(dataclasses.replace(BASE, score_mod=score_mods.softcap(30.0)))
    assert cudnn.graph_key(dataclasses.replace(BASE, score_mod=score_mods.softcap(30.0))) != \
        cudnn.graph_key(dataclasses.replace(BASE, score_mod=score_mods.softcap(30.5)))


def test_graph_keys_differ_for_different_configs():
    variants = [BASE, dataclasses.replace(BASE, mask="causal"),
                dataclasses.replace(BASE, scale=0.1250001), dataclasses.replace(BASE, dtype="float16"),
                dataclasses.replace(BASE, sequence="packed", max_segments=3),
                dataclasses.replace(BASE, window=(8, 8))]
    keys = {cudnn.graph_key(c) for c in variants}
    assert len(keys) == len(variants)


def test_causal_mask_without_window_sets_only_the_right_bound():
    fields = dict(i.split("=") for i in cudnn.graph_key(dataclasses.replace(BASE, mask="causal"))
                  .split(";"))
    assert (fields["wl"], fields["wr"]) == ("-1", "0")


@pytest.mark.parametrize("change", [dict(mask="causal_bottom_right"), dict()])
def test_alibi_cudnn_cannot_take_runs_as_a_program_per_entry(change):
    """Padded ALiBi in a form cuDNN's own ALiBi refuses (bottom-right, no causal mask):
    the lowered program runs, one batch entry at a time (it reads the lengths)."""
    config = dataclasses.replace(BASE, score_mod=ALIBI, sequence="padding", **change)
    assert flex.alibi_reason(config) is not None
    assert cudnn.config_reason(config) is None and flex.per_entry(config)


@pytest.mark.parametrize("change, fragment", [
    (dict(dtype="float32"), "dtype float32"),
    (dict(score_mod=lambda s, b, h, i, j: s.sum(axis=-1, keepdims=True) + s), "reduce_sum"),
    (dict(sequence="ragged"), "small_seq"),
    (dict(sequence="packed", max_segments=2, layout="sbhd"), "bshd layout"),
    (dict(sequence="packed", max_segments=2, bias_shape=(1, 4, 128, 128)), "bias with packed"),
    (dict(sequence="packed", max_segments=2, batch=4096, s_q=4096, s_kv=4096, h_q=64, h_kv=64,
          d_qk=128, d_v=128), "2^31"),
])
def test_config_reasons(change, fragment):
    reason = cudnn.config_reason(dataclasses.replace(BASE, **change))
    assert reason is not None and fragment in reason


def test_supported_shapes_have_no_python_side_reason():
    for change in ({}, dict(mask="causal"), dict(sequence="padding"),
                   dict(sequence="packed", max_segments=4), dict(bias_shape=(2, 4, 128, 128)),
                   dict(softmax="off_by_one"), dict(dropout=0.2), dict(d_qk=256, d_v=256)):
        assert cudnn.config_reason(dataclasses.replace(BASE, **change)) is None, change


ALIBI = score_mods.alibi(4)
SOFTCAP = score_mods.softcap(20.0)


@pytest.mark.parametrize("change, fragment", [
    (dict(score_mod=SOFTCAP, sequence="packed", max_segments=2), "packed (THD) sequences"),
    (dict(score_mod=score_mods.alibi(8), mask="causal", bias_shape=(1, 4, 128, 128)),
     "num_heads must equal h_q"),
    (dict(score_mod=SOFTCAP, bias_shape=(1, 4, 128, 128)), "before the bias"),
    (dict(score_mod=lambda s, b, h, i, j: s + jnp.cumsum(s, axis=-1)), "cannot be lowered"),
    (dict(score_mod=lambda s, b, h, i, j: s + i, bias_shape=(1, 4, 128, 128)), "before the bias"),
])
def test_score_mod_reasons(change, fragment):
    reason = cudnn.config_reason(dataclasses.replace(BASE, **change))
    assert reason is not None and fragment in reason, reason


def test_builtin_score_mods_have_no_python_side_reason():
    """Lowered like any score_mod, the built-ins take what their dedicated cuDNN forms
    refused (ALiBi without a mask, bottom-right, with windows; softcap with masks and
    windows); ALiBi keeps cuDNN's own form with padding, packed sequences and bias."""
    for change in (dict(mask="causal"), dict(mask="causal", sequence="padding"),
                   dict(mask="causal", sequence="packed", max_segments=3),
                   dict(mask="causal", bias_shape=(2, 4, 128, 128)),
                   dict(), dict(mask="causal_bottom_right"), dict(window=(32, 4)),
                   dict(mask="causal", h_q=8, h_kv=2, score_mod=score_mods.alibi(8)),
                   dict(mask="causal", window=(32, 0), dropout=0.1, softmax="learnable")):
        cfg = dataclasses.replace(BASE, **{"score_mod": ALIBI, **change})
        assert cudnn.config_reason(cfg) is None, change
    for change in ({}, dict(softmax="learnable"), dict(dropout=0.1), dict(h_q=8, h_kv=1),
                   dict(mask="causal"), dict(window=(16, 16)),
                   dict(s_q=64, dtype="float16", d_qk=128, d_v=128)):
        assert cudnn.config_reason(dataclasses.replace(BASE, score_mod=SOFTCAP, **change)) is None


def test_graphs_that_copy_from_host_go_through_the_targets_xla_does_not_capture(monkeypatch):
    alibi = dataclasses.replace(BASE, mask="causal", sequence="padding", score_mod=ALIBI)
    assumed = cudnn.Probe(True, "assumed", (0, 0, 0))
    assert cudnn.kernels.host_copies(alibi, assumed) == (True, True, True)  # from the config alone
    lowered = dataclasses.replace(alibi, sequence="dense")  # a program: no copies
    assert cudnn.kernels.host_copies(lowered, assumed) == (False, False, False)
    told = cudnn.Probe(True, "", (0, 0, 0), host_copies=(False, False, True))
    assert cudnn.kernels.host_copies(BASE, told) == (False, False, True)  # and from the probe
    monkeypatch.setattr(cudnn.kernels, "probe", lambda config: told)
    monkeypatch.setattr(cudnn.kernels, "supports", lambda config: None)
    monkeypatch.setattr(cudnn.kernels, "register_targets", lambda: None)
    static = cudnn.kernels.static_call(BASE)
    assert static.targets == (cudnn.TARGET_FWD, cudnn.TARGET_FWD, cudnn.TARGET_BWD_NOCMDBUF)


def test_version_gates_are_applied_from_the_table():
    learnable = dataclasses.replace(BASE, softmax="learnable")
    assert "cuDNN >= 9.13" in cudnn.version_reason(learnable, 91200)
    assert cudnn.version_reason(learnable, 91901) is None
    assert cudnn.version_reason(BASE, 90000) is None  # no gate applies to vanilla softmax


def test_unavailable_on_cpu_with_a_reason():
    plan = dispatch.plan(BASE, platform="cpu")
    reasons = dict(plan.reasons)
    assert plan.chosen == "xla"
    assert reasons["cudnn"] is not None


def test_without_extension_supports_gives_the_load_reason(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_PLATFORM, "cuda")
    reason = cudnn.BACKEND.supports(BASE)
    if reason is None:
        pytest.skip("the CUDA extension is loaded and answered; covered by GPU tests")
    assert "fusedattn._cuda" in reason or "GPU" in reason


def test_thd_offsets_address_segment_starts():
    """Ragged offsets = (row * s + segment offset) * elements per token, per tensor."""
    cfg = dataclasses.replace(BASE, batch=2, s_q=8, s_kv=8, h_q=2, h_kv=1, d_qk=8, d_v=4,
                              sequence="packed", max_segments=3, qkv_packing="separate")
    seq = SequenceDescriptor.from_segment_ids(
        np.array([[1, 1, 1, 2, 2, 0, 0, 0], [1, 2, 2, 2, 2, 2, 3, 3]]), max_segments=3)
    q_len, kv_len, rq, rk, rv, ro, rstats = (np.asarray(a) for a in cudnn.kernels.packed_arrays(cfg, seq))
    np.testing.assert_array_equal(q_len, [3, 2, 0, 1, 5, 2])
    starts = np.array([0, 3, 3, 8, 9, 14, 16])  # token index of each segment, then the total
    np.testing.assert_array_equal(rq, starts * 2 * 8)
    np.testing.assert_array_equal(rk, starts * 1 * 8)
    np.testing.assert_array_equal(rv, starts * 1 * 4)
    np.testing.assert_array_equal(ro, starts * 2 * 4)
    # statistics are token-major [b * s, h]
    np.testing.assert_array_equal(rstats, starts * 2)
    assert all(np.all(np.diff(a) >= 0) for a in (rq, rk, rv, ro, rstats))


def _lower_for_cuda(fn, *args):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.fixture
def cuda_lowering(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_PLATFORM, "cuda")
    with cudnn.assume_supported(workspace_bytes=4096):
        yield


@pytest.mark.parametrize("options", [
    dict(),
    dict(mask="causal", softmax="learnable", softmax_offset=jnp.zeros((4,), jnp.float32)),
    dict(bias=jnp.zeros((1, 4, 64, 64), jnp.bfloat16), dropout=0.1, rng=jax.random.PRNGKey(0)),
    dict(sequence=SequenceDescriptor.from_lengths(jnp.array([64, 7]))),
    dict(sequence=SequenceDescriptor.from_segment_ids(
        jnp.concatenate([jnp.ones((2, 40), jnp.int32), 2 * jnp.ones((2, 24), jnp.int32)], 1),
        max_segments=2)),
])
def test_forward_and_backward_lower_for_cuda_without_a_gpu(cuda_lowering, options):
    q = jnp.ones((2, 64, 4, 64), jnp.bfloat16)
    k = v = jnp.ones((2, 64, 2, 64), jnp.bfloat16)

    def loss(q, k, v):
        out = fusedattn.fused_attn(q, k, v, backend="cudnn", **options)
        return jnp.sum(out.astype(jnp.float32))

    fwd = _lower_for_cuda(lambda q, k, v: fusedattn.fused_attn(q, k, v, backend="cudnn",
                                                                **options), q, k, v)
    assert "fusedattn_cudnn_fwd" in fwd and "fusedattn_cudnn_bwd" not in fwd
    both = _lower_for_cuda(jax.grad(loss, argnums=(0, 1, 2)), q, k, v)
    assert "fusedattn_cudnn_fwd" in both and "fusedattn_cudnn_bwd" in both
    # the workspace is an extra result of the size the probe reported
    assert re.search(r"tensor<4096xui8>", both)


@pytest.mark.parametrize("score_mod, mask", [
    (score_mods.alibi(4), "causal"),
    (score_mods.softcap(20.0), "none"),
])
def test_builtin_score_mods_lower_for_cuda(cuda_lowering, score_mod, mask):
    """The built-ins lower to lowered programs on the command-buffer targets."""
    q = jnp.ones((2, 64, 4, 64), jnp.bfloat16)
    k = v = jnp.ones((2, 64, 2, 64), jnp.bfloat16)

    def loss(q, k, v):
        out = fusedattn.fused_attn(q, k, v, mask=mask, score_mod=score_mod, backend="cudnn")
        return jnp.sum(out.astype(jnp.float32))

    text = _lower_for_cuda(jax.grad(loss, argnums=(0, 1, 2)), q, k, v)
    targets = set(re.findall(r"custom_call @(fusedattn_cudnn_[a-z_]+)", text))
    assert targets == {"fusedattn_cudnn_fwd", "fusedattn_cudnn_bwd"}, targets
    assert re.search(r"flex=[^;]*tanh" if mask == "none" else r"flex=mul:a0,k", text)


def test_packed_qkv_goes_in_as_one_buffer(cuda_lowering):
    """bs3hd: q, k, v reach cuDNN as the packed tensor (strides), with no slicing copies,
    and the gradient comes back packed the same way."""
    qkv = jnp.ones((2, 64, 3, 4, 64), jnp.float16)

    def loss(qkv):
        return jnp.sum(fusedattn.fused_attn(qkv, None, None, layout="bs3hd",
                                            backend="cudnn").astype(jnp.float32))

    text = _lower_for_cuda(jax.grad(loss), qkv)
    assert "fusedattn_cudnn_bwd" in text
    assert "stablehlo.slice" not in text and "stablehlo.concatenate" not in text


def test_attention_with_lse_shapes_under_eval_shape(cuda_lowering):
    q = jax.ShapeDtypeStruct((1, 32, 4, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 48, 2, 64), jnp.bfloat16)
    cfg = dataclasses.replace(BASE, batch=1, s_q=32, s_kv=48)
    out, lse = jax.eval_shape(
        lambda q, k, v: cudnn.attention_with_lse(cfg, AttnInputs(q, k, v)), q, kv, kv)
    assert out.shape == (1, 32, 4, 64) and out.dtype == jnp.bfloat16
    assert lse.shape == (1, 4, 32) and lse.dtype == jnp.float32


def test_stored_plans_name_the_graph_form(monkeypatch, tmp_path):
    """A plan stored for a key is only loaded for the graph form that made it."""
    from fusedattn import plan_cache
    from fusedattn.backends.cudnn import graphs as cudnn_probe

    class Module:
        cudnn_device_identity = staticmethod(lambda: {"name": "gpu", "sm": 90,
                                                      "multiprocessors": 132})
        cudnn_versions = staticmethod(lambda: {"cudnn_runtime": 91900,
                                               "cudnn_frontend": 13200})
    monkeypatch.setattr(plan_cache, "directory", lambda: str(tmp_path))
    now = cudnn_probe._plan_identities(Module, "k")
    monkeypatch.setattr(cudnn_probe, "GRAPH_FORM", cudnn_probe.GRAPH_FORM + 1)
    later = cudnn_probe._plan_identities(Module, "k")
    assert all(now[g]["graph_form"] != later[g]["graph_form"] for g in cudnn.GRAPHS)
