"""Masks on one GPU: fusedattn (the mask_mods through `fused_attn` and its dispatch,
maps from ids and dense masks on the block-sparse Mosaic GPU kernels) against
fusedattn's plain causal attention (dispatch's choice) and torch flex_attention,
forward and forward+backward, b4 s4096 h16 d128 bf16. Rows named ":block_sparse"
call `block_sparse_attention` itself, whatever dispatch would pick. The "+" rows
compose a score_mod that reads arrays (per-head ALiBi slopes, a learned per-document
scale, a T5 bias table read by q_idx - kv_idx) with a mask: beside the same mask's
row they show what the score_mod costs (window + ALiBi both through `fused_attn` and
on the block-sparse kernels by name).

TFLOP/s count visible pairs only (4 * d flops per pair forward, 3.5x that for
forward+backward), for every row alike, so rows compare as work per second. Our
rows include building the block map: a mask_mod that reads only positions has a
static map (built on the host when traced), maps from an id array or a dense mask
are built on the device inside the timed step. The dense document mask goes through
the jax.nn drop-in (`fusedattn.dot_product_attention(mask=)`), dispatch included;
"causal_dense_mask" gives it the causal mask as an argument of the step (a map on the
device), and "causal_dense_mask:built_in_step" builds it inside the step as Flax's
`make_causal_mask` does (its value known at trace time: it runs as ``mask="causal"``);
their torch column is torch's causal row. "documents_dense_mask:built_in_step" builds the
document mask inside the step from the ids, as Flax's ``make_attention_mask(ids, ids,
jnp.equal)`` does (it runs as a mask_mod over the ids, `tracing.mask_program`).
"documents" is flex_attention's documents mask_mod, ``ids[b, q] == ids[b, kv]``, through
`fused_attn` (ids in any order: a block map, its ids counted per block);
"documents:deterministic" asks for a backward of the same bits run after run
(the Mosaic dq and dk / dv kernels; without it a documents or dense mask's backward
is one kernel that adds dq with atomics, `block_sparse.kernel_bwd_fused`);
"documents:segment_ids" builds the same map with `block_sparse.from_segment_ids` and
calls the kernels by name; "documents:sbhd" gives the mask_mod sequence-first q, k, v
and dO (``layout="sbhd"``, which the kernels read in place); "documents_causal" is flex's
causal documents mask_mod, ``(ids[b, q] == ids[b, kv]) & (kv <= q)`` (its map counts
ids, the diagonal's blocks evaluated pair by pair); "documents:packed" declares the same
sorted ids as packed segments (`SequenceDescriptor`, built in the step), which run on
cuDNN's THD or FA3's variable-length kernels by measurement; "documents_prefix:packed"
adds a prefix-LM mask_mod inside each packed document (positions inside the segments,
as `fused_attn` gives them; torch reads them from a position tensor);
"documents_causal+t5_bias:packed" reads a T5 table by the bucket of the positions'
difference, causal inside each packed document (by diagonals: the segments are shared).
torch flex_attention (torch.compile, create_block_mask built once outside the timing)
runs in a child process, timed the same way.

    python -m benchmarks.bench_block_sparse [--only CASE,CASE,...]

`--only` runs those rows (and torch's of the same masks) and prints them without
writing the results page, which holds every row of one run.

Writes benchmarks/results/block_sparse_<device>.json.
"""
from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import torch_flex
from benchmarks.common import (device_meta, device_slug, print_table, run_main, time_row,
                               warm_into, write_results)
import fusedattn
from fusedattn import block_sparse as bs
from fusedattn import score_mods
from fusedattn.dispatch import measure
from fusedattn.block_sparse.attention import block_sparse_attention
from fusedattn.sequence import SequenceDescriptor

B, S, H, D = 4, 4096, 16, 128
WINDOW, PREFIX, DOCS = 512, 1024, (512, 1024, 512, 2048)
DOC_PREFIX = 128   # the prefix-LM inside each document of the packed row


def _doc_ids():
    ids = np.concatenate([np.full(n, i, np.int32) for i, n in enumerate(DOCS)])
    return np.broadcast_to(ids, (B, S)).copy()


