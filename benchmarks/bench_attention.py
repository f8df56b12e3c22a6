"""Attention throughput on one GPU, in one process: fusedattn (auto dispatch, which
measures cudnn against flash where both run a config, and its cuDNN backend) against
jax.nn.dot_product_attention (implementation="cudnn" and "xla") and flash-attn3-jax
when importable; forward and forward+backward, causal and not; TFLOP/s (causal
FLOPs halved), ratios to each anchor, the measured device ceilings, the first
graph build (wall time of the probe, which builds its three graphs at once, and
each graph's build time) and the cost of re-tracing a cached config.

    python -m benchmarks.bench_attention [--quick]

Writes benchmarks/results/attention_<device>.json and .png.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp

import fusedattn
from benchmarks.common import (RESULTS_DIR, device_meta, device_slug, measure_ceilings,
                               print_table, row_grid, run_main, step, time_row, warm_into,
                               write_results)
from fusedattn import plan_cache
from fusedattn.backends import cudnn
from fusedattn.config import AttnConfig

# (name, batch, seq, h_q, h_kv, head dim)
SHAPES = [
    ("b4 s4096 h16 d128", 4, 4096, 16, 16, 128),
    ("b1 s16384 h16 d128", 1, 16384, 16, 16, 128),
    ("b8 s4096 h16 d64", 8, 4096, 16, 16, 64),
    ("b4 s4096 h32/8 d128", 4, 4096, 32, 8, 128),
    ("b4 s4096 h16 d256", 4, 4096, 16, 16, 256),
]
QUICK = SHAPES[:1]
DTYPE = jnp.bfloat16
# Rows set providers that run the very same program side by side (auto beside
# flash-attn3 at d128, beside fusedattn-cudnn at d64 / d256). Timed with common.py's
# default 7 rounds of 25 ms, such pairs came out several percent apart
# (docs/decisions.md), so rows are timed longer.
TIMING = dict(rounds=15, min_round_s=0.05)
# jax.nn's XLA path materialises [b, h, s, s] logits; beyond this many it is skipped.
XLA_MAX_LOGITS = 2**31


def _fa3():
    try:
        from flash_attn3_jax import flash_mha
        return flash_mha
    except Exception:  # not installed, or no Hopper build: the anchor is omitted
        return None


def implementations(causal: bool):
    impls = {
        "fusedattn": lambda q, k, v: fusedattn.fused_attn(
            q, k, v, mask="causal" if causal else "none"),
        "fusedattn-cudnn": lambda q, k, v: fusedattn.fused_attn(
            q, k, v, mask="causal" if causal else "none", backend="cudnn"),
        "jax-cudnn": lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation="cudnn"),
        "jax-xla": lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation="xla"),
    }
    fa3 = _fa3()
    if fa3 is not None:
        impls["flash-attn3"] = lambda q, k, v: fa3(q, k, v, is_causal=causal)
    return impls


def _inputs(b, s, hq, hkv, d, seed=0):
    key = jax.random.PRNGKey(seed)
    ks = jax.random.split(key, 4)
    q = jax.random.normal(ks[0], (b, s, hq, d), DTYPE)
    k = jax.random.normal(ks[1], (b, s, hkv, d), DTYPE)
    v = jax.random.normal(ks[2], (b, s, hkv, d), DTYPE)
    do = jax.random.normal(ks[3], (b, s, hq, d), DTYPE)
    return q, k, v, do


def first_build_seconds(b, s, hq, hkv, d) -> dict:
    """The first support probe of a fresh config: its wall time (the three graphs build
    concurrently), as seen from Python and inside the extension, and each graph's own
    build time."""
    cfg = AttnConfig(batch=b, s_q=s, s_kv=s, h_q=hq, h_kv=hkv, d_qk=d, d_v=d,
                     dtype="bfloat16", scale=d ** -0.5)
    plan_cache.set_enabled(False)  # a cold build (bench_first_call.py times the stored plans)
    try:
        t0 = time.perf_counter()
        probe = cudnn.probe(cfg)
        wall = time.perf_counter() - t0
    finally:
        plan_cache.set_enabled(None)
    graphs = dict(zip(cudnn.GRAPHS, probe.build_seconds))
    return {"first_probe_s": wall, "probe_wall_s": probe.wall_seconds,
            "graphs_build_s": graphs, "graphs_build_sum_s": sum(graphs.values()),
            "ok": probe.ok, "message": probe.message}


def retrace_ms(fn, args, n=30) -> float:
    """Median wall time of tracing + lowering a fresh jit of `fn` (config already cached)."""
    times = []
    for _ in range(n):
        f = jax.jit(lambda *a: fn(*a))
        t0 = time.perf_counter()
        f.trace(*args)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def bench(shapes):
    rows = []
    for name, b, s, hq, hkv, d in shapes:
        q, k, v, do = _inputs(b, s, hq, hkv, d)
        for row, mode, cfg, flops in row_grid(name, b, s, hq, hkv, d):
            calls = {}
            for impl, fn in implementations(cfg.causal).items():
                if impl == "jax-xla" and b * hq * s * s > XLA_MAX_LOGITS:
                    row[impl] = None
                    row[impl + "_note"] = "skipped: materialises b*h*s*s logits"
                    continue
                why = warm_into(calls, impl, *step(fn, mode, q, k, v, do))
                if why is not None:  # an anchor that cannot run this shape
                    row[impl], row[impl + "_note"] = None, why
            time_row(row, calls, flops, **TIMING)
            ours = row.get("fusedattn")
            for anchor in ("jax-cudnn", "jax-xla", "flash-attn3"):
                if ours and row.get(anchor):
                    row[f"x {anchor}"] = ours / row[anchor]
            best = max((row.get(a) or 0 for a in ("jax-cudnn", "flash-attn3")), default=0)
            if ours and best:
                row["x best anchor"] = ours / best
            plan = fusedattn.explain(q, k, v, mask=cfg.mask)
            choice = plan.rivals.choice("inference" if mode == "fwd" else "training") \
                if plan.rivals else None
            row["auto_chose"] = choice.backend if choice else plan.chosen
            row["auto_timings_ms"] = choice.timings if choice else None
            rows.append(row)
            print(f"  {name} causal={cfg.causal} {mode}: " + ", ".join(
                f"{i}={row.get(i) and round(row[i])}" for i in implementations(cfg.causal)),
                flush=True)
    return rows


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    impls = [i for i in ("fusedattn", "fusedattn-cudnn", "jax-cudnn", "jax-xla", "flash-attn3")
             if any(r.get(i) for r in rows)]
    fig, axes = plt.subplots(2, 1, figsize=(14, 9))
    for ax, mode in zip(axes, ("fwd", "fwd+bwd")):
        sub = [r for r in rows if r["mode"] == mode]
        labels = [f"{r['shape']}{' causal' if r['causal'] else ''}" for r in sub]
        width = 0.8 / len(impls)
        for n, impl in enumerate(impls):
            xs = [i + n * width for i in range(len(sub))]
            ax.bar(xs, [r.get(impl) or 0 for r in sub], width, label=impl)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(sub))])
        ax.set_xticklabels(labels, rotation=25, ha="right", fontsize=8)
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"attention {mode}, bf16")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="first shape only")
    args = parser.parse_args()
    if jax.default_backend() != "gpu" and "cuda" not in str(jax.devices()[0]).lower():
        print("bench_attention: needs a CUDA GPU, skipped")
        return
    meta = device_meta()
    print(f"device {meta.get('device')}  jax {meta.get('jax')}  cuDNN {meta.get('cudnn')}  "
          f"frontend {meta.get('cudnn_frontend')}", flush=True)
    build = first_build_seconds(4, 4096, 16, 16, 128)
    print(f"first graph build (3 graphs, fresh config): {build}", flush=True)
    ceilings = measure_ceilings()
    print(f"ceilings: {ceilings}", flush=True)

    q, k, v, _ = _inputs(4, 4096, 16, 16, 128)
    retrace = {
        "fusedattn-cudnn_ms": retrace_ms(
            lambda q, k, v: fusedattn.fused_attn(q, k, v, backend="cudnn"), (q, k, v)),
        "jax-cudnn_ms": retrace_ms(
            lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn"),
            (q, k, v)),
    }
    # What fusedattn adds to a trace (validation, dispatch, probe cache, FFI binding).
    retrace["overhead_vs_jax_cudnn_ms"] = retrace["fusedattn-cudnn_ms"] - retrace["jax-cudnn_ms"]
    print(f"re-trace of a cached config: {retrace}", flush=True)

    rows = bench(QUICK if args.quick else SHAPES)
    cols = ["shape", "causal", "mode", "fusedattn", "auto_chose", "fusedattn-cudnn", "jax-cudnn",
            "jax-xla", "flash-attn3", "x jax-cudnn", "x flash-attn3", "x best anchor"]
    print("\nTFLOP/s (bf16; causal FLOPs halved) and ratios fusedattn (auto) / anchor")
    print_table(rows, cols)
    print(f"\nceilings: copy {ceilings['copy_GBps']:.0f} GB/s, bf16 matmul "
          f"{ceilings['bf16_matmul_TFLOPs']:.0f} TFLOP/s")
    split = ", ".join(f"{g} {t:.3f}" for g, t in build["graphs_build_s"].items())
    print(f"first graph build: {build['first_probe_s']:.3f} s wall (3 graphs at once; "
          f"each: {split} s); "
          f"re-trace: fusedattn {retrace['fusedattn-cudnn_ms']:.3f} ms, "
          f"jax.nn cudnn {retrace['jax-cudnn_ms']:.3f} ms "
          f"(added by fusedattn: {retrace['overhead_vs_jax_cudnn_ms']:.3f} ms)")
    device = device_slug(meta)
    name = f"attention_{device}"
    meta.update({"ceilings": ceilings, "first_build": build, "retrace": retrace,
                 "dtype": "bfloat16"})
    path = write_results(name, rows, meta)
    plot(rows, os.path.join(RESULTS_DIR, name + ".png"))
    print(f"wrote {path} and {name}.png")


if __name__ == "__main__":
    run_main(main)
