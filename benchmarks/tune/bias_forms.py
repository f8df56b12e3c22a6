"""Which bias forms cuDNN's fused-attention engines take beside a causal mask (the
mask they skip tiles of), and what a bias costs there: support of the three graphs
for biases broadcast over the queries ([1|b, 1|h, 1, s_kv]); then plain causal beside
causal with a full [1, h, s, s] bias and with a [1, h, 1, s] one, round-robin in one
process. b4 s4096 h16 d128 bf16. Asked whether a causal score_mod's key-only terms
(what `fusedattn.flex_hoist` leaves of a relative position or ALiBi) could travel as
a bias to keep cuDNN's tile skipping (2026-11-24: the broadcast bias ran the causal
forward at 354 TFLOP/s against 522 plain, 1.07x torch's flex_attention: no). GPU.

    python benchmarks/tune/bias_forms.py
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_attention import _inputs  # noqa: E402
from common import print_table, run_main, step, time_row, warm_into  # noqa: E402

import jax.numpy as jnp  # noqa: E402

import fusedattn  # noqa: E402
from fusedattn import validation  # noqa: E402
from fusedattn.backends import cudnn, native  # noqa: E402
from fusedattn.config import AttnConfig  # noqa: E402

B, S, H, D = 4, 4096, 16, 128
FORMS = {  # name -> bias shape
    "full [1,h,s,s]": (1, H, S, S),
    "[1,h,1,s]": (1, H, 1, S),
    "[b,h,1,s]": (B, H, 1, S),
    "[1,1,1,s]": (1, 1, 1, S),
}


def main():
    module = native.module("cuda")
    for name, shape in FORMS.items():
        config = AttnConfig(batch=B, s_q=S, s_kv=S, h_q=H, h_kv=H, d_qk=D, d_v=D,
                            dtype="bfloat16", mask="causal", bias_shape=shape)
        r = module.cudnn_check_support(cudnn.graph_key(config))
        print(f"{name:28s} {'ok' if r['ok'] else r['message'].splitlines()[0][:200]}",
              flush=True)
    q, k, v, do = _inputs(B, S, H, H, D)
    bias = 0.01 * jnp.broadcast_to(jnp.arange(S, dtype=jnp.float32), (1, H, S, S))
    bias = bias.astype(jnp.bfloat16)
    causal = AttnConfig(batch=B, s_q=S, s_kv=S, h_q=H, h_kv=H, d_qk=D, d_v=D,
                        dtype="bfloat16", mask="causal")
    # A bias broadcast over the queries, through the API (its validation takes only
    # s_q rows today: widened here for the timing).
    validation._check_bias = lambda bias, *a: None if bias is None else tuple(bias.shape)
    key_bias = (0.01 * jnp.arange(S, dtype=jnp.float32)).astype(jnp.bfloat16)
    key_bias = jnp.broadcast_to(key_bias, (1, H, 1, S))
    rows = []
    for mode in ("fwd", "fwd+bwd"):
        row, calls = {"mode": mode}, {}
        for name, kw in (("plain causal", {}), ("causal + full bias", dict(bias=bias)),
                         ("causal + [1,h,1,s] bias", dict(bias=key_bias))):
            fn = lambda q, k, v, kw=kw: fusedattn.fused_attn(  # noqa: E731
                q, k, v, mask="causal", backend="cudnn", **kw)
            why = warm_into(calls, name, *step(fn, mode, q, k, v, do))
            if why:
                print(name, mode, why)
        time_row(row, calls, causal.flops(backward=mode == "fwd+bwd"))
        rows.append(row)
    print_table(rows, ["mode", "plain causal", "causal + full bias", "causal + [1,h,1,s] bias"])


if __name__ == "__main__":
    run_main(main)