def _visible_pairs(name):
    i, j = np.arange(S)[:, None], np.arange(S)[None, :]
    if name.startswith("sliding_window"):
        m = (j <= i) & (i - j < WINDOW)
    elif name == "prefix_lm":
        m = (j <= i) | (j < PREFIX)
    elif name.startswith("causal"):
        m = j <= i
    elif name.startswith("documents_prefix"):
        ids = _doc_ids()[0]
        pos = np.arange(S) - np.searchsorted(ids, ids)   # positions inside each document
        m = (ids[:, None] == ids[None, :]) & ((pos[None, :] <= pos[:, None])
                                              | (pos[None, :] < DOC_PREFIX))
    else:
        ids = _doc_ids()[0]
        m = ids[:, None] == ids[None, :]
        if name.startswith("documents_causal"):
            m &= j <= i
    return int(m.sum()) * B * H


def window_mod(b, h, i, j):
    return (j <= i) & (i - j < WINDOW)


def prefix_mod(b, h, i, j):
    return (j <= i) | (j < PREFIX)


def doc_prefix_mod(b, h, i, j):   # i, j inside a packed segment
    return (j <= i) | (j < DOC_PREFIX)


def doc_mod(b, h, i, j, ids):
    return ids[b, i] == ids[b, j]


def doc_causal_mod(b, h, i, j, ids):
    return (ids[b, i] == ids[b, j]) & (j <= i)


def cases():
    """name -> fn(q, k, v, extra): `extra` (the ids or the dense mask) is an argument of
    the jitted step, so building its map runs on the device in every call. The mask_mod
    rows go through `fused_attn` as a user writes them (dispatch included: a window
    mask_mod is recognised as ``window=`` and runs on cuDNN or FA3, whichever a
    measurement picks); ":block_sparse" rows call the block-sparse kernels by name."""
    def window(q, k, v, extra):
        return fusedattn.fused_attn(q, k, v, mask_mod=window_mod)

    def window_kernels(q, k, v, extra):
        return block_sparse_attention(q, k, v, bs.block_map(window_mod, s_q=S, s_kv=S))

    def prefix(q, k, v, extra):
        return fusedattn.fused_attn(q, k, v, mask_mod=prefix_mod)

    def documents(q, k, v, ids):   # the form: flex's mask_mod reading an id array
        return fusedattn.fused_attn(q, k, v, mask_mod=doc_mod, score_mod_args=(ids,))

    def documents_deterministic(q, k, v, ids):   # the backward of two kernels, no atomics
        return fusedattn.fused_attn(q, k, v, mask_mod=doc_mod, score_mod_args=(ids,),
                                    deterministic=True)

    def documents_causal(q, k, v, ids):   # flex's causal documents mask_mod
        return fusedattn.fused_attn(q, k, v, mask_mod=doc_causal_mod, score_mod_args=(ids,))

    def documents_sbhd(q, k, v, ids):   # the same, q, k, v (and dO) sequence-first
        return fusedattn.fused_attn(q, k, v, mask_mod=doc_mod, score_mod_args=(ids,),
                                    layout="sbhd")

    def documents_ids(q, k, v, ids):   # the same ids through the map builder, by name
        return block_sparse_attention(q, k, v, bs.from_segment_ids(ids, pad_id=None))

    def documents_prefix_packed(q, k, v, ids):   # a prefix-LM inside each packed document
        return fusedattn.fused_attn(q, k, v, sequence=_packed(ids), mask_mod=doc_prefix_mod)

    def documents_causal_t5_packed(q, k, v, ids):   # a T5 table, causal, in packed documents
        return fusedattn.fused_attn(q, k, v, sequence=_packed(ids), mask="causal",
                                    score_mod=_t5, score_mod_args=(T5_TABLE,))

    def documents_packed(q, k, v, ids):   # sorted ids declared as packed (THD) segments
        return fusedattn.fused_attn(q, k, v, sequence=_packed(ids))

    def dense_mask(q, k, v, dense):   # the jax.nn drop-in, its dispatch included
        return fusedattn.dot_product_attention(q, k, v, mask=dense)

    def mask_built_in_step(q, k, v, extra):   # as Flax code builds its causal mask
        return fusedattn.dot_product_attention(q, k, v, mask=jnp.tril(jnp.ones((S, S), bool)))

    def documents_built_in_step(q, k, v, ids):   # Flax's make_attention_mask(ids, ids, equal)
        mask = ids[:, None, :, None] == ids[:, None, None, :]
        return fusedattn.dot_product_attention(q, k, v, mask=mask)

    # score_mods reading arrays, composed with the masks above (compare with their rows)
    def window_alibi_auto(q, k, v, extra):   # dispatch: the built-in window, ALiBi lowered
        return fusedattn.fused_attn(q, k, v, mask_mod=_window_of_args, score_mod=_alibi,
                                    score_mod_args=(SLOPES,))

    def window_alibi(q, k, v, extra):
        return block_sparse_attention(q, k, v, bs.block_map(window_mod, s_q=S, s_kv=S),
                                      score_mod=_alibi, score_mod_args=(SLOPES,))

    def documents_scale(q, k, v, ids):
        return block_sparse_attention(q, k, v, bs.from_segment_ids(ids, pad_id=None),
                                      score_mod=_doc_scale, score_mod_args=(ids, DOC_SCALE))

    def causal_t5(q, k, v, extra):
        bm = bs.block_map(lambda b, h, i, j: j <= i, s_q=S, s_kv=S)
        return block_sparse_attention(q, k, v, bm, score_mod=_t5, score_mod_args=(T5_TABLE,))

    return {"sliding_window": window, "sliding_window:block_sparse": window_kernels,
            "prefix_lm": prefix, "documents": documents,
            "documents:sbhd": documents_sbhd, "documents:deterministic": documents_deterministic,
            "documents:segment_ids": documents_ids, "documents:packed": documents_packed,
            "documents_prefix:packed": documents_prefix_packed,
            "documents_causal+t5_bias:packed": documents_causal_t5_packed,
            "documents_dense_mask": dense_mask,
            "documents_dense_mask:built_in_step": documents_built_in_step,
            "documents_causal": documents_causal,
            "causal_dense_mask": dense_mask, "causal_dense_mask:built_in_step": mask_built_in_step,
            "sliding_window+alibi": window_alibi_auto,
            "sliding_window+alibi:block_sparse": window_alibi,
            "documents+document_scale": documents_scale,
            "causal+t5_bias:block_sparse": causal_t5}


