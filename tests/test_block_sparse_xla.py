"""block_sparse_xla: the block-sparse list walks in XLA where the Mosaic GPU kernels cannot
run a mask (here a head dim of 256 or 96, float32, a GPU that is not a Hopper) and
no vendor kernel can either (a mask_mod reading an id array; cuDNN has no gather).

On CPU the platform is patched to CUDA (cudnn and flash are then unusable: no
extension). Forward and every gradient against the float64 oracle, with GQA,
padding lengths and jax.nn's rule for rows that see no key; dispatch's route and
explain(); a float32 window; the walks in runs by list length; and no S^2 array in the
compiled step (the XLA backend's, at this size one tile, holds one)."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fusedattn
from fusedattn import dispatch
from fusedattn.backends import block_sparse as backend
from fusedattn.backends.xla import tiles
from support.block_sparse_cases import doc_ids, jax_nn_oracle, rel_error

B, S, H, H_KV = 2, 384, 4, 2
TOL = {"bfloat16": (2e-2, 4e-2), "float32": (2e-3, 4e-3)}   # (out, gradients) vs float64


@pytest.fixture
def gpu(monkeypatch):
    """A CUDA platform whose GPU is a Hopper: the Mosaic kernels would run if they could."""
    monkeypatch.setenv(dispatch.ENV_PLATFORM, "cuda")
    monkeypatch.setattr(backend, "on_hopper", lambda: True)
    dispatch.clear_cache()
    yield
    dispatch.clear_cache()


def same_doc(b, h, i, j, doc):
    return doc[b, i] == doc[b, j]


def _inputs(d, dtype, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    shapes = ((B, S, H, d), (B, S, H_KV, d), (B, S, H_KV, d), (B, S, H, d))
    return [jax.random.normal(k, shape, dtype) for k, shape in zip(keys, shapes)]


def _docs():
    return jnp.asarray(doc_ids(B, S, [40, 130, 96]))


def _check(got, want, dtype):
    tol_out, tol_grad = TOL[dtype]
    for name, g, w, tol in zip(("out", "dq", "dk", "dv"), got, want,
                               (tol_out, tol_grad, tol_grad, tol_grad)):
        assert g.shape == w.shape, name
        assert rel_error(np.asarray(g, np.float32), w) < tol, name


@pytest.mark.parametrize("d, dtype, why", [
    (256, "bfloat16", "head dims 256/256"),
    (96, "bfloat16", "head dims 96/96"),
    (64, "float32", "dtype float32"),
])
def test_documents_the_kernels_cannot_run(gpu, d, dtype, why):
    q, k, v, do = _inputs(d, jnp.dtype(dtype))
    doc = _docs()
    plan = fusedattn.explain(q, k, v, mask="causal", mask_mod=same_doc, score_mod_args=(doc,))
    reasons = dict(plan.reasons)
    assert plan.chosen == "block_sparse_xla", str(plan)
    assert why in reasons["block_sparse"] and reasons["xla"] is None
    assert "built on the device in every call from the mask_mod" in str(plan)

    def loss_fn(q, k, v, doc):
        return fusedattn.fused_attn(q, k, v, mask="causal", mask_mod=same_doc,
                                    score_mod_args=(doc,))
    out, vjp = jax.vjp(jax.jit(loss_fn), q, k, v, doc)
    got = (out, *vjp(do)[:3])
    visible = np.asarray(doc[:, None, :, None] == doc[:, None, None, :])
    _check(got, jax_nn_oracle(q, k, v, do, visible, causal=True)[:4], dtype)


def test_padding_and_rows_that_see_no_key_through_the_drop_in(gpu):
    """jax.nn's rule at d 256: a row that sees no key averages all values, in the
    forward and in dv; padded query rows are exactly zero through fused_attn."""
    q, k, v, do = _inputs(256, jnp.bfloat16, seed=1)
    mask = np.asarray(_docs()[:, None, :, None] == _docs()[:, None, None, :]).copy()
    mask[:, :, 7] = False
    mask[1, :, 300:] = False
    plan = fusedattn.jax_nn.explain(q, k, v, mask=mask)
    assert plan.chosen == "block_sparse_xla" and plan.config.unseen_rows == "mean", str(plan)
    call = jax.jit(lambda q, k, v, m: fusedattn.dot_product_attention(q, k, v, mask=m))
    out, vjp = jax.vjp(lambda q, k, v: call(q, k, v, jnp.asarray(mask)), q, k, v)
    _check((out, *vjp(do)), jax_nn_oracle(q, k, v, do, mask)[:4], "bfloat16")

    lengths = jnp.asarray([S, 200], jnp.int32)
    doc = _docs()
    out = fusedattn.fused_attn(q, k, v, mask_mod=same_doc, score_mod_args=(doc,),
                               sequence=fusedattn.SequenceDescriptor.from_lengths(lengths,
                                                                                  lengths))
    assert not np.asarray(out[1, 200:]).any()


def _largest_array(fn, *args) -> int:
    """Elements of the largest array in `fn`'s optimized HLO."""
    text = jax.jit(fn).lower(*args).compile().as_text()
    return max(int(np.prod([int(n) for n in dims.split(",")]))
               for dims in re.findall(r"\[([0-9]+(?:,[0-9]+)+)\]", text))


