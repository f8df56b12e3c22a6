"""Why query chunks of a causal score_mod run their tiles slower than one call: each
call of a chunk's shape timed alone, round-robin in one process, at the rate of the
tiles it computes (every tile of a masked program: cuDNN skips none). b4 h16 d128
bf16, forward and forward+backward TFLOP/s. GPU.

    python benchmarks/tune/chunk_cost.py
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_attention import _inputs  # noqa: E402
from common import fwd_bwd, print_table, run_main, time_interleaved, warmed  # noqa: E402

import jax  # noqa: E402

import fusedattn  # noqa: E402

B, H, D = 4, 16, 128


def relpos(s, b, h, q, k):
    return s + 0.01 * (q - k)


# name -> (batch, s_q, s_kv, fused_attn keyword arguments, tiles computed / s_q*s_kv)
FORMS = {
    "plain s4096": (B, 4096, 4096, {}, 1.0),
    "plain s1024": (B, 1024, 1024, {}, 1.0),
    "plain b16 s1024": (4 * B, 1024, 1024, {}, 1.0),
    "plain causal s4096": (B, 4096, 4096, dict(mask="causal"), 0.5),
    "relpos s4096": (B, 4096, 4096, dict(score_mod=relpos), 1.0),
    "relpos sq1024 skv4096": (B, 1024, 4096, dict(score_mod=relpos), 1.0),
    "relpos sq1024 skv1024": (B, 1024, 1024, dict(score_mod=relpos), 1.0),
    "relpos b16 s1024": (4 * B, 1024, 1024, dict(score_mod=relpos), 1.0),
    "relpos causal-br sq1024 skv4096": (B, 1024, 4096, dict(score_mod=relpos,
                                                           mask="causal_bottom_right"), 1.0),
    "relpos causal-br sq1024 skv1024": (B, 1024, 1024, dict(score_mod=relpos,
                                                           mask="causal_bottom_right"), 1.0),
    "relpos causal s4096 (4 chunks)": (B, 4096, 4096, dict(score_mod=relpos, mask="causal"),
                                       5 / 8),
}


def main():
    rows = []
    for mode in ("fwd", "fwd+bwd"):
        calls, flops = {}, {}
        for name, (b, sq, skv, kw, tiles) in FORMS.items():
            q, _, _, do = _inputs(b, sq, H, H, D)
            _, k, v, _ = _inputs(b, skv, H, H, D, seed=1)
            fn = lambda q, k, v, kw=kw: fusedattn.fused_attn(q, k, v, backend="cudnn", **kw)  # noqa
            f, args = (jax.jit(fn), (q, k, v)) if mode == "fwd" else (fwd_bwd(fn), (q, k, v, do))
            calls[name] = (warmed(f, *args), args)
            flops[name] = 4.0 * b * H * sq * skv * D * tiles * (1.0 if mode == "fwd" else 3.5)
        times = time_interleaved(calls)
        rows.append({"mode": mode, **{n: flops[n] / t / 1e12 for n, t in times.items()},
                     **{n + " us": t * 1e6 for n, t in times.items()}})
    print("TFLOP/s of the tiles each call computes")
    for row in rows:
        for name in FORMS:
            print(f"{row['mode']:8s} {name:34s} {row[name]:7.0f}  {row[name + ' us']:8.0f} us")
    print_table(rows, ["mode"] + list(FORMS))


if __name__ == "__main__":
    run_main(main)
