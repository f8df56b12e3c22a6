"""Causal score_mods in query chunks (fusedattn.causal_chunks), on CPU: the chunked
call, each chunk run by the XLA backend, equals the whole call (forward, LSE and every
gradient, score_mod_args included) for causal of both alignments, windows, GQA, sbhd,
mask_mods and score_mod_args; the chunks' lowered programs match their JAX functions;
the cudnn backend lowers one call per chunk for CUDA without a GPU."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from support import flex_cases as fc
import fusedattn
from fusedattn import dispatch
from fusedattn.backends.cudnn import causal_chunks
from fusedattn.backends.cudnn.lowering import lower as flex_lowering
from fusedattn.backends import cudnn, xla
from fusedattn.validation import build_call

B, H, D = 2, 4, 16

CASES = {  # name -> (score_mod case, options, s_q, s_kv)
    "relative_position causal": ("relative_position", dict(mask="causal"), 64, 64),
    "alibi bottom-right": ("alibi_lambda", dict(mask="causal_bottom_right"), 48, 80),
    "alibi top-left, longer kv": ("alibi_lambda", dict(mask="causal"), 48, 80),
    "per-head scale (gradient)": ("per_head_scale", dict(mask="causal"), 64, 64),
    "window": ("log_distance", dict(mask="causal", window=(10, 0)), 64, 64),
    "window bottom-right": ("relative_position", dict(mask="causal_bottom_right",
                                                     window=(20, 0)), 32, 72),
    "gqa": ("sigmoid_gate", dict(mask="causal", h_kv=2), 64, 64),
    "sbhd": ("quadratic_distance", dict(mask="causal", layout="sbhd"), 64, 64),
    "mask_mod": ("prefix_lm", dict(mask="causal"), 64, 64),
    "score_mod + mask_mod": ("softcap_prefix_lm", dict(mask="causal"), 64, 64),
}


def _call(name, n=4, seed=0):
    case, options, s_q, s_kv = CASES[name]
    options = dict(options)
    h_kv = options.pop("h_kv", H)
    mod, mask_mod, args, _ = fc.MODS[case]
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    sbhd = options.get("layout") == "sbhd"
    shape = lambda s, h: (s, B, h, D) if sbhd else (B, s, h, D)  # noqa: E731
    q = jax.random.normal(keys[0], shape(s_q, H), jnp.float32)
    k = jax.random.normal(keys[1], shape(s_kv, h_kv), jnp.float32)
    v = jax.random.normal(keys[2], shape(s_kv, h_kv), jnp.float32)
    config, inputs = build_call(q, k, v, score_mod=mod, mask_mod=mask_mod,
                                score_mod_args=args(H, B, s_q), **options)
    assert causal_chunks.reason(config, n) is None
    return config, inputs, causal_chunks.chunks(config, n)


def _chunked(config, inputs, parts):
    return causal_chunks.attention(config, inputs, parts, xla.attention_with_lse)


@pytest.mark.parametrize("name", sorted(CASES))
def test_chunks_equal_the_whole_call_forward_and_gradients(name):
    config, inputs, parts = _call(name)
    whole = jax.jit(lambda i: xla.attention_with_lse(config, i))(inputs)
    got = jax.jit(lambda i: _chunked(config, i, parts))(inputs)
    for g, w in zip(got, whole):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)

    d_out = jax.random.normal(jax.random.PRNGKey(7), whole[0].shape, jnp.float32)

    def loss(fn):
        def f(q, k, v, args):
            out, lse = fn(config, inputs._replace(q=q, k=k, v=v, score_mod_args=args))
            finite = jnp.where(jnp.isfinite(lse), lse, 0.0)
            return jnp.sum(out * d_out) + 0.1 * jnp.sum(finite)
        return jax.jit(jax.grad(f, argnums=(0, 1, 2, 3)))(inputs.q, inputs.k, inputs.v,
                                                           inputs.score_mod_args)
    want = loss(xla.attention_with_lse)
    got = loss(lambda c, i: _chunked(c, i, parts))
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-4)


def test_chunks_skip_the_hidden_tiles():
    config, _, parts = _call("relative_position causal", n=4)
    assert [(c.q_rows, c.kv_rows) for c in parts] == [
        ((0, 16), (0, 16)), ((16, 32), (0, 32)), ((32, 48), (0, 48)), ((48, 64), (0, 64))]
    assert causal_chunks.tile_fraction(config, parts) == pytest.approx(5 / 8)
    config, _, parts = _call("window", n=4)  # a window also trims each chunk's first keys
    assert [c.kv_rows for c in parts] == [(0, 16), (6, 32), (22, 48), (38, 64)]


@pytest.mark.parametrize("change, fragment", [
    (dict(mask="none"), "no causal mask"),
    (dict(dropout=0.1), "dropout"),
    (dict(s_q=63), "not a multiple"),
    (dict(s_kv=32), "s_kv < s_q"),
    (dict(sequence="padding"), "padding sequences"),
    (dict(softmax="learnable"), "softmax"),
])
def test_what_is_not_chunked_says_why(change, fragment):
    config, _, _ = _call("relative_position causal")
    assert fragment in causal_chunks.reason(dataclasses.replace(config, **change), 4)
    assert "not chunked" in causal_chunks.reason(config, 1)


def test_chunk_count_setting(monkeypatch):
    config, _, _ = _call("relative_position causal")
    monkeypatch.delenv(causal_chunks.ENV_CHUNKS, raising=False)
    # one call by default: cuDNN skips the tiles of the program's causal select itself
    assert causal_chunks.count(dataclasses.replace(config, s_q=16384, s_kv=16384)) == 1
    monkeypatch.setenv(causal_chunks.ENV_CHUNKS, "4")
    assert causal_chunks.count(config) == 4
    monkeypatch.setenv(causal_chunks.ENV_CHUNKS, "zero")
    with pytest.raises(ValueError, match="FUSEDATTN_FLEX_CAUSAL_CHUNKS must be an int >= 1"):
        causal_chunks.count(config)


@pytest.mark.parametrize("name", ["alibi bottom-right", "window", "score_mod + mask_mod"])
def test_each_chunks_lowered_program_matches_its_function(name):
    config, inputs, parts = _call(name)
    programs = set()
    for ch in parts:
        c = ch.config
        low = flex_lowering.lower(c, c.score_mod)
        programs.add(low.forward)
        static = [np.asarray(x) for x in low.evaluate(inputs.score_mod_args, ())]
        rng = np.random.default_rng(0)
        score = rng.standard_normal((B, H, c.s_q, c.s_kv)).astype(np.float32)
        q_idx = np.arange(c.s_q).reshape(1, 1, -1, 1)
        kv_idx = np.arange(c.s_kv).reshape(1, 1, 1, -1)
        f = flex_lowering.masked_score_mod(c, c.score_mod, None)
        batch, head = jnp.arange(B).reshape(B, 1, 1, 1), jnp.arange(H).reshape(1, H, 1, 1)
        want = np.asarray(f(jnp.asarray(score), batch, head, jnp.asarray(q_idx),
                            jnp.asarray(kv_idx), *inputs.score_mod_args), np.float64)
        got = fc.program_scores(low, score, q_idx, kv_idx, static, inputs.score_mod_args)
        finite = np.isfinite(want)
        np.testing.assert_array_equal(np.isfinite(got), finite)
        np.testing.assert_allclose(got[finite], want[finite], rtol=1e-5, atol=1e-5)
    assert len(programs) == len(parts)  # every chunk's shift is its own graph


def test_cudnn_lowers_one_call_per_chunk_for_cuda(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_PLATFORM, "cuda")
    monkeypatch.setenv(causal_chunks.ENV_CHUNKS, "4")
    q = jnp.ones((B, 256, H, 64), jnp.bfloat16)
    mod = fc.MODS["relative_position"][0]

    def loss(q, k, v):
        out = fusedattn.fused_attn(q, k, v, mask="causal", score_mod=mod, backend="cudnn")
        return jnp.sum(out.astype(jnp.float32))
    with cudnn.assume_supported(workspace_bytes=4096):
        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, q, q).lower(
            lowering_platforms=("cuda",)).as_text()
        plan = str(fusedattn.explain(q, q, q, mask="causal", score_mod=mod, backend="cudnn"))
    assert text.count("fusedattn_cudnn_fwd") == 4 and text.count("fusedattn_cudnn_bwd") == 4
    assert "4 query chunks of 64 rows: 62% of the tiles" in plan


def test_chunks_under_a_batch_and_head_split():
    """Chunk calls through the partitioning rule (around the XLA kernels): each shard's
    chunk sees the call's heads and its chunk's positions at once."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from fusedattn.backends import native_op as native_call
    config, inputs, parts = _call("alibi bottom-right")
    mesh = jax.make_mesh((2, 2), ("dp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    shard = NamedSharding(mesh, P("dp", None, "tp"))
    run = lambda c, i: native_call.attention("xla", c, i, need_lse=True)  # noqa: E731
    split = jax.jit(lambda i: causal_chunks.attention(config, i, parts, run))(
        inputs._replace(q=jax.device_put(inputs.q, shard), k=jax.device_put(inputs.k, shard),
                        v=jax.device_put(inputs.v, shard)))
    whole = jax.jit(lambda i: xla.attention_with_lse(config, i))(inputs)
    for g, w in zip(split, whole):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
