"""Do two jitted calls of the very same program time alike? bench_attention rows set
auto beside backend="cudnn" at d256, where both lower to identical HLO, yet they came
out up to 8% apart. Here each name given builds its own jitted step (in the order
given, in this fresh process), and all are timed round-robin as the benchmark does.

    python benchmarks/tune/same_program.py fwd|fwd+bwd auto cudnn cudnn   (b4 s4096 h16 d256 causal)
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_attention import TIMING, _inputs  # noqa: E402
from common import run_main, step, time_interleaved, warm_into  # noqa: E402

import fusedattn  # noqa: E402


def main():
    mode, names = sys.argv[1], sys.argv[2:]
    q, k, v, do = _inputs(4, 4096, 16, 16, 256)
    calls = {}
    for i, name in enumerate(names):
        fn = lambda q, k, v, b=name: fusedattn.fused_attn(q, k, v, mask="causal", backend=b)  # noqa: E731
        why = warm_into(calls, f"{i} {name}", *step(fn, mode, q, k, v, do))
        assert why is None, why
    for repeat in range(3):
        times = time_interleaved(calls, **TIMING)
        print(f"{mode} repeat {repeat}: " + ", ".join(f"{n} {t * 1e3:.3f} ms"
                                                     for n, t in times.items()), flush=True)


if __name__ == "__main__":
    run_main(main)
