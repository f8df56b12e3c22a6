"""Mask families and the float64 oracle shared by the block-sparse attention tests."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import fusedattn
from fusedattn import block_sparse as bs
from fusedattn import score_mods
from support import oracle as f64_oracle   # (this module's `oracle` is the block walk's)


def doc_ids(b, s, lengths):
    """Document ids [b, s] from lengths (cycled to fill s), shuffled per row so ids
    are not sorted: the map must not assume order."""
    ids, d, pos = np.zeros((b, s), np.int32), 1, 0
    i = 0
    while pos < s:
        n = lengths[i % len(lengths)]
        ids[:, pos:pos + n] = d
        pos, d, i = pos + n, d + 1, i + 1
    perm = np.random.default_rng(0).permutation(ids.max() + 1)
    perm[0] = 0
    return perm[ids].astype(np.int32) + 1


def in_layout(layout: str, q, k, v):
    """bshd q, k, v as `fused_attn` takes them in `layout` ("sbhd", "bs3hd",
    "bshd_bs2hd", "sbhd_sb2hd", ...), and the function that takes its output back to
    bshd (differentiable: gradients reach the bshd arrays)."""
    to = (lambda x: jnp.swapaxes(x, 0, 1)) if layout.startswith("sb") else (lambda x: x)
    q, k, v = (to(x) for x in (q, k, v))
    if "3" in layout:
        return (jnp.stack([q, k, v], axis=-3), None, None), to
    if "2" in layout:
        return (q, jnp.stack([k, v], axis=-3), None), to
    return (q, k, v), to


def block_map(family: str, b: int, h: int, s: int):
    """(map, name) of one mask family at b x h x s x s."""
    if family == "causal":
        return bs.block_map(lambda b_, h_, i, j: j <= i, s_q=s, s_kv=s)
    if family == "sliding_window":
        return bs.block_map(lambda b_, h_, i, j: (j <= i) & (i - j < s // 4), s_q=s, s_kv=s)
    if family == "prefix_lm":
        return bs.block_map(lambda b_, h_, i, j: (j <= i) | (j < s // 4), s_q=s, s_kv=s)
    if family == "documents":
        return bs.from_segment_ids(jnp.asarray(doc_ids(b, s, [s // 8, s // 4, s // 8 + 40])))
    if family == "documents_causal":
        return bs.from_segment_ids(jnp.asarray(doc_ids(b, s, [s // 4, 3 * s // 8])),
                                   mask="causal")
    if family == "documents_mask_mod":   # ids and per-row prefix lengths read as arrays
        ids = jnp.asarray(doc_ids(b, s, [s // 8, s // 4, s // 8 + 40]))
        prefix = jnp.arange(b, dtype=jnp.int32) * 50 + 30
        return bs.block_map(lambda b_, h_, i, j, d, n: (d[b_, i] == d[b_, j]) & (j <= i)
                            | (j < n[b_]), b, h, s, s, args=(ids, prefix))
    if family == "documents_causal_mask_mod":   # flex's causal documents, ids recurring
        ids = jnp.asarray(doc_ids(b, s, [s // 8, s // 4, s // 8 + 40]) % 2)
        return bs.block_map(lambda b_, h_, i, j, d: (d[b_, i] == d[b_, j]) & (j <= i),
                            b, h, s, s, args=(ids,))
    if family == "head_dependent":
        return bs.block_map(lambda b_, h_, i, j: (j <= i) & (i - j < 64 * (h_ + 1)), b, h, s, s)
    if family == "builtin_window":
        return bs.from_builtin(s, mask="causal", window=(s // 3, 0))
    if family == "random_dense":
        rng = np.random.default_rng(1)
        n = -(-s // 64)
        blocks = rng.random((b, 1, n, n)) < 0.4
        m = np.repeat(np.repeat(blocks, 64, 2), 64, 3)[:, :, :s, :s] & (rng.random((b, 1, s, s)) < 0.9)
        m[:, :, 3] = False                       # a row with no visible key
        return bs.from_dense_mask(jnp.asarray(m))
    raise ValueError(family)


FAMILIES = ("causal", "sliding_window", "prefix_lm", "documents", "documents_causal",
            "documents_mask_mod", "documents_causal_mask_mod", "head_dependent",
            "builtin_window", "random_dense")


def dense_visibility(bm, b, h, s):
    bb = jnp.arange(b)[:, None, None, None]
    hh = jnp.arange(h)[None, :, None, None]
    ii = jnp.arange(s)[None, None, :, None]
    jj = jnp.arange(s)[None, None, None, :]
    return np.broadcast_to(np.asarray(bm.element_mask(bb, hh, ii, jj)), (b, h, s, s))


def oracle(q, k, v, visible, scale, score_mod=None, d_out=None, args=(), unseen_rows="zero"):
    """float64 (out [b, s, h, d], lse [b, h, s], grads or None) of masked attention;
    rows with no visible key give 0 (``unseen_rows="mean"``: the mean of all values)
    and lse -inf. ``score_mod(s, b, h, i, j, *args)``; grads are dq, dk, dv, then one
    per floating arg (None for the others)."""
    with jax.enable_x64(True):
        q64, k64, v64 = (jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v))
        g = q.shape[2] // k.shape[2]
        vis = jnp.asarray(visible)
        floats = [i for i, a in enumerate(args) if jnp.issubdtype(jnp.result_type(a), jnp.floating)]
        f64 = [jnp.asarray(np.asarray(args[i], np.float64)) for i in floats]

        def f(q64, k64, v64, *fargs):
            full = list(args)
            for i, a in zip(floats, fargs):
                full[i] = a
            kk, vv = jnp.repeat(k64, g, 2), jnp.repeat(v64, g, 2)
            s = jnp.einsum("bqhd,bkhd->bhqk", q64, kk) * scale
            if score_mod is not None:
                i = jnp.arange(s.shape[2])[:, None]
                j = jnp.arange(s.shape[3])[None, :]
                bb = jnp.arange(s.shape[0])[:, None, None, None]
                hh = jnp.arange(s.shape[1])[None, :, None, None]
                s = score_mod(s, bb, hh, i, j, *full)
            s = jnp.where(vis, s, -jnp.inf)
            m = jnp.max(s, -1, keepdims=True)
            m = jnp.where(jnp.isinf(m), 0.0, m)
            p = jnp.where(vis, jnp.exp(s - m), 0.0)
            l = p.sum(-1, keepdims=True)
            out = jnp.einsum("bhqk,bkhd->bqhd", p / jnp.where(l == 0, 1.0, l), vv)
            if unseen_rows == "mean":
                unseen = jnp.swapaxes(l == 0, 1, 2)                      # [b, q, h, 1]
                out = jnp.where(unseen, vv.mean(1, keepdims=True), out)
            lse = jnp.where(l[..., 0] == 0, -jnp.inf, jnp.log(jnp.where(l == 0, 1.0, l))[..., 0] + m[..., 0])
            return out, lse

        (out, lse), vjp = jax.vjp(f, q64, k64, v64, *f64)
        grads = None
        if d_out is not None:
            got = iter(vjp((jnp.asarray(np.asarray(d_out, np.float64)), jnp.zeros_like(lse))))
            grads = [np.asarray(next(got)) for _ in range(3)]
            grads += [np.asarray(next(got)) if i in floats else None for i in range(len(args))]
        return np.asarray(out), np.asarray(lse), grads


def jax_nn_oracle(q, k, v, do, visible, causal=False):
    """(out, dq, dk, dv, lse) in float64 with jax.nn's semantics: `visible` [B|1, H|1,
    T, S] hides pairs; a row that sees no key averages all values (that mean's gradient
    goes to v, summed over the heads of a group)."""
    ref = f64_oracle.attention(np.asarray(q, np.float64), np.asarray(k, np.float64),
                               np.asarray(v, np.float64), bias=np.where(visible, 0.0, -np.inf),
                               mask="causal" if causal else "none",
                               d_out=np.asarray(do, np.float64))
    empty = ~np.isfinite(ref.lse).transpose(0, 2, 1)            # [B, T, H]
    b, d, group = k.shape[0], k.shape[3], q.shape[2] // k.shape[2]
    mean = np.repeat(np.asarray(v, np.float64).mean(1), group, axis=1)  # [B, H, D]
    out = np.where(empty[..., None], mean[:, None], ref.out)
    to_mean = (np.asarray(do, np.float64) * empty[..., None]).sum(1)     # [B, H, D]
    dv = ref.dv + to_mean.reshape(b, -1, group, d).sum(2)[:, None] / k.shape[1]
    return out, ref.dq, ref.dk, dv, np.asarray(ref.lse)


def rel_error(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(x - ref).max() / max(np.abs(ref).max(), 1e-6))


def score_value_args(name, docs, H):
    """The args of `SCORE_VALUE_MODS[name]` for document ids `docs` [B, S] (ids < 5)."""
    B, S = docs.shape
    key = jax.random.split(jax.random.key(7), 4)
    slopes = jnp.linspace(0.02, 0.2, H, dtype=jnp.float32)
    return {
        "document_scale": (docs, jax.random.uniform(key[0], (5,), jnp.float32, 0.5, 1.5)),
        "alibi": (slopes,),
        "key_bias": (jax.random.normal(key[1], (B, S), jnp.float32),),
        "document_alibi": (docs, jax.random.uniform(key[2], (H, 5), jnp.float32, 0.01, 0.1)),
        "packed_distance": (docs * 1000 + jnp.arange(S, dtype=jnp.int32),),
        "gated_by_row": (jax.random.normal(key[3], (B, H, S), jnp.float32),),
        "checkpointed_capped_scale": (docs, jax.random.uniform(key[0], (5,), jnp.float32,
                                                               0.5, 1.5)),
        "t5_table": (jax.random.normal(key[1], (H, 32), jnp.float32),),
        "t5_causal_document_scale": (docs, jax.random.uniform(key[2], (5,), jnp.float32,
                                                              0.5, 1.5),
                                     jax.random.normal(key[3], (H, 16), jnp.float32)),
    }[name]


SCORE_VALUE_MODS = {  # score_mods reading arrays by position, batch or head
    # a learned scale per document, read through the row's document id
    "document_scale": lambda s, b, h, i, j, doc, sc: s * sc[doc[b, i]],
    # per-head slopes: per (b, h) values, no position
    "alibi": lambda s, b, h, i, j, sl: s + sl[h] * (j - i).astype(jnp.float32),
    # a per-key bias: a column value
    "key_bias": lambda s, b, h, i, j, kb: s + kb[b, j],
    # per-document, per-head slopes: a row value that depends on the head
    "document_alibi": lambda s, b, h, i, j, doc, sl: s - sl[h, doc[b, i]] * jnp.abs(
        (i - j).astype(jnp.float32)),
    # integers read on both sides (exact as bit-cast words), combined on the tiles
    "packed_distance": lambda s, b, h, i, j, pos: s - 0.01 * jnp.abs(
        pos[b, i] - pos[b, j]).astype(jnp.float32),
    # a nonlinear mix of the score and a per-(b, h, row) value
    "gated_by_row": lambda s, b, h, i, j, g: s * jax.nn.sigmoid(g[b, h, i]) + jnp.tanh(g[b, h, i]),
    # under jax.checkpoint (inlined by the jaxpr walker): a soft cap of a per-document scale
    "checkpointed_capped_scale": jax.checkpoint(
        lambda s, b, h, i, j, doc, sc: 5.0 * jnp.tanh(s * sc[doc[b, i]] / 5.0)),
    # a T5 bias table read by q_idx - kv_idx: values per run of diagonals
    "t5_table": lambda s, b, h, i, j, t: s + t[h, score_mods.t5_bucket(i, j)],
    # the same, one-directional, beside a per-document scale read by the row
    "t5_causal_document_scale": lambda s, b, h, i, j, doc, sc, t: s * sc[doc[b, i]] + t[
        h, score_mods.t5_bucket(i, j, 16, 64, bidirectional=False)],
}


# ---- packed segments: a mask_mod and score_mods seeing positions inside them -------------
def prefix_in_segment(b, h, i, j):
    return (j <= i) | (j < 32)


def by_segment_position(s, b, h, i, j, table):
    n = table.shape[0] - 1
    return s + table[jnp.clip(i, 0, n)] - table[jnp.clip(j, 0, n)]


def slopes_in_segment(s, b, h, i, j):
    return s - 0.05 * (h + 1) * jnp.abs(i - j)


def t5_in_segment(s, b, h, i, j, table):
    """A T5 table (one row for all heads) by the bucket of q_idx - kv_idx: under segments
    shared by queries and keys it is read per run of diagonals."""
    return s + table[score_mods.t5_bucket(i, j, 32, 64)]


PACKED = {"prefix mask_mod": dict(mask_mod=prefix_in_segment),
          "table score_mod, causal": dict(mask="causal", score_mod=by_segment_position),
          "positions score_mod, prefix mask_mod": dict(mask_mod=prefix_in_segment,
                                                       score_mod=slopes_in_segment),
          "T5 table score_mod, causal": dict(mask="causal", score_mod=t5_in_segment),
          "slopes score_mod alone, causal": dict(mask="causal", score_mod=slopes_in_segment)}


def packed_case(case, b, s):
    """(a packed descriptor, `fused_attn` options, score_mod_args) of a `PACKED` case: row
    r holds segments of about 0.4 s, 0.23 s and the rest (row 1: two, then padding)."""
    ids = np.zeros((b, s), np.int32)
    for r in range(b):
        lengths = [s * 2 // 5, s // 4] + ([s - s * 2 // 5 - s // 4] if r % 2 == 0 else [])
        ids[r, :sum(lengths)] = np.repeat(np.arange(1, len(lengths) + 1), lengths)
    seq = fusedattn.SequenceDescriptor.from_segment_ids(jnp.asarray(ids), max_segments=3)
    table = 0.3 * jax.random.normal(jax.random.key(5), (32 if "T5" in case else s,),
                                    jnp.float32)
    return seq, dict(PACKED[case], sequence=seq), ((table,) if "table" in case else ())


def check_packed(q, k, v, do, seq, opts, args):
    """`fused_attn(**opts)` as dispatch runs it against the XLA backend in float32 (the
    packed semantics' reference, itself checked against the float64 oracle): output,
    the q, k, v gradients and the table's; padded rows give exactly 0."""
    def loss(q, k, v, *args, backend="auto"):
        out = fusedattn.fused_attn(q, k, v, score_mod_args=args, backend=backend, **opts)
        return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32)), out
    argnums = tuple(range(3 + len(args)))
    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums, has_aux=True))(q, k, v, *args)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    (_, ref), ref_grads = jax.value_and_grad(lambda *a: loss(*a, backend="xla"), argnums,
                                             has_aux=True)(*f32, *args)
    pad = np.asarray(seq.q_segment_ids) == 0
    assert np.all(np.asarray(out, np.float32)[pad] == 0), "padded rows must give 0"
    assert rel_error(np.asarray(out, np.float32), np.asarray(ref)) < 2e-2
    for name, g, r in zip(("dq", "dk", "dv", "d table"), grads, ref_grads):
        assert rel_error(np.asarray(g, np.float32), np.asarray(r)) < 4e-2, name

