"""fusedattn on a mesh of GPUs: batch / head splits of the native calls and context
parallelism, against one GPU doing its share of the work, in one process.

Batch and head splits run each native backend: cudnn, flash (FA3), cudnn with
precision="fp8", and block_sparse (the documents mask of bench_block_sparse as flex's
mask_mod over an id array, ids in the step); context parallelism runs cuDNN, and the
same documents through the ring on the block-sparse kernels.

Per row: the sharded forward+backward step (jit, NamedSharding inputs) and, timed
round-robin with it, one GPU running 1/n of the work (the same call on 1/n of the
batch, heads or tokens; for context parallelism the whole call on one GPU, divided
by n). efficiency = (1/n work on one GPU) / (sharded step time). Also the
collectives XLA compiled into the sharded step and the memory XLA plans per device
(arguments + outputs + temporaries), with the unsharded call's for context
parallelism.

    python -m benchmarks.bench_sharding [--quick]     (needs 2 or more GPUs)
    XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m benchmarks.bench_sharding --smoke
        (the harness on CPU: tiny shapes on the XLA backend; numbers mean nothing)

Writes benchmarks/results/sharding_<device>_x<n>.json.
"""
from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import fusedattn
from benchmarks.bench_block_sparse import DOCS, doc_mod
from benchmarks.common import (collectives, device_meta, device_slug, print_table, run_main,
                               time_interleaved, warmed, write_results)
from fusedattn import ContextParallel

DTYPE = jnp.bfloat16


def _normal(seed, shape):
    return jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32).astype(DTYPE)


def _step(fn):
    """jit of one forward + backward (the output's cotangent is an input)."""
    def run(q, k, v, do):
        _, vjp = jax.vjp(fn, q, k, v)
        return vjp(do)
    return jax.jit(run)


def _memory(compiled) -> dict:
    """XLA's per-device plan, GiB: arguments, outputs, temporaries and their total."""
    m = compiled.memory_analysis()
    parts = {"args": m.argument_size_in_bytes, "outs": m.output_size_in_bytes,
             "temp": m.temp_size_in_bytes}
    total = sum(parts.values()) - m.alias_size_in_bytes
    return {k: v / 2**30 for k, v in dict(parts, total=total).items()}


def _attention_case(b, s, h_q, h_kv, d, backend, **options):
    options.setdefault("mask", "causal")
    args = [_normal(0, (b, s, h_q, d)), _normal(1, (b, s, h_kv, d)), _normal(2, (b, s, h_kv, d)),
            _normal(3, (b, s, h_q, d))]
    return args, lambda cp=None: (
        lambda q, k, v: fusedattn.fused_attn(q, k, v, context_parallel=cp, backend=backend,
                                             **options))


