"""Which pointwise operations cuDNN's fused-attention engines accept inside a score_mod
(forward) and a score_mod_bprop (backward) on this GPU: builds the three graphs of a
b2 s256 h4 d64 bf16 config per probe program and prints ok / the first line of
cuDNN's refusal. Informs flex_lowering's choices; needs a GPU.

    python -m benchmarks.tune.flex_ops
"""
from __future__ import annotations

from fusedattn.backends import cudnn
from fusedattn.backends import extension as native
from fusedattn.config import AttnConfig

BASE = AttnConfig(batch=2, s_q=256, s_kv=256, h_q=4, h_kv=4, d_qk=64, d_v=64, dtype="bfloat16",
                  scale=0.125)
SOFTCAP = "div:s,c30.0|tanh:v0|mul:c30.0,v1"
PROBES = {  # name -> (forward program, bprop program)
    "identity": ("id:s", "id:g"),
    "relpos": ("sub:q,k|add:s,v0", "id:g"),
    "causal-sel": ("le:k,q|sel:v0,s,c-inf", "id:g"),
    "lt-idx": ("lt:k,q|sel:v0,s,c-inf", "id:g"),
    "eq-idx": ("eq:k,q|sel:v0,s,c-inf", "id:g"),
    "ne-idx": ("ne:k,q|sel:v0,s,c-inf", "id:g"),
    "cmp-score": ("lt:s,c0.0|sel:v0,s,c-inf", "id:g"),
    "nested-sel (and)": ("le:k,q|sel:v0,s,c-inf|ge:k,c4.0|sel:v2,v1,c-inf", "id:g"),
    "max-of-sels (or)": ("le:k,q|sel:v0,s,c-inf|lt:k,c8.0|sel:v2,s,c-inf|max:v1,v3", "id:g"),
    "logical-and": ("le:k,q|ge:k,c4.0|and:v0,v1|sel:v2,s,c-inf", "id:g"),
    "floor-only": ("div:q,c64.0|floor:v0|add:s,v1", "id:g"),
    "ceil-only": ("div:q,c64.0|ceil:v0|add:s,v1", "id:g"),
    "mod-only": ("mod:q,c3.0|add:s,v0", "id:g"),
    "sel-consts": ("le:k,q|sel:v0,c1.0,c0.0|add:s,v1", "id:g"),
    "per-head-input": ("add:s,a0", "id:g", "1.4.1.1"),
    "per-batch-input": ("add:s,a0", "id:g", "2.1.1.1"),
    "bprop-reads-score": ("tanh:s", "tanh:s|mul:v0,v0|sub:c1.0,v1|mul:g,v2"),
    "bprop-reads-forward": ("div:s,c30.0|tanh:v0|mul:c30.0,v1", "mul:w1,w1|sub:c1.0,v0|mul:g,v1"),
    "bprop-reads-fwd-id": ("id:s|mul:v0,c2.0", "mul:g,c2.0|mul:v0,w0"),
    "sigmoid": ("sigmoid:s|mul:s,v0", "id:g"),
    "log-abs": ("sub:q,k|abs:v0|add:v1,c1.0|log:v2|sub:s,v3", "id:g"),
    # Index offsets from scalar inputs (causal chunks, context-parallel blocks).
    "offset-q": ("add:q,a0|sub:v0,k|mul:v1,c0.01|add:s,v2", "id:g", "1.1.1.1"),
    "offset-q-input-first": ("add:a0,q|sub:v0,k|mul:v1,c0.01|add:s,v2", "id:g", "1.1.1.1"),
    "causal-bottom-right-const": ("add:q,c128.0|le:k,v0|sel:v1,s,c-inf", "id:g"),
    "offset-causal": ("add:q,a0|add:k,a1|le:v1,v0|sel:v2,s,c-inf", "id:g", "1.1.1.1", "1.1.1.1"),
    "split-sel-of-inputs": ("lt:q,a0|sel:v0,a1,a2|add:q,v1|sub:v2,k|mul:v3,c0.01|add:s,v4",
                            "id:g", "1.1.1.1", "1.1.1.1", "1.1.1.1"),
    "split-arith": ("ge:q,a0|sel:v0,c1.0,c0.0|mul:v1,a1|add:q,a2|add:v3,v2|sub:v4,k|"
                    "mul:v5,c0.01|add:s,v6", "id:g", "1.1.1.1", "1.1.1.1", "1.1.1.1"),
    # Per-head masks (a [1, h, 1, 1] input joined with the indices).
    "head-input-or": ("le:k,q|or:a0,v0|sel:v1,s,c-inf", "id:g", "1.4.1.1"),
    "head-input-or-swapped": ("le:k,q|or:v0,a0|sel:v1,s,c-inf", "id:g", "1.4.1.1"),
    "head-window": ("sub:q,k|lt:v0,a0|sel:v1,s,c-inf", "id:g", "1.4.1.1"),
    # The forms of cuDNN's own masks (the frontend's diagonal band mask): row >= col,
    # and offsets added in int32 (".i") to the int32 indices.
    "causal-ge": ("ge:q,k|sel:v0,s,c-inf", "id:g"),
    "relpos-causal-ge": ("sub:q,k|mul:v0,c0.01|add:s,v1|ge:q,k|sel:v3,v2,c-inf", "id:g"),
    "causal-bottom-right-int": ("add.i:q,c128|ge:v0,k|sel:v1,s,c-inf", "id:g"),
    "window-left-int": ("add.i:k,c49|gt:v0,q|sel:v1,s,c-inf", "id:g"),
    "causal-window-int": ("ge:q,k|sel:v0,s,c-inf|add.i:k,c49|gt:v2,q|sel:v3,v1,c-inf", "id:g"),
    "relpos-causal-br-int": ("sub:q,k|mul:v0,c0.01|add:s,v1|add.i:q,c128|ge:v3,k|"
                             "sel:v4,v2,c-inf", "id:g"),
    "offset-causal-int": ("add.i:q,a0|add.i:k,a1|ge:v0,v1|sel:v2,s,c-inf", "id:g", "1.1.1.1",
                          "1.1.1.1"),
    "offset-q-int": ("add.i:q,a0|ge:v0,k|sel:v1,s,c-inf", "id:g", "1.1.1.1"),
    "doc-mask-int-div": ("div.i:q,c64|div.i:k,c64|eq:v0,v1|sel:v2,s,c-inf", "id:g"),
    "relpos-int-sub": ("sub.i:q,k|mul:v0,c0.01|add:s,v1", "id:g"),
    "offset-causal-int-inputs": ("add.i:q,a0|add.i:k,a1|ge:v0,v1|sel:v2,s,c-inf", "id:g",
                                 "1.1.1.1i", "1.1.1.1i"),
    "window-both-lowered": ("add.i:q,c32|ge:v0,k|add.i:k,c65|gt:v2,q|sel:v1,s,c-inf|"
                            "sel:v3,v4,c-inf", "id:g"),
    "per-batch-int-length": ("lt:k,a0|sel:v0,s,c-inf", "id:g", "2.1.1.1i"),
    # Nonlinear bprops through cuDNN's own derivative ops (dy, x) -> dy * f'(x).
    "softcap-tanh-bwd-g-first": (SOFTCAP, "mul:g,c30.0|tanh_bwd:v0,w0|div:v1,c30.0"),
    "softcap-tanh-bwd-g": (SOFTCAP, "tanh_bwd:g,w0"),
    "softcap-tanh-bwd-const": (SOFTCAP, "tanh_bwd:c30.0,w0|div:v0,c30.0|mul:g,v1"),
    "softcap-tanh-bwd-one": (SOFTCAP, "tanh_bwd:c1.0,w0|mul:g,v0"),
    "sigmoid-gate-chain": ("id:s|sigmoid:s|mul:s,v1",
                           "sub:c1.0,w1|mul:w1,v0|mul:w0,v1|add:w1,v2|mul:g,v3"),
    "sigmoid-gate-bwd-g": ("id:s|sigmoid:s|mul:s,v1",
                           "mul:g,w0|sigmoid_bwd:v0,w0|mul:g,w1|add:v1,v2"),
    "sigmoid-gate-bwd-one": ("id:s|sigmoid:s|mul:s,v1",
                             "sigmoid_bwd:w0,w0|add:w1,v0|mul:g,v1"),
    "doc-mask-int-div-64": ("div.i:q,c64|div.i:k,c64|eq:v0,v1|sel:v2,s,c-inf", "id:g"),
    "doc-mask-floor": ("div:q,c64.0|floor:v0|div:k,c64.0|floor:v2|eq:v1,v3|sel:v4,s,c-inf",
                       "id:g"),
}


def main():
    module = native.module("cuda")
    for name, (fwd, bwd, *inputs) in PROBES.items():
        key = cudnn.graph_key(BASE).replace("flex=;flexb=;flexin=",
                                            f"flex={fwd};flexb={bwd};flexin={','.join(inputs)}")
        r = module.cudnn_check_support(key)
        msg = "ok" if r["ok"] else r["message"].splitlines()[0][:160]
        print(f"{name:24s} {msg}", flush=True)


if __name__ == "__main__":
    main()
