"""What a lowered score_mod costs cuDNN: b4 s4096 h16 d128 bf16, non-causal, the plain
call beside score_mods of growing size (one multiply; one index and two ops; the
relative position of bench_flex: two indices, three ops, unless its query term
leaves the program, `fusedattn.flex_hoist`; softcaps: one tanh, a lambda dividing or
multiplying by the cap, the built-in form), round-robin in one process, forward
and forward+backward TFLOP/s. GPU.

    python benchmarks/tune/score_mod_cost.py
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_attention import _inputs  # noqa: E402
from common import print_table, run_main, step, time_row, warm_into  # noqa: E402

import jax.numpy as jnp  # noqa: E402

import fusedattn  # noqa: E402
from fusedattn import score_mods  # noqa: E402
from fusedattn.config import AttnConfig  # noqa: E402

B, S, H, D = 4, 4096, 16, 128

FORMS = {  # name -> score_mod (None: the plain call)
    "plain": None,
    "s * 1.5": lambda s, b, h, q, k: s * 1.5,
    "s + 0.01 k": lambda s, b, h, q, k: s + 0.01 * k,
    "s + 0.01 (q - k)": lambda s, b, h, q, k: s + 0.01 * (q - k),
    "s + per-head h": lambda s, b, h, q, k: s + 0.01 * h,
    "tanh(s)": lambda s, b, h, q, k: jnp.tanh(s),
    "30 tanh(s / 30)": lambda s, b, h, q, k: 30.0 * jnp.tanh(s / 30.0),
    "30 tanh(s * (1/30))": lambda s, b, h, q, k: 30.0 * jnp.tanh(s * (1 / 30.0)),
    "built-in softcap(30)": score_mods.softcap(30.0),
}


def main():
    q, k, v, do = _inputs(B, S, H, H, D)
    cfg = AttnConfig(batch=B, s_q=S, s_kv=S, h_q=H, h_kv=H, d_qk=D, d_v=D, dtype="bfloat16")
    rows = []
    for mode in ("fwd", "fwd+bwd"):
        row = {"mode": mode}
        calls = {}
        for name, mod in FORMS.items():
            fn = lambda q, k, v, mod=mod: fusedattn.fused_attn(  # noqa: E731
                q, k, v, backend="cudnn", score_mod=mod)
            why = warm_into(calls, name, *step(fn, mode, q, k, v, do))
            if why is not None:
                print(f"{name} {mode}: {why}", flush=True)
        for _ in range(2):
            time_row(row, calls, cfg.flops(backward=mode == "fwd+bwd"))
            print({n: round(row[n]) for n in FORMS if n in row}, flush=True)
        rows.append(row)
    print_table(rows, ["mode"] + list(FORMS))


if __name__ == "__main__":
    run_main(main)