SLOPES = jnp.asarray([2.0 ** (-8.0 * (h + 1) / H) for h in range(H)], jnp.float32)
DOC_SCALE = jnp.linspace(0.8, 1.2, len(DOCS), dtype=jnp.float32)
T5_TABLE = jnp.asarray(np.random.default_rng(0).normal(size=(H, 32)) * 0.5, jnp.float32)


def _window_of_args(b, h, i, j, *args):   # (a mask_mod takes the score_mod's arguments)
    return window_mod(b, h, i, j)


def _alibi(s, b, h, i, j, slopes):          # per-head slopes: a (batch, head) value
    return s + slopes[h] * (j - i).astype(jnp.float32)


def _doc_scale(s, b, h, i, j, ids, scale):  # a learned scale per document: a row value
    return s * scale[ids[b, i]]


def _t5(s, b, h, i, j, table):   # a T5 bias table: read by q_idx - kv_idx
    return s + table[h, score_mods.t5_bucket(i, j)]


def _t5_buckets():
    """Each diagonal's bucket, d = i - j from -(S - 1): torch reads the table through it."""
    d = np.arange(-(S - 1), S)
    return np.asarray(score_mods.t5_bucket(jnp.asarray(d), 0)).tolist()


def plain_causal():
    """Our plain causal attention: `fused_attn(mask="causal")` as dispatch runs it (the
    faster of cuDNN and FA3 by measurement), and the backend of each step, for the notes."""
    f = lambda q, k, v, _: fusedattn.fused_attn(q, k, v, mask="causal")
    return f, f"fusedattn auto: {route(mask='causal')}"


def _packed(ids):
    return SequenceDescriptor.from_segment_ids(ids + 1, max_segments=len(DOCS))


def route(**options) -> str:
    """What dispatch runs for these options: the backend of each step (and a rewrite)."""
    q = jnp.zeros((B, S, H, D), jnp.bfloat16)
    plan = fusedattn.explain(q, q, q, **options)
    return _steps(plan) + (f" ({plan.rewritten})" if plan.rewritten else "")