def _split_backends(b, s, smoke):
    """(row label, backend, fused_attn options) of the batch / head split rows; on the
    --smoke harness every backend is XLA."""
    docs = np.concatenate([np.full(n * s // 4096, i, np.int32) for i, n in enumerate(DOCS)])
    ids = jnp.asarray(np.broadcast_to(docs, (b, s)))
    rows = [("causal", "cudnn", {}), ("causal", "flash", {}),
            ("causal fp8", "cudnn", {"precision": "fp8"}),
            ("documents", "block_sparse", {"mask": "none", "mask_mod": doc_mod,
                                           "score_mod_args": (ids,)})]
    return [(label, "xla" if smoke else backend, options) for label, backend, options in rows]


def rows_to_run(n: int, quick: bool, smoke: bool, cp_only: bool):
    """(name, backend, split, sharded step + args, one-GPU share step + args, share factor,
    unsharded step + args for memory or None)."""
    devices = np.array(jax.devices()[:n])
    out = []
    if not cp_only:
        out += _split_rows(n, devices, smoke)
    out += _cp_rows(n, devices, quick, smoke)
    return out


def _split_rows(n, devices, smoke):
    out = []
    small = "xla" if smoke else "small_seq"
    s_attn = 256 if smoke else 4096
    # Batch and head splits: b8 s4096 h16 d128 (the shape), each native backend.
    for label, attn, options in _split_backends(8, s_attn, smoke):
        args, call = _attention_case(8, s_attn, 16, 16, 128, attn, **options)
        for split, spec, axis in (("batch", P("dp"), "dp"), ("heads", P(None, None, "tp"), "tp")):
            mesh = jax.sharding.Mesh(devices, (axis,))
            sh = NamedSharding(mesh, spec)
            share = [x[: x.shape[0] // n] if split == "batch" else x[:, :, : x.shape[2] // n]
                     for x in args]
            if "score_mod_args" in options and split == "batch":  # the share's own id rows
                share_call = _attention_case(8 // n, s_attn, 16, 16, 128, attn, **dict(
                    options, score_mod_args=(options["score_mod_args"][0][: 8 // n],)))[1]
            else:
                share_call = call
            out.append((f"b8 s{s_attn} h16 d128 {label}, {split} split", attn, split,
                        (_step(call()), [jax.device_put(x, sh) for x in args]),
                        (_step(share_call()), share), 1.0, None))
    # Small-seq: 30720 tokens, 16 keys, h8 d128, tokens split.
    t, kv, h, d = (512 if smoke else 30720), 16, 8, 128
    lengths = jnp.asarray(np.random.default_rng(0).integers(1, kv + 1, size=t).astype(np.int32))
    ss_args = [_normal(0, (t, 1, h, d)), _normal(1, (t, kv, h, d)), _normal(2, (t, kv, h, d)),
               _normal(3, (t, 1, h, d))]

    def small_seq(lens):
        return lambda q, k, v: fusedattn.fused_attn_small_seq(q, k, v, sequence=lens,
                                                              backend=small)
    mesh = jax.sharding.Mesh(devices, ("dp",))
    sh, sh1 = NamedSharding(mesh, P("dp")), NamedSharding(mesh, P("dp"))
    out.append((f"small-seq {t} tokens kv{kv} h{h} d{d}, token split", small, "tokens",
                (_step(small_seq(jax.device_put(lengths, sh1))),
                 [jax.device_put(x, sh) for x in ss_args]),
                (_step(small_seq(lengths[: t // n])), [x[: t // n] for x in ss_args]), 1.0, None))
    return out


def _cp_rows(n, devices, quick, smoke):
    """Context parallelism: b1 h16 d128 causal, sequence split; the ring also with the
    tokens already in zig-zag order (reorder=False: no reordering moves)."""
    out = []
    attn = "xla" if smoke else "cudnn"
    lengths_cp = (1024,) if smoke else (32768,) if quick else (32768, 131072)
    mesh = jax.sharding.Mesh(devices, ("cp",))
    sh = NamedSharding(mesh, P(None, "cp"))
    for s in lengths_cp:
        args, call = _attention_case(1, s, 16, 16, 128, attn)
        variants = [("ring", True), ("ring", False)] + ([("allgather", True)] if s <= 32768 else [])
        for strategy, reorder in variants:
            cp = ContextParallel("cp", strategy=strategy, mesh=mesh, reorder=reorder)
            label = f"cp-{strategy}" + ("" if reorder else "-zigzag-inputs")
            out.append((f"b1 s{s} h16 d128 causal, context parallel", attn, label,
                        (_step(call(cp)), [jax.device_put(x, sh) for x in args]),
                        (_step(call()), args), 1.0 / n, (_step(call()), args)))
    # Documents (bench_block_sparse's lengths, scaled to the sequence) through the ring on
    # the block-sparse kernels: each step's map skips the blocks its shard hides.
    s = lengths_cp[0]
    label, backend, options = next(row for row in _split_backends(1, s, smoke)
                                   if row[0] == "documents")
    args, call = _attention_case(1, s, 16, 16, 128, backend, **options)
    cp = ContextParallel("cp", strategy="ring", mesh=mesh)
    out.append((f"b1 s{s} h16 d128 {label}, context parallel", backend, "cp-ring",
                (_step(call(cp)), [jax.device_put(x, sh) for x in args]),
                (_step(call()), args), 1.0 / n, (_step(call()), args)))
    return out


def bench(n: int, quick: bool, smoke: bool, cp_only: bool, only: str = ""):
    rows = []
    for name, backend, split, (fn, args), (share_fn, share_args), factor, full in \
            rows_to_run(n, quick, smoke, cp_only):
        if only not in f"{name}, {backend}":
            continue
        row = {"case": name, "backend": backend, "split": split, "devices": n}
        try:
            compiled = fn.lower(*args).compile()
            text = compiled.as_text()
            row.update({k: v for k, v in collectives(text).items() if v})
            mem = _memory(compiled)
            row["mem_per_device_GiB"] = mem["total"]
            row["mem_parts_GiB"] = {k: round(v, 3) for k, v in mem.items() if k != "total"}
            if full is not None:
                row["mem_unsharded_GiB"] = _memory(full[0].lower(*full[1]).compile())["total"]
                row["mem_ratio"] = row["mem_per_device_GiB"] / row["mem_unsharded_GiB"]
            long = "131072" in name
            times = time_interleaved({"sharded": (warmed(fn, *args), args),
                                      "share": (warmed(share_fn, *share_args), share_args)},
                                     rounds=3 if long else 7, min_round_s=0.0 if long else 0.025)
            row["sharded_ms"] = times["sharded"] * 1e3
            row["one_gpu_share_ms"] = times["share"] * 1e3 * factor
            row["efficiency"] = row["one_gpu_share_ms"] / row["sharded_ms"]
        except Exception as e:  # a row that cannot run says why and the others go on
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        print("  " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                               for k, v in row.items()), flush=True)
        rows.append(row)
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="context parallelism at 32k only")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, XLA backend, any device")
    parser.add_argument("--cp-only", action="store_true", help="context parallelism rows only")
    parser.add_argument("--only", default="", help="rows whose case or backend holds this")
    parser.add_argument("--tag", default="", help="suffix of the result file name")
    opts = parser.parse_args()
    n = len(jax.devices())
    if n < 2 or (jax.default_backend() not in ("gpu", "cuda") and not opts.smoke):
        print(f"bench_sharding: needs 2 or more GPUs ({n} {jax.default_backend()} device(s)), "
              f"skipped")
        return
    meta = device_meta()
    print(f"device {meta.get('device')} x{n}  jax {meta.get('jax')}  cuDNN {meta.get('cudnn')}",
          flush=True)
    rows = bench(n, opts.quick, opts.smoke, opts.cp_only, opts.only)
    print("\nefficiency = one GPU doing 1/n of the work / sharded step time (fwd+bwd, bf16)")
    print_table(rows, ["case", "backend", "split", "efficiency", "sharded_ms", "one_gpu_share_ms",
                       "all-gather", "all-reduce", "collective-permute", "mem_per_device_GiB",
                       "mem_ratio", "error"])
    device = device_slug(meta)
    meta.update({"dtype": "bfloat16", "devices": n,
                 "definition": "efficiency = (time of 1/n of the work on one GPU) / "
                               "(sharded step time); memory = XLA's plan per device "
                               "(arguments + outputs + temporaries)"})
    if opts.smoke:
        return
    meta["xla_flags"] = os.environ.get("XLA_FLAGS", "")
    path = write_results(f"sharding_{device}_x{n}{opts.tag}", rows, meta)
    print(f"wrote {path}")


if __name__ == "__main__":
    run_main(main)
