"""mask_mods that hide blocks, in query chunks on the keys their rows see
(fusedattn.mask_chunks), on CPU: which chunks a document / prefix-LM mask gives, the
reasons a mask is not chunked, the chunked call (each chunk run by the XLA backend)
equal to the whole call forward and in every gradient, and the cudnn backend lowering
one call per chunk for CUDA without a GPU."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from support import flex_cases as fc
import fusedattn
from fusedattn import dispatch
from fusedattn.backends.cudnn import causal_chunks
from fusedattn.backends.cudnn import mask_chunks
from fusedattn.backends import cudnn, xla
from fusedattn.config import AttnConfig
from fusedattn.score_mods import Masked
from fusedattn.validation import build_call

B, H, D = 2, 4, 16


def _config(mask_mod, s=4096, **change):
    return AttnConfig(**dict(dict(batch=4, s_q=s, s_kv=s, h_q=16, h_kv=16, d_qk=128, d_v=128,
                                  dtype="bfloat16", score_mod=Masked(None, mask_mod)), **change))


def test_a_document_mask_runs_each_document_alone():
    config = _config(lambda b, h, q, k: q // 1024 == k // 1024)
    assert mask_chunks.reason(config) is None
    parts = mask_chunks.chunks(config)
    assert [(c.q_rows, c.kv_rows) for c in parts] == [((i * 1024, (i + 1) * 1024),) * 2
                                                    for i in range(4)]
    assert causal_chunks.tile_fraction(config, parts) == pytest.approx(1 / 4)
    assert "4 query chunks of 1024 rows" in mask_chunks.describe(config, parts)


def test_documents_over_longer_keys_run_one_call_each():
    """(keys past the queries: the [b, s, ...] -> [b*n, c, ...] reshape would not hold)"""
    config = _config(lambda b, h, q, k: q // 1024 == k // 1024, s_kv=8192)
    parts = mask_chunks.chunks(config)
    assert [c.kv_rows for c in parts] == [(i * 1024, (i + 1) * 1024) for i in range(4)]
    assert "4 of them see every pair" in mask_chunks.describe(config, parts)


def test_a_prefix_lm_mask_runs_like_a_causal_one():
    parts = mask_chunks.chunks(_config(lambda b, h, q, k: (k <= q) | (k < 16)))
    assert [c.kv_rows for c in parts] == [(0, 1024), (0, 2048), (0, 3072), (0, 4096)]


@pytest.mark.parametrize("mask_mod, change, fragment", [
    (lambda b, h, q, k: (q // 1024 == k // 1024) | (h > 3), {}, "reads the batch, the head"),
    (lambda b, h, q, k: k >= 0, {}, "no split into chunks"),
    (lambda b, h, q, k: q // 1024 == k // 1024, dict(mask="causal"), "causal chunks apply"),
    (lambda b, h, q, k: q // 1024 == k // 1024, dict(dropout=0.1), "dropout"),
    (lambda b, h, q, k: q // 8 == k // 8, dict(s_q=65536, s_kv=65536), "to scan"),
])
def test_what_is_not_chunked_says_why(mask_mod, change, fragment):
    assert fragment in mask_chunks.reason(_config(mask_mod, **change))


def test_chunking_off_by_setting(monkeypatch):
    monkeypatch.setenv(causal_chunks.ENV_CHUNKS, "1")
    assert "=1" in mask_chunks.reason(_config(lambda b, h, q, k: q // 1024 == k // 1024))


@pytest.mark.parametrize("name", ["document_blocks", "relpos_documents", "prefix_lm",
                                  "window_plus_sink", "softcap_prefix_lm"])
def test_chunks_equal_the_whole_call_forward_and_gradients(name, monkeypatch):
    monkeypatch.setattr(causal_chunks, "MIN_CHUNK_ROWS", 32)
    mod, mask_mod, args, _ = fc.MODS[name]
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, v = (jax.random.normal(key, (B, 128, H, D), jnp.float32) for key in keys[:3])
    config, inputs = build_call(q, k, v, score_mod=mod, mask_mod=mask_mod,
                                score_mod_args=args(H, B, 128))
    assert mask_chunks.reason(config) is None
    parts = mask_chunks.chunks(config)
    chunked = lambda c, i: mask_chunks.attention(c, i, parts, xla.attention_with_lse)  # noqa
    d_out = jax.random.normal(keys[3], q.shape, jnp.float32)

    def loss(fn):
        def f(q, k, v):
            out, lse = fn(config, inputs._replace(q=q, k=k, v=v))
            return jnp.sum(out * d_out) + 0.1 * jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(q, k, v)
    want, got = loss(xla.attention_with_lse), loss(chunked)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-4)


def test_cudnn_lowers_one_call_per_chunk_for_cuda(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_PLATFORM, "cuda")
    monkeypatch.setattr(causal_chunks, "MIN_CHUNK_ROWS", 64)
    q = jnp.ones((B, 256, H, 64), jnp.bfloat16)
    mask_mod = fc.MODS["document_blocks"][1]

    def loss(q, k, v):
        out = fusedattn.fused_attn(q, k, v, mask_mod=mask_mod, backend="cudnn")
        return jnp.sum(out.astype(jnp.float32))
    with cudnn.assume_supported(workspace_bytes=4096):
        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, q, q).lower(
            lowering_platforms=("cuda",)).as_text()
        plan = str(fusedattn.explain(q, q, q, mask_mod=mask_mod, backend="cudnn"))
    # Documents of one length: one plain call with them as its batch.
    assert text.count("fusedattn_cudnn_fwd") == 1 and text.count("fusedattn_cudnn_bwd") == 1
    assert "tensor<8x64x4x64xbf16>" in text
    assert ("mask_mod in 4 query chunks of 64 rows on the keys their rows see: 25% of the "
            "tiles; one call of the equal diagonal blocks as a batch") in plan


def test_documents_with_a_score_mod_run_it_without_the_mask(monkeypatch):
    monkeypatch.setattr(causal_chunks, "MIN_CHUNK_ROWS", 64)
    mod, mask_mod, _, _ = fc.MODS["relpos_documents"]
    config = _config(mask_mod, s=256, score_mod=Masked(mod, mask_mod))
    parts = mask_chunks.chunks(config)
    assert [c.kv_rows for c in parts] == [(0, 64), (64, 128), (128, 192), (192, 256)]
    assert all(not isinstance(c.config.score_mod, Masked) for c in parts)
    assert "4 of them see every pair" in mask_chunks.describe(config, parts)
