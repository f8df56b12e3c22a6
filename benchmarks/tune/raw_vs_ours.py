"""Where do our cuDNN calls lose against cudnn-frontend's own graph of the same shape?

One process, one timing method (benchmarks/common.py's wall-clock rounds, round-robin):
cudnn-frontend's Python graphs (cudnn_graphs.Graph, cupy buffers, the heuristics' first
plan) beside fused_attn's forward (bf16 and precision="fp8"), fp8.attention on FP8
tensors, and jax.nn's cuDNN. Prints the compiled HLO's ops of our calls, so an extra
kernel around the custom call shows, and the plan each of our graphs ran.

    python benchmarks/tune/raw_vs_ours.py
"""
from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from common import time_interleaved, warmed  # noqa: E402
from cudnn_graphs import Graph, RawCall  # noqa: E402

import fusedattn  # noqa: E402
from fusedattn import fp8  # noqa: E402

B, S, H, D = 4, 4096, 16, 128


def hlo_ops(fn, *args):
    text = jax.jit(fn).lower(*args).compile().as_text()
    ops = [line.split("=")[1].split("(")[0].strip().split(" ")[-1]
           for line in text.splitlines() if " = " in line and "ENTRY" not in line]
    calls = [line.split("custom_call_target=")[1].split(",")[0]
             for line in text.splitlines() if "custom_call_target=" in line]
    return sorted(set(ops)), calls


def main():
    key = jax.random.PRNGKey(0)
    q, k, v = (jax.random.normal(jax.random.fold_in(key, i), (B, S, H, D), jnp.bfloat16)
               for i in range(3))
    scales, _ = fp8.forward_scales(q, k, v)
    q8, k8, v8 = (fp8.quantize(x, s) for x, s in ((q, scales.q), (k, scales.k), (v, scales.v)))
    for causal in (False, True):
        mask = "causal" if causal else "none"
        ours = {
            "ours bf16": (lambda q, k, v: fusedattn.fused_attn(q, k, v, mask=mask,
                                                               backend="cudnn"), (q, k, v)),
            "ours precision=fp8": (lambda q, k, v: fusedattn.fused_attn(
                q, k, v, mask=mask, precision="fp8", backend="cudnn"), (q, k, v)),
            "ours fp8 kernel": (lambda a, b, c: fp8.attention(a, b, c, scales, mask=mask,
                                                              backend="cudnn")[0], (q8, k8, v8)),
            "jax.nn cudnn": (lambda q, k, v: jax.nn.dot_product_attention(
                q, k, v, is_causal=causal, implementation="cudnn"), (q, k, v)),
        }
        calls = {}
        for name, (fn, args) in ours.items():
            ops, targets = hlo_ops(fn, *args)
            print(f"causal={causal} {name}: ops {ops} custom calls {targets}")
            calls[name] = (warmed(jax.jit(fn), *args), args)
        for name, fp8_, stats in (("raw fe bf16 stats", False, True),
                                  ("raw fe fp8 stats", True, True),
                                  ("raw fe fp8 nostats", True, False)):
            g = Graph(B, S, H, D, causal, fp8_, "bshd", "bshd", stats, True, modes=("A",))
            calls[f"{name} {g.plans[0][1]}"] = (warmed(RawCall(g)), ())
        for precision in ("default", "fp8"):
            print(fusedattn.explain(q, k, v, mask=mask, precision=precision, backend="cudnn"))
        flops = 4 * B * H * S * S * D / (2 if causal else 1)
        for name, sec in time_interleaved(calls).items():
            print(f"  {flops / sec / 1e12:7.1f} TFLOP/s  {sec * 1e3:.3f} ms  {name}")


if __name__ == "__main__":
    main()
