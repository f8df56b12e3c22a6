"""Which pointwise operations cuDNN's fused-attention engines accept inside a score_mod
(forward) and a score_mod_bprop (backward) on this GPU: builds the three graphs of a
b2 s256 h4 d64 bf16 config per probe program and prints ok / the first line of
cuDNN's refusal. Informs flex_lowering's choices; needs a GPU.

    python benchmarks/tune/flex_ops.py
"""
from __future__ import annotations

from fusedattn.backends import cudnn, native
from fusedattn.config import AttnConfig

BASE = AttnConfig(batch=2, s_q=256, s_kv=256, h_q=4, h_kv=4, d_qk=64, d_v=64, dtype="bfloat16",
                  scale=0.125)
PROBES = {  # name -> (forward program, bprop program)
    "identity": ("id:s", "id:g"),
    "relpos": ("sub:q,k|add:s,v0", "id:g"),
    "causal-sel": ("le:k,q|sel:v0,s,c-inf", "id:g"),
    "causal-sel-bprop-sel": ("le:k,q|sel:v0,s,c-inf", "le:k,q|sel:v0,g,c0.0"),
    "bprop-uses-score": ("tanh:s", "tanh:s|mul:v0,v0|sub:c1.0,v1|mul:g,v2"),
    "floor": ("div:q,c64.0|floor:v0|div:k,c64.0|floor:v2|eq:v1,v3|sel:v4,s,c-inf", "id:g"),
    "ceil": ("div:q,c64.0|ceil:v0|add:s,v1", "id:g"),
    "mod": ("mod:q,c3.0|eq:v0,c0.0|sel:v1,s,c-inf", "id:g"),
    "and-or": ("le:k,q|lt:k,c8.0|or:v0,v1|sel:v2,s,c-inf", "id:g"),
    "sel-float-branches": ("lt:s,c0.0|sel:v0,c1.0,c2.0|mul:s,v1", "lt:s,c0.0|sel:v0,c1.0,c2.0|mul:g,v1"),
    "sigmoid": ("sigmoid:s|mul:s,v0", "id:g"),
    "log-abs": ("sub:q,k|abs:v0|add:v1,c1.0|log:v2|sub:s,v3", "id:g"),
}


def main():
    module = native.module("cuda")
    for name, (fwd, bwd) in PROBES.items():
        key = cudnn.graph_key(BASE).replace("flex=;flexb=;", f"flex={fwd};flexb={bwd};")
        r = module.cudnn_check_support(key)
        msg = "ok" if r["ok"] else r["message"].splitlines()[0][:160]
        print(f"{name:24s} {msg}", flush=True)


if __name__ == "__main__":
    main()
