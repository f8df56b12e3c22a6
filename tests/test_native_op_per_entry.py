"""`native_op`'s per-entry loop (a backend whose kernels cannot read values that vary
over the batch runs one batch entry at a time): the XLA kernels registered under
another name with ``per_entry`` on must give what the XLA backend gives for the whole
batch, forward, LSE and every gradient, for score_mods that read the batch number,
per-batch arguments and padding lengths, in both layouts, with GQA and a learnable sink.
The cudnn backend's use of it (which configs, which graph) is checked below too."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fusedattn
from fusedattn.backends import cudnn, native_op
from fusedattn.backends.cudnn import flex
from fusedattn.backends.cudnn.lowering import lower as flex_lowering
from fusedattn.backends import xla
from fusedattn.validation import build_call

native_op.register("xla_per_entry", native_op.Kernels(xla.forward, xla.backward,
                                                      per_entry=lambda config: True))
B, S, H, D = 3, 16, 4, 8


def per_batch_scale(s, b, h, q, k, w):
    return s * w[b] + 0.1 * (k - q)


def batch_number(s, b, h, q, k):
    return s + 0.5 * b * jnp.cos(q * 0.3 + h)


CASES = {
    "per_batch_arg": dict(score_mod=per_batch_scale,
                          score_mod_args=(jnp.asarray([0.5, 1.0, 2.0]),)),
    "batch_number_causal_gqa": dict(score_mod=batch_number, mask="causal", h_kv=2),
    "padding_sbhd": dict(score_mod=batch_number, layout="sbhd",
                         sequence=fusedattn.SequenceDescriptor.from_lengths(
                             jnp.array([16, 7, 3]), jnp.array([5, 16, 9]))),
    "learnable_sink": dict(score_mod=batch_number, softmax="learnable",
                           softmax_offset=jnp.linspace(-1.0, 1.0, H)),
}


def _arrays(case):
    h_kv = case.pop("h_kv", H)
    rng = np.random.default_rng(0)
    shape = (lambda h: (S, B, h, D)) if case.get("layout") == "sbhd" else (lambda h: (B, S, h, D))
    q, k, v, d_out = (jnp.asarray(rng.standard_normal(shape(h)), jnp.float32)
                      for h in (H, h_kv, h_kv, H))
    return q, k, v, d_out, case


@pytest.mark.parametrize("name", sorted(CASES))
def test_per_entry_loop_gives_the_whole_batch_result(name):
    q, k, v, d_out, options = _arrays(dict(CASES[name]))
    config, inputs = build_call(q, k, v, **options)

    def run(backend):
        def f(q, k, v, offset):
            i = inputs._replace(q=q, k=k, v=v, softmax_offset=offset)
            return native_op.attention(backend, config, i, need_lse=True)
        (out, lse), vjp = jax.vjp(f, q, k, v, inputs.softmax_offset)
        return (out, lse) + tuple(g for g in vjp((d_out, jnp.zeros_like(lse))) if g is not None)
    got, want = jax.jit(lambda: (run("xla_per_entry"), run("xla")))()
    assert len(got) == len(want) >= 5
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5)


def test_cudnn_runs_values_varying_over_the_batch_per_entry():
    """cuDNN misreads per-batch score_mod tensors: such a call runs per entry, each
    entry's graph (batch 1) reading its own row of the per-batch inputs; the entry's
    inputs, evaluated with its batch number, are that row of the whole call's."""
    q = jax.ShapeDtypeStruct((B, S, H, D), jnp.bfloat16)
    w = jnp.asarray([0.5, 1.0, 2.0])
    config, _ = build_call(q, q, q, score_mod=per_batch_scale, score_mod_args=(w,))
    assert cudnn.config_reason(config) is None and flex.per_entry(config)
    entry = native_op.entry_config(config)
    assert entry.batch == 1 and not flex.per_entry(entry)
    whole, one = flex.lowered(config), flex.lowered(entry)
    assert any(shape[0] == B for shape in whole.input_shapes)
    assert all(shape[0] == 1 for shape in one.input_shapes)
    assert "b=1;" in cudnn.graph_key(entry)
    rows = whole.evaluate((w,), ())
    for b in range(B):
        got = one.evaluate((w, jnp.int32(b), jnp.int32(0)), ())
        for g, r in zip(got, rows):
            row = b if r.shape[0] > 1 else 0
            np.testing.assert_array_equal(np.asarray(g), np.asarray(r)[row:row + 1])
    per_head, _ = build_call(q, q, q, score_mod=lambda s, b, h, i, j, w: s * w[h],
                             score_mod_args=(jnp.ones(H),))
    assert not flex.per_entry(per_head)


def test_per_entry_call_lowers_for_cuda_without_a_gpu(monkeypatch):
    """The whole call becomes a loop around graphs of batch 1."""
    from fusedattn import dispatch
    monkeypatch.setenv(dispatch.ENV_PLATFORM, "cuda")
    dispatch.clear_cache()
    q = jnp.zeros((B, 128, H, 64), jnp.bfloat16)
    w = jnp.asarray([0.5, 1.0, 2.0])

    def loss(q, k, v):
        return fusedattn.fused_attn(q, k, v, mask="causal", score_mod=per_batch_scale,
                                    score_mod_args=(w,)).astype(jnp.float32).sum()
    try:
        with cudnn.assume_supported(workspace_bytes=4096):
            plan = fusedattn.explain(q, q, q, mask="causal", score_mod=per_batch_scale,
                                     score_mod_args=(w,))
            text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, q, q).lower(
                lowering_platforms=("cuda",)).as_text()
    finally:
        dispatch.clear_cache()
    assert plan.chosen == "cudnn", str(plan)
    assert "one graph of batch 1 runs each batch entry" in str(plan)
    assert "fusedattn_cudnn_fwd" in text and "fusedattn_cudnn_bwd" in text
    assert "b=1;" in text and f"b={B};" not in text
    assert "while" in text
