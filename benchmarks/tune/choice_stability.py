"""How stable is auto dispatch's measured choice between cudnn and flash? Measures
b4 s4096 h16 d128 bf16, causal and not, three times each with
`backend_choice.measure_on_device`, then times the same two backends the way the
benchmarks do (round-robin, 7 rounds, median), and prints both. Needs a Hopper GPU
with flash-attn3-jax.

    python -m benchmarks.tune.choice_stability
"""
from __future__ import annotations

import fusedattn
from benchmarks.bench_attention import _inputs
from benchmarks.common import run_main, step, time_interleaved, warm_into
from fusedattn.dispatch import measure as backend_choice
from fusedattn.config import AttnConfig

B, S, H, D = 4, 4096, 16, 128


def main():
    q, k, v, do = _inputs(B, S, H, H, D)
    for mask in ("none", "causal"):
        cfg = AttnConfig(batch=B, s_q=S, s_kv=S, h_q=H, h_kv=H, d_qk=D, d_v=D,
                         dtype="bfloat16", mask=mask)
        for i in range(3):
            for what in backend_choice.STEPS:
                t = backend_choice.measure_on_device(cfg, ("cudnn", "flash"), what)
                print(f"{mask} measure {i} {what}: " + ", ".join(
                    f"{n} {s * 1e3:.3f} ms" for n, s in t), flush=True)
        for mode in ("fwd", "fwd+bwd"):
            calls = {}
            for name in ("cudnn", "flash"):
                fn = lambda q, k, v, n=name: fusedattn.fused_attn(q, k, v, mask=mask, backend=n)  # noqa: E731
                warm_into(calls, name, *step(fn, mode, q, k, v, do))
            times = time_interleaved(calls)
            print(f"{mask} {mode} benchmark: " + ", ".join(
                f"{n} {t * 1e3:.3f} ms" for n, t in times.items()), flush=True)


if __name__ == "__main__":
    run_main(main)