def test_no_s2_array_in_a_training_step(gpu, monkeypatch):
    """The walks hold tiles of (batch, head, query block) pairs, never all S^2 pairs; the
    XLA backend's step (the check's counter-example: its scores fit one tile) holds them."""
    s = 2048    # (S^2 pairs a head: 8x q's elements at d 256)
    q = jnp.zeros((1, s, 2, 256), jnp.bfloat16)
    doc = jnp.asarray(doc_ids(1, s, [600, 400]))

    def step(q, k, v, doc, backend="auto"):
        def loss(q, k, v):
            out = fusedattn.fused_attn(q, k, v, mask_mod=same_doc, score_mod_args=(doc,),
                                       backend=backend)
            return jnp.sum(out.astype(jnp.float32))
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    pairs = 2 * s * s    # heads x S^2
    assert fusedattn.explain(q, q, q, mask_mod=same_doc, score_mod_args=(doc,)).chosen \
        == "block_sparse_xla"
    assert _largest_array(step, q, q, q, doc) < pairs // 4
    assert _largest_array(lambda *a: step(*a, backend="xla"), q, q, q, doc) >= pairs


@pytest.mark.parametrize("options", [dict(mask="causal", window=(40, 0)), dict(window=(30, 60))],
                         ids=["causal-window", "two-sided"])
def test_a_float32_window_xla_would_tile(gpu, monkeypatch, options):
    """cuDNN and FA3 take no float32: a built-in window whose scores XLA would tile
    (here the threshold lowered to these shapes) is walked on its static map; below the
    threshold, and for a causal mask alone or no mask, xla runs it."""
    q, k, v, do = _inputs(64, jnp.float32, seed=2)
    small = fusedattn.explain(q, k, v, **options)
    assert small.chosen == "xla" and "XLA would tile" in dict(small.reasons)["block_sparse_xla"]
    monkeypatch.setattr(tiles, "SINGLE_TILE", 1)
    dispatch.clear_cache()
    plan = fusedattn.explain(q, k, v, **options)
    assert plan.chosen == "block_sparse_xla", str(plan)
    assert "empty" in str(plan)   # (the static map's density)
    out, vjp = jax.vjp(jax.jit(lambda q, k, v: fusedattn.fused_attn(q, k, v, **options)),
                       q, k, v)
    left, right = options["window"]
    i, j = np.arange(S)[:, None], np.arange(S)[None, :]
    visible = (j <= i) if "mask" in options else np.ones((S, S), bool)
    visible &= (i - j <= left) & (j - i <= right)
    _check((out, *vjp(do)), jax_nn_oracle(q, k, v, do, visible[None, None])[:4], "float32")
    for others in (dict(mask="causal"), dict()):
        assert fusedattn.explain(q, k, v, **others).chosen == "xla"


@pytest.mark.parametrize("groups", [2, 4])
def test_tiles_walked_in_runs_by_list_length(gpu, monkeypatch, groups):
    """The walks sort each (batch, head)'s tiles by list length and walk them in runs
    (`reference.GROUPS`, taken on a GPU from MIN_LANES lanes a run): the same results as
    one run, forward and gradients, on a causal map and documents."""
    from fusedattn.block_sparse import reference
    s = 1024    # (8 query and key tiles: runs of 4 or 2)
    keys = jax.random.split(jax.random.key(3), 4)
    q, k, v, do = (jax.random.normal(kk, (B, s, h, 96), jnp.bfloat16)
                   for kk, h in zip(keys, (H, H_KV, H_KV, H)))
    doc = jnp.asarray(doc_ids(B, s, [200, 500, 130]))
    results = []
    for g, lanes in ((1, reference.MIN_LANES), (groups, 1)):
        monkeypatch.setattr(reference, "GROUPS", g)
        monkeypatch.setattr(reference, "MIN_LANES", lanes)
        call = jax.jit(lambda q, k, v: fusedattn.fused_attn(
            q, k, v, mask="causal", mask_mod=same_doc, score_mod_args=(doc,)))
        out, vjp = jax.vjp(call, q, k, v)
        results.append([np.asarray(x, np.float32) for x in (out, *vjp(do))])
    for one, runs in zip(*results):
        assert rel_error(runs, one) < 1e-2
    visible = np.asarray(doc[:, None, :, None] == doc[:, None, None, :])
    _check(results[1], jax_nn_oracle(q, k, v, do, visible, causal=True)[:4], "bfloat16")


def test_a_drop_in_mask_a_kernel_takes_is_not_walked(gpu, monkeypatch):
    """A drop-in mask built from ids in the step becomes a mask_mod over them where a
    block map runs it; where only the walks would, and a vendor kernel takes the mask as
    it is (a bias, every tile: faster than the walks), the mask stays as it is."""
    import types
    from fusedattn.dispatch import registry
    q = jnp.zeros((B, S, H, 256), jnp.bfloat16)

    def plan():
        found = []

        def traced(q, doc):
            found.append(fusedattn.jax_nn.explain(
                q, q, q, mask=doc[:, None, :, None] == doc[:, None, None, :]))
            return q
        jax.eval_shape(traced, q, _docs())
        return found[0]
    walked = plan()
    assert walked.chosen == "block_sparse_xla" and "mask_program" in walked.rewritten
    # (a stand-in for cuDNN, which on CPU has no extension: a bias yes, a mask_mod no)
    monkeypatch.setitem(registry.BACKENDS, "cudnn", types.SimpleNamespace(
        name="cudnn", platforms=("cuda",),
        supports=lambda config: "no mask_mod" if config.score_mod is not None else None))
    dispatch.clear_cache()
    as_is = plan()
    assert as_is.chosen == "cudnn" and "mask_program" not in as_is.rewritten, str(as_is)
