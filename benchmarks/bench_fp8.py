"""FP8 attention on one GPU, in one process, round-robin (benchmarks/common.py).

Rows at b4 s4096 h16 d128, causal and not, forward and forward+backward:
  fusedattn-fp8         fused_attn(..., precision="fp8"): bf16 in and out, current
                        scaling (amax, quantize, dequantize) inside the same jit
  fusedattn-fp8-kernel  fusedattn.fp8.attention on FP8 tensors with given scales, FP8
                        out (the kernels alone, as a delayed-scaling loop runs them)
  fusedattn-cudnn       our BF16 path
  jax-cudnn             jax.nn.dot_product_attention(implementation="cudnn"), BF16
  flash-attn3           flash-attn3-jax, BF16 (when importable)
  cudnn-fe-fp8          cudnn-frontend's own Python graph of sdpa_fp8 (forward; the
                        ceiling), when its bindings load

    python -m benchmarks.bench_fp8 [--quick]

Writes benchmarks/results/fp8_<device>.json.
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import fusedattn
from benchmarks.bench_attention import _inputs
from benchmarks.bench_attention import implementations as bf16_implementations
from benchmarks.common import (device_meta, device_slug, print_table, row_grid, run_main, step,
                               time_row, warm_into, write_results)
from fusedattn import fp8

SHAPE = ("b4 s4096 h16 d128", 4, 4096, 16, 16, 128)


def _explicit(causal: bool, scales):
    def run(q8, k8, v8):
        return fp8.attention(q8, k8, v8, scales, mask="causal" if causal else "none",
                             backend="cudnn")[0]
    return run


def implementations(causal: bool):
    """The BF16 providers of bench_attention (its XLA row aside: too slow to matter here)
    and fused_attn(precision="fp8")."""
    mask = "causal" if causal else "none"
    impls = {"fusedattn-fp8": lambda q, k, v: fusedattn.fused_attn(
        q, k, v, mask=mask, precision="fp8", backend="cudnn")}
    impls.update((name, fn) for name, fn in bf16_implementations(causal).items()
                 if name != "jax-xla")
    return impls


def explicit_inputs(q, k, v, do):
    """(scales, (q8, k8, v8, do8)): what the explicit FP8 kernels (`fp8.attention`) run on,
    as a delayed-scaling loop would hold them: q, k, v, d_out quantized with scales from
    their amaxes, the gradients' and dP's scales 1."""
    scales, _ = fp8.forward_scales(q, k, v)
    scales = scales._replace(do=fp8.scale_for(fp8.amax(do)), dq=jnp.float32(1.0),
                             dk=jnp.float32(1.0), dv=jnp.float32(1.0), dp=jnp.float32(1.0))
    return scales, tuple(fp8.quantize(x, s) for x, s in (
        (q, scales.q), (k, scales.k), (v, scales.v), (do, scales.do)))


def bench(shape):
    name, b, s, hq, hkv, d = shape
    q, k, v, do = _inputs(b, s, hq, hkv, d)
    scales, (q8, k8, v8, do8) = explicit_inputs(q, k, v, do)
    rows, notes = [], {}
    for row, mode, cfg, flops in row_grid(name, b, s, hq, hkv, d):
        causal = cfg.causal
        calls = {}
        impls = dict(implementations(causal))
        impls["fusedattn-fp8-kernel"] = _explicit(causal, scales)
        for impl, fn in impls.items():
            tensors = (q8, k8, v8, do8) if impl == "fusedattn-fp8-kernel" else (q, k, v, do)
            why = warm_into(calls, impl, *step(fn, mode, *tensors))
            if why is not None:
                row[impl], notes[f"{impl} {mode}"] = None, why
        if mode == "fwd":
            try:
                from benchmarks.cudnn_graphs import Graph, RawCall  # noqa: PLC0415 - optional bindings
                raw = RawCall(Graph(b, s, hq, d, causal, fp8=True, qko_layout="bshd",
                                    v_layout="bshd", stats=False, random=False,
                                    modes=("A", "FALLBACK")))
            except Exception as e:  # noqa: BLE001 - no cudnn-frontend Python bindings
                notes["cudnn-fe-fp8"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            else:
                why = warm_into(calls, "cudnn-fe-fp8", raw, ())
                if why is not None:
                    notes["cudnn-fe-fp8"] = why
        time_row(row, calls, flops)
        for ours in ("fusedattn-fp8", "fusedattn-fp8-kernel"):
            for anchor in ("fusedattn-cudnn", "jax-cudnn", "flash-attn3", "cudnn-fe-fp8"):
                if row.get(ours) and row.get(anchor):
                    row[f"{ours} x {anchor}"] = row[ours] / row[anchor]
        rows.append(row)
        print(f"  causal={causal} {mode}: " + ", ".join(
            f"{i}={round(row[i])}" for i in row if not i.endswith("_ms") and " x " not in i
            and isinstance(row[i], float)), flush=True)
    return rows, notes


def main():
    argparse.ArgumentParser().parse_args()
    if jax.default_backend() != "gpu":
        print("bench_fp8: needs a CUDA GPU, skipped")
        return
    meta = device_meta()
    print(f"device {meta.get('device')}  jax {meta.get('jax')}  cuDNN {meta.get('cudnn')}  "
          f"frontend {meta.get('cudnn_frontend')}", flush=True)
    rows, notes = bench(SHAPE)
    cols = ["shape", "causal", "mode", "fusedattn-fp8", "fusedattn-fp8-kernel", "fusedattn-cudnn",
            "jax-cudnn", "flash-attn3", "cudnn-fe-fp8", "fusedattn-fp8 x fusedattn-cudnn",
            "fusedattn-fp8-kernel x fusedattn-cudnn", "fusedattn-fp8-kernel x cudnn-fe-fp8"]
    print("\nTFLOP/s (causal FLOPs halved; FP8 rows count the same FLOPs)")
    print_table(rows, cols)
    for k, v in notes.items():
        print(f"note: {k}: {v}")
    meta.update({"notes": notes, "shape": SHAPE[0]})
    path = write_results(f"fp8_{device_slug(meta)}", rows, meta)
    print(f"wrote {path}")


if __name__ == "__main__":
    run_main(main)
