"""The fused backward's route (`block_sparse.kernel_bwd_fused`) on CPU: the words it
and the Mosaic kernels read for a documents mask against the mask itself, which calls
may take it and why the others do not, the arrays a dense mask's call hands it, and
what explain() says. Its kernel runs against the float64 oracle in
tests/gpu/test_block_sparse_gpu.py."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fusedattn
from fusedattn import block_sparse as bs
from fusedattn.block_sparse import kernel_bwd_fused as fused
from fusedattn.block_sparse import block_sparse_attention
from fusedattn.block_sparse.documents import Documents
from fusedattn.block_sparse.kernel_mask import pack_bits
from support.block_sparse_cases import doc_ids


@pytest.mark.parametrize("valid", ["none", "rows", "both"])
def test_words_give_the_documents_mask_over_whole_blocks(valid):
    rng = np.random.default_rng(0)
    s_q, s_kv = 200, 300   # past a block: the padding is invalid
    q_ids = rng.integers(0, 4, (2, s_q))
    kv_ids = rng.integers(0, 4, (1, s_kv))
    q_ok = rng.random((2, s_q)) > 0.2 if valid != "none" else None
    kv_ok = rng.random((1, s_kv)) > 0.2 if valid == "both" else None
    qw, kw = fused.words(Documents(q_ids, kv_ids, q_ok, kv_ok), s_q, s_kv)
    assert qw.dtype == jnp.int32 and kw.dtype == jnp.int32
    assert qw.shape == (2, 2, 256) and kw.shape == (2, 2, 384)   # one batch for both
    for b in range(2):
        got = np.asarray(fused.visible(b, 0, None, None, qw[b][:, :, None], kw[b][:, None, :],
                                       None))
        want = np.zeros((256, 384), bool)
        seen = q_ids[b][:, None] == kv_ids[0][None, :]
        if q_ok is not None:
            seen &= q_ok[b][:, None]
        if kv_ok is not None:
            seen &= kv_ok[0][None, :]
        want[:s_q, :s_kv] = seen
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("shape, dtype, seq_first, impl, s_kv, why", [
    ((1, 128, 1, 64), jnp.bfloat16, False, "mosaic", None, "d 128 in bf16 or fp16"),
    ((1, 128, 1, 128), jnp.float32, False, "mosaic", None, "d 128 in bf16 or fp16"),
    ((1, 128, 1, 128), jnp.bfloat16, True, "mosaic", None, "bshd"),
    ((1, 128, 1, 128), jnp.bfloat16, False, "reference", None, "Mosaic GPU kernels do not run"),
    ((1, 128, 1, 128), jnp.bfloat16, False, "mosaic", 256, "s_q == s_kv"),
    ((1, 128, 1, 128), jnp.bfloat16, False, "mosaic", 128, "one dtype"),
    # (everything else fits: the extension's answer)
    ((1, 128, 1, 128), jnp.float16, False, "mosaic", 128, "the extension's answer"),
])
def test_reason_names_what_keeps_a_call_off_the_kernel(monkeypatch, shape, dtype, seq_first,
                                                        impl, s_kv, why):
    monkeypatch.setattr(fused.extension, "ensure_targets",
                        lambda names: "the extension's answer" if list(names) == [fused.TARGET]
                        else None)
    kv = (jnp.float16,) if why == "one dtype" else (dtype, dtype)
    got = fused.reason(jax.ShapeDtypeStruct(shape, dtype), seq_first=seq_first,
                       implementation=impl, s_kv=s_kv, kv_dtypes=kv)
    assert got is not None and why in got, got


@pytest.mark.parametrize("shape", [(2, 3, 5), (1, 3, 5), (2, 1, 5), (1, 1, 5)])
def test_the_launch_order_lists_every_tile_once_longest_walk_first(shape):
    """The kernel's CTA i runs tile order[i], decoded as (b * H + h) * n_kv + kb: a
    permutation of every tile, by walk length (partial and full blocks) descending,
    with lists that vary along the batch or heads or broadcast."""
    rng = np.random.default_rng(0)
    b, h, n = 2, 3, 5
    num, full = (rng.integers(0, 4, shape) for _ in range(2))
    lists = (jnp.asarray(num, jnp.int32), None, jnp.asarray(full, jnp.int32), None)
    order = np.asarray(fused.launch_order(lists, b, h))
    assert order.dtype == np.int32 and sorted(order.tolist()) == list(range(b * h * n))
    kb, hh, bb = order % n, order // n % h, order // (n * h)
    steps = np.broadcast_to(num + full, (b, h, n))[bb, hh, kb]
    assert (np.diff(steps) <= 0).all(), steps


def test_deterministic_must_be_a_bool():
    q = jnp.zeros((1, 128, 1, 64), jnp.bfloat16)
    bm = fusedattn.block_sparse.from_segment_ids(jnp.zeros((1, 128), jnp.int32))
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        block_sparse_attention(q, q, q, bm, deterministic=1)


def _same_doc(b, h, i, j, doc):
    return doc[b, i] == doc[b, j]


def test_explain_says_the_reference_walks_keep_the_other_kernels(hopper_reference):
    q = jnp.zeros((2, 256, 4, 128), jnp.bfloat16)
    doc = jnp.asarray(doc_ids(2, 256, [64, 100]))
    plan = fusedattn.explain(q, q, q, mask_mod=_same_doc, score_mod_args=(doc,))
    assert plan.chosen == "block_sparse", str(plan)
    text = str(plan)
    assert "backward: the dq and dk / dv kernels" in text, text
    assert "Mosaic GPU kernels do not run" in text, text


def _maps(case, b, s):
    ids = jnp.asarray(doc_ids(b, s, [40, 90, 30]))
    if case == "ids":
        return bs.from_segment_ids(jnp.stack([jnp.roll(ids[i], 37 * i) for i in range(b)]))
    if case == "ids with padding":
        return bs.from_segment_ids(jnp.where(ids % 3 == 0, 0, ids), pad_id=0)
    if case == "ids of one row":
        return bs.from_segment_ids(ids[:1])
    return bs.block_map(lambda b_, h_, i, j, d: (d[b_, i] == d[b_, j]) & (d[b_, i] % 3 != 0),
                        b, 2, s, s, args=(ids,))


@pytest.mark.parametrize("case", ["ids", "ids with padding", "ids of one row", "mask_mod"])
def test_the_forward_reads_the_words_as_the_mask(monkeypatch, case):
    """With the route taken (the kernel's presence faked; the reference walks run), the
    forward's mask is the words: the same output as with the map's own element mask."""
    b, s = 2, 300
    q, k, v = (jax.random.normal(key, (b, s, 2, 128), jnp.bfloat16)
               for key in jax.random.split(jax.random.key(1), 3))
    bm = _maps(case, b, s)
    want = block_sparse_attention(q, k, v, bm, implementation="reference")
    monkeypatch.setattr(fused, "reason", lambda *a, **kw: None)
    words = []
    monkeypatch.setattr(fused, "words", lambda *a, real=fused.words: words.append(1) or real(*a))
    got = block_sparse_attention(q, k, v, bm, implementation="reference")
    assert words, "the route was not taken"
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=1e-6, atol=1e-6)


def _doc_mask(ids):
    return jnp.asarray(ids[:, None, :, None] == ids[:, None, None, :])


# (the drop-in or not, its options from the doc ids, what the backward should run: the
# fused kernel on "ids" or "bits", or the other kernels for the reason given)
_ROUTES = {
    "documents mask_mod": (False, lambda d: dict(mask_mod=_same_doc, score_mod_args=(d,)),
                           "ids"),
    "documents mask_mod, deterministic": (False, lambda d: dict(
        mask_mod=_same_doc, score_mod_args=(d,), deterministic=True), "deterministic=True"),
    "documents mask_mod and a score_mod": (False, lambda d: dict(
        mask_mod=_same_doc, score_mod_args=(d,), score_mod=lambda s, b, h, i, j, doc: s * 0.5),
        "a score_mod"),
    "documents mask_mod, causal": (False, lambda d: dict(
        mask_mod=_same_doc, score_mod_args=(d,), mask="causal"), "causal"),
    "documents mask_mod, a window": (False, lambda d: dict(
        mask_mod=_same_doc, score_mod_args=(d,), window=(100, 100)), "a window"),
    # (as wide as the sequence: the map drops it)
    "documents mask_mod, a window hiding nothing": (False, lambda d: dict(
        mask_mod=_same_doc, score_mod_args=(d,), window=(256, 300)), "ids"),
    "dense mask": (True, lambda d: dict(mask=_doc_mask(d)), "bits"),
    "dense mask, is_causal": (True, lambda d: dict(mask=_doc_mask(d), is_causal=True),
                              "causal"),
    "dense mask, key lengths": (True, lambda d: dict(
        mask=_doc_mask(d), key_value_seq_lengths=jnp.asarray([200, 256])), "padding lengths"),
}


def _stand_in(calls: list):
    """A stand-in for the kernel (`kernel_bwd_fused.backward`) that records the mask
    arrays, dv addend and key length of each call in `calls` and returns zeros."""
    def kernel(q, k, v, do, lse_delta, lists, q_words, kv_words, bits, dv_add, *, scale,
               s_kv):
        calls.append(dict(q_words=q_words, kv_words=kv_words, bits=bits, dv_add=dv_add,
                          s_kv=s_kv))
        per_head = jnp.zeros((*k.shape[:2], q.shape[2], q.shape[3]), q.dtype)
        return jnp.zeros_like(q), per_head, per_head
    return kernel


@pytest.mark.parametrize("case", list(_ROUTES))
def test_explain_and_the_call_agree_on_the_backward(hopper_reference, monkeypatch, case):
    """What explain() says the backward runs (from the config, before any array:
    `backends.block_sparse.backward_note`) is what a training step runs (from the map:
    `attention._fused_mask`), and the kernel gets the mask in the form said: the
    extension's presence faked, the kernel stood in for by one that records its mask."""
    monkeypatch.setattr(fused, "reason", lambda *a, **kw: None)
    calls = []
    monkeypatch.setattr(fused, "backward", _stand_in(calls))
    drop_in, options, want = _ROUTES[case]
    call, explain = ((fusedattn.dot_product_attention, fusedattn.jax_nn.explain) if drop_in
                     else (fusedattn.fused_attn, fusedattn.explain))
    q = jax.random.normal(jax.random.key(0), (2, 256, 4, 128), jnp.bfloat16)
    options = options(doc_ids(2, 256, [64, 100]))
    plan = explain(q, q, q, **options)
    assert plan.chosen == "block_sparse", str(plan)
    _, vjp = jax.vjp(lambda q: call(q, q, q, **options), q)
    vjp(q)
    text = str(plan)
    forms = ["ids" if c["q_words"] is not None else "bits" if c["bits"] is not None else "?"
             for c in calls]
    fused_form = want in ("ids", "bits")
    assert forms == ([want] if fused_form else []), (forms, text)
    if not fused_form:
        assert "backward: the dq and dk / dv kernels (the fused kernel:" in text, text
        assert want in text.split("backward:")[1], text
    elif want == "bits":
        assert "backward: one fused kernel reading the dense mask's bits" in text, text
    else:
        assert "backward: one fused kernel where the map's mask is documents alone" in text, text


@pytest.mark.parametrize("unseen", [False, True])
def test_a_dense_mask_hands_the_kernel_its_bits(monkeypatch, unseen):
    """With the route taken (the kernel's presence faked), a dense mask alone reaches the
    kernel as its packed bits and no words; with jax.nn's rule for rows that see no key,
    their mean's gradient (dO summed over those rows over the keys) as dv_add. The
    kernel is stood in for by one that records what it gets."""
    b, s, h = 2, 300, 2
    q, k, v, do = (jax.random.normal(key, (b, s, h, 128), jnp.bfloat16)
                   for key in jax.random.split(jax.random.key(2), 4))
    ids = doc_ids(b, s, [40, 90, 30])
    mask = np.broadcast_to(np.asarray(_doc_mask(ids)), (b, h, s, s)).copy()
    if unseen:
        mask[:, :, 7] = False
    bm = bs.from_dense_mask(jnp.asarray(mask))
    calls = []
    monkeypatch.setattr(fused, "reason", lambda *a, **kw: None)
    monkeypatch.setattr(fused, "backward", _stand_in(calls))
    _, vjp = jax.vjp(lambda q, k, v: block_sparse_attention(
        q, k, v, bm, implementation="reference", unseen_rows="mean"), q, k, v)
    vjp(do)
    assert len(calls) == 1, calls
    seen = calls[0]
    assert seen["q_words"] is None and seen["kv_words"] is None
    assert seen["s_kv"] == s   # (the kernel hides the keys padded to whole blocks)
    np.testing.assert_array_equal(np.asarray(seen["bits"]),
                                  np.asarray(pack_bits(jnp.asarray(mask), 384, 384)))
    if not unseen:
        # (no row unseen: the device flag leaves the sum at 0)
        assert seen["dv_add"] is None or not np.any(np.asarray(seen["dv_add"]))
        return
    want = np.asarray(do, np.float64)[:, 7] / s   # [b, h, d]: row 7 sees no key
    np.testing.assert_allclose(np.asarray(seen["dv_add"]), want, rtol=1e-5, atol=1e-6)