def _steps(plan) -> str:
    if plan.groups:   # a call per run of query rows
        groups = "; ".join(f"queries {q} x keys {kv}: {_steps(p)}" for q, kv, p in plan.groups)
        return (f"without a gradient {_steps(plan.inference)}; training: {groups}"
                if plan.inference is not None else groups)
    return str({s: plan.rivals.for_step(s) for s in measure.STEPS} if plan.rivals
               else plan.chosen)


def _step(fn, mode, q, k, v, do, extra):
    if mode == "fwd":
        return jax.jit(fn), (q, k, v, extra)

    def run(q, k, v, do, extra):
        _, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, extra), q, k, v)
        return vjp(do)
    return jax.jit(run), (q, k, v, do, extra)


# The masks as torch flex_attention mask_mods (`torch_flex` runs and times them).
TORCH_CASES = r'''
W, P, DOC_PREFIX, T5_D0 = %d, %d, %d, %d
ids = torch.tensor(%s, device="cuda", dtype=torch.int32)
pos = torch.arange(ids.numel(), device="cuda", dtype=torch.int32)
pos = pos - torch.searchsorted(ids, ids).int()   # positions inside each (sorted) document
slopes = torch.tensor(%s, device="cuda", dtype=torch.float32)
doc_scale = torch.tensor(%s, device="cuda", dtype=torch.float32)
t5_table = torch.tensor(%s, device="cuda", dtype=torch.float32)
t5_bucket = torch.tensor(%s, device="cuda", dtype=torch.int32)
cases = {
  "sliding_window": (None, lambda b, h, i, j: (j <= i) & (i - j < W)),
  "prefix_lm": (None, lambda b, h, i, j: (j <= i) | (j < P)),
  "documents": (None, lambda b, h, i, j: ids[i] == ids[j]),
  "documents_causal": (None, lambda b, h, i, j: (ids[i] == ids[j]) & (j <= i)),
  "documents_prefix": (None, lambda b, h, i, j: (ids[i] == ids[j])
                       & ((pos[j] <= pos[i]) | (pos[j] < DOC_PREFIX))),
  "causal": (None, lambda b, h, i, j: j <= i),
  "sliding_window+alibi": (lambda s, b, h, i, j: s + slopes[h] * (j - i),
                           lambda b, h, i, j: (j <= i) & (i - j < W)),
  "documents+document_scale": (lambda s, b, h, i, j: s * doc_scale[ids[i]],
                               lambda b, h, i, j: ids[i] == ids[j]),
  "causal+t5_bias": (lambda s, b, h, i, j: s + t5_table[h, t5_bucket[i - j + T5_D0]],
                     lambda b, h, i, j: j <= i),
  "documents_causal+t5_bias": (
      lambda s, b, h, i, j: s + t5_table[h, t5_bucket[pos[i] - pos[j] + T5_D0]],
      lambda b, h, i, j: (ids[i] == ids[j]) & (j <= i)),
}
'''


