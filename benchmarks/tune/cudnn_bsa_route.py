"""What does a CuTe kernel reach on Hopper for block-sparse attention?

The issue asked for the routes to be measured before one was taken; ours is Pallas
Mosaic GPU, whose backward is two kernels of seven products (docs/decisions.md).
cudnn-frontend 1.32 ships CuTe DSL block-sparse kernels for sm90 (whole blocks only:
no element mask, MHA, bf16, d128 in the backward), reachable from PyTorch. This times
them on the benchmark's documents (512/1024/512/2048, b4 s4096 h16 d128 bf16, whole
128-blocks, so the blocks are exact) beside torch flex_attention in the same process,
round-robin, and checks their output and gradients against a float32 reference on the
first batch entry. Needs torch, cudnn-frontend and nvidia-cutlass-dsl (not carried by
`ci/cuda.sh`):

    python -m benchmarks.tune.cudnn_bsa_route
"""
from __future__ import annotations

import json
import math
import statistics
import time

import torch

B, S, H, D = 4, 4096, 16, 128
DOCS = (512, 1024, 512, 2048)


def _doc_ids() -> torch.Tensor:
    return torch.cat([torch.full((n,), i) for i, n in enumerate(DOCS)]).cuda()


def _lists(block: int):
    """Query-major lists of the documents' key blocks at `block`: indices [B, H, n, cap]
    (unused slots repeat the last index) and counts [B, H, n]."""
    n = S // block
    rows, cap = [], 0
    start = 0
    for length in DOCS:
        blocks = list(range(start // block, (start + length) // block))
        rows += [blocks] * len(blocks)
        cap = max(cap, len(blocks))
        start += length
    idx = torch.tensor([r + [r[-1]] * (cap - len(r)) for r in rows], dtype=torch.int32)
    num = torch.tensor([len(r) for r in rows], dtype=torch.int32)
    assert idx.shape == (n, cap)
    return (idx.expand(B, H, n, cap).contiguous().cuda(),
            num.expand(B, H, n).contiguous().cuda())


def _time_round(fn, reps):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def main():
    from cudnn.block_sparse_attention import (block_sparse_attention_backward,
                                              block_sparse_attention_forward)
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch.manual_seed(0)
    q, k, v, do = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
                   for _ in range(4))
    ids = _doc_ids()
    calls = {}
    for block in (128, 64):
        idx, num = _lists(block)

        def fwd(idx=idx, num=num, block=block):
            r = block_sparse_attention_forward(q, k, v, idx, q2k_block_nums=num,
                                               sparse_block_size=block, layout="bhsd")
            return r["o_tensor"], r["lse_tensor"]

        def fb(fwd=fwd, idx=idx, num=num, block=block):
            o, lse = fwd()
            r = block_sparse_attention_backward(do, q, k, v, o, lse, idx, q2k_block_nums=num,
                                                sparse_block_size=block, layout="bhsd")
            return o, r["dq_tensor"], r["dk_tensor"], r["dv_tensor"]

        calls[f"cudnn_bsa_blk{block}"] = (fwd, fb)

    def doc_mask(b, h, qi, ki):
        return ids[qi] == ids[ki]

    bm = create_block_mask(doc_mask, None, None, S, S)
    fa = torch.compile(flex_attention)
    qg, kg, vg = (t.detach().clone().requires_grad_(True) for t in (q, k, v))

    def flex_fwd():
        return fa(q, k, v, block_mask=bm)

    def flex_fb():
        o = fa(qg, kg, vg, block_mask=bm)
        return (o, *torch.autograd.grad(o, (qg, kg, vg), do))

    calls["torch_flex"] = (flex_fwd, flex_fb)

    # Accuracy on batch entry 0 against float32 math with the dense mask.
    mask = (ids[:, None] == ids[None, :])
    qr, kr, vr = (t[:1].float().requires_grad_(True) for t in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(qr, kr, vr, attn_mask=mask)
    ref_grads = torch.autograd.grad(ref, (qr, kr, vr), do[:1].float())
    errors = {}
    for name, (_, fb) in calls.items():
        got = fb()
        errs = []
        for g, r in zip(got, (ref, *ref_grads)):
            g = g[:1].float()
            errs.append(float((g - r).norm() / r.norm()))
        errors[name] = dict(zip(("o", "dq", "dk", "dv"), errs))
        print(name, "relative L2 (o, dq, dk, dv):", [f"{e:.2e}" for e in errs], flush=True)

    for _, (f, fb) in calls.items():
        for _ in range(3):
            f(), fb()
    reps = {(n, m): max(3, math.ceil(0.025 / _time_round(fn, 1)))
            for n, fns in calls.items() for m, fn in zip(("fwd", "fwd+bwd"), fns)}
    samples = {key: [] for key in reps}
    for r in range(7):
        order = list(reps)
        order = order[r % len(order):] + order[:r % len(order)]
        for n, m in order:
            fn = calls[n][0 if m == "fwd" else 1]
            samples[(n, m)].append(_time_round(fn, reps[(n, m)]))
    ms = {f"{n} {m}": statistics.median(s) * 1e3 for (n, m), s in samples.items()}
    for key, t in ms.items():
        print(f"{key}: {t:.3f} ms", flush=True)
    print("RESULT" + json.dumps({"ms": ms, "errors": errors,
                                 "device": torch.cuda.get_device_name(),
                                 "torch": torch.__version__}))


if __name__ == "__main__":
    main()
