"""Head to head: fused_attn's auto and flash backends against flash-attn3-jax's own
`flash_mha` (the benchmark's FA3 anchor), forward+backward at b4 s4096 h16 d128 bf16,
causal and not, round-robin in one process with many rounds; and the compiled steps'
custom calls and fusions, written to $OUT (or build/) for a diff.

    python benchmarks/tune/flash_vs_anchor.py
"""
from __future__ import annotations

import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_attention import _fa3, _inputs  # noqa: E402
from common import step, time_interleaved, warmed  # noqa: E402

import fusedattn  # noqa: E402

B, S, H, D = 4, 4096, 16, 128
OUT = os.environ.get("OUT", "build")


def main():
    q, k, v, do = _inputs(B, S, H, H, D)
    fa3 = _fa3()
    for causal in (False, True):
        mask = "causal" if causal else "none"
        fns = {
            "auto": lambda q, k, v: fusedattn.fused_attn(q, k, v, mask=mask),
            "flash": lambda q, k, v: fusedattn.fused_attn(q, k, v, mask=mask, backend="flash"),
            "anchor": lambda q, k, v: fa3(q, k, v, is_causal=causal),
        }
        calls = {}
        for name, fn in fns.items():
            jitted, args = step(fn, "fwd+bwd", q, k, v, do)
            calls[name] = (warmed(jitted, *args), args)
            text = jitted.lower(*args).compile().as_text()
            with open(os.path.join(OUT, f"hlo_{name}_{mask}.txt"), "w") as f:
                f.write(text)
            ops = re.findall(r'custom_call_target="([^"]+)"', text)
            fusions = len(re.findall(r"= .*fusion\(", text))
            print(f"{mask} {name}: custom calls {ops}; fusions {fusions}", flush=True)
        flops = 3.5 * 4 * B * H * S * S * D / (2 if causal else 1)
        for rep in range(3):
            times = time_interleaved(calls, rounds=15)
            print(f"{mask} run {rep}: " + ", ".join(
                f"{n} {flops / t / 1e12:.1f} TFLOP/s ({t * 1e3:.3f} ms)"
                for n, t in times.items()), flush=True)


if __name__ == "__main__":
    main()