def torch_times(only=None) -> dict:
    cases = TORCH_CASES % (WINDOW, PREFIX, DOC_PREFIX, S - 1, json.dumps(_doc_ids()[0].tolist()),
                           json.dumps(np.asarray(SLOPES).tolist()),
                           json.dumps(np.asarray(DOC_SCALE).tolist()),
                           json.dumps(np.asarray(T5_TABLE).tolist()), json.dumps(_t5_buckets()))
    if only is not None:
        cases += f"cases = {{k: c for k, c in cases.items() if k in {sorted(only)!r}}}\n"
    return torch_flex.times(B, S, H, D, cases)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", help="comma-separated rows to run; the page is not written")
    only = ap.parse_args().only
    only = None if only is None else set(only.split(","))
    unknown = set() if only is None else only - set(cases()) - {"causal"}
    if unknown:
        raise SystemExit(f"--only: unknown rows {sorted(unknown)}")
    if jax.default_backend() != "gpu":
        print("bench_block_sparse: needs a CUDA GPU, skipped")
        return
    meta = device_meta()
    print(f"device {meta.get('device')}  jax {meta.get('jax')}", flush=True)
    notes = {}
    try:
        torch = torch_times(None if only is None else {n.split(":")[0] for n in only})
    except Exception as e:  # noqa: BLE001 - the anchor is reported missing, with why
        torch, notes["torch"] = {}, f"{type(e).__name__}: {str(e)[:300]}"
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (jax.random.normal(x, (B, S, H, D), jnp.bfloat16) for x in keys)
    sbhd = tuple(jnp.swapaxes(x, 0, 1) for x in (q, k, v, do))   # (materialized: eager)
    ids = jnp.asarray(_doc_ids())
    ids_np = _doc_ids()
    dense = jnp.asarray((ids_np[:, :, None] == ids_np[:, None, :])[:, None])
    causal_fn, causal_name = plain_causal()
    meta["plain_causal"] = causal_name
    meta["routes"] = {"sliding_window": route(mask_mod=window_mod),
                      "prefix_lm": route(mask_mod=prefix_mod),
                      "documents": route(mask_mod=doc_mod, score_mod_args=(ids,)),
                      "documents:packed": route(sequence=_packed(ids)),
                      "documents_prefix:packed": route(sequence=_packed(ids),
                                                       mask_mod=doc_prefix_mod),
                      "documents_causal": route(mask_mod=doc_causal_mod, score_mod_args=(ids,)),
                      "documents_causal+t5_bias:packed": route(
                          sequence=_packed(ids), mask="causal", score_mod=_t5,
                          score_mod_args=(T5_TABLE,)),
                      "sliding_window+alibi": route(mask_mod=_window_of_args, score_mod=_alibi,
                                                    score_mod_args=(SLOPES,))}
    rows = []
    extras = {"documents": ids, "documents:sbhd": ids, "documents:deterministic": ids,
              "documents:segment_ids": ids,
              "documents:packed": ids, "documents_prefix:packed": ids,
              "documents_causal+t5_bias:packed": ids,
              "documents_dense_mask": dense, "documents_dense_mask:built_in_step": ids,
              "documents_causal": ids,
              "causal_dense_mask": jnp.asarray(np.tril(np.ones((S, S), bool)))[None, None],
              "documents+document_scale": ids}
    for name, fn in list(cases().items()) + [("causal", causal_fn)]:
        if only is not None and name not in only:
            continue
        pairs = _visible_pairs(name)
        impls = {"fusedattn": fn}
        if name.endswith("_dense_mask"):
            impls["jax.nn cudnn, dense mask"] = lambda q, k, v, m: jax.nn.dot_product_attention(
                q, k, v, mask=m, implementation="cudnn")
        for mode in ("fwd", "fwd+bwd"):
            row = {"case": name, "mode": mode, "visible": pairs / (B * H * S * S)}
            flops = 4.0 * D * pairs * (3.5 if mode == "fwd+bwd" else 1.0)
            calls = {}
            tensors = sbhd if name.endswith(":sbhd") else (q, k, v, do)
            for impl, f in impls.items():
                why = warm_into(calls, impl, *_step(f, mode, *tensors, extras.get(name)))
                if why is not None:
                    notes[f"{impl} {name} {mode}"] = why
            time_row(row, calls, flops)
            t = torch.get(name.split(":")[0].replace("_dense_mask", ""), {}).get(mode)
            if t:
                row["torch-flex"] = flops / t / 1e12
                row["torch-flex_ms"] = t * 1e3
            rows.append(row)
            print(f"  {name} {mode}: " + ", ".join(f"{i}={row[i]:.3g}" for i in row
                                                   if isinstance(row[i], float)), flush=True)
    causal = {r["mode"]: r.get("fusedattn") for r in rows if r["case"] == "causal"}
    for r in rows:
        ours = r.get("fusedattn")
        if ours and r.get("torch-flex"):
            r["x torch"] = ours / r["torch-flex"]
        if ours and causal.get(r["mode"]):
            r["x plain causal"] = ours / causal[r["mode"]]
        if ours and r.get("jax.nn cudnn, dense mask"):
            r["x jax.nn"] = ours / r["jax.nn cudnn, dense mask"]
    print_table(rows, ["case", "mode", "fusedattn_ms", "fusedattn", "torch-flex_ms", "torch-flex",
                       "x torch", "x plain causal", "jax.nn cudnn, dense mask_ms", "x jax.nn"])
    meta["notes"] = notes
    if only is None:
        print(write_results(f"block_sparse_{device_slug(meta)}", rows, meta))


if __name__ == "__main__":
    run_main(main)
