"""PyTorch's flex_attention timed in a child process (torch and JAX each take the GPU's
memory for their own allocator, so they do not share a process). Each benchmark gives
the child's cases: source defining ``cases``, a dict name -> (score_mod or None,
mask_mod or None) over the tensors ``q, k, v, do`` ([B, H, S, D] bf16) set up here;
the compiled flex_attention, its block masks and the timing loop are the same for all."""
from __future__ import annotations

import json
import subprocess
import sys

_SETUP = r'''
import json, math, statistics, time
import torch
from torch.nn.attention.flex_attention import flex_attention, create_block_mask
B, S, H, D = %d, %d, %d, %d
torch.manual_seed(0)
q, k, v, do = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
for t in (q, k, v):
    t.requires_grad_(True)
'''

_TIMING = r'''
# One compiled flex_attention serves every case, each a recompilation: past dynamo's
# limit (8 by default) a case would run uncompiled.
for limit in ("recompile_limit", "cache_size_limit"):
    if hasattr(torch._dynamo.config, limit):
        setattr(torch._dynamo.config, limit, max(64, getattr(torch._dynamo.config, limit)))
fa = torch.compile(flex_attention)
def time_round(fn, reps):
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(reps): fn()
    torch.cuda.synchronize(); return (time.perf_counter() - t0) / reps
out = {}
for name, (mod, mask) in cases.items():
    bm = create_block_mask(mask, None, None, S, S) if mask else None
    fwd = lambda: fa(q, k, v, score_mod=mod, block_mask=bm)
    def fb():
        o = fa(q, k, v, score_mod=mod, block_mask=bm)
        torch.autograd.grad(o, (q, k, v), do)
    calls = {"fwd": fwd, "fwd+bwd": fb}
    for f in calls.values():
        for _ in range(3): f()
    reps = {m: max(3, math.ceil(0.025 / time_round(f, 1))) for m, f in calls.items()}
    samples = {m: [] for m in calls}
    for _ in range(7):
        for m, f in calls.items(): samples[m].append(time_round(f, reps[m]))
    out[name] = {m: statistics.median(s) for m, s in samples.items()}
print("RESULT" + json.dumps(out))
'''


def setup(b: int, s: int, h: int, d: int) -> str:
    """The child's imports and its tensors ``q, k, v, do`` ([B, H, S, D] bf16)."""
    return _SETUP % (b, s, h, d)


def source(b: int, s: int, h: int, d: int, cases: str) -> str:
    """The child's whole program around the `cases` source."""
    return setup(b, s, h, d) + cases + _TIMING


def times(b: int, s: int, h: int, d: int, cases: str) -> dict:
    """{case: {"fwd" | "fwd+bwd": seconds}}, medians of 7 rounds of at least 25 ms."""
    proc = subprocess.run([sys.executable, "-c", source(b, s, h, d, cases)],
                          capture_output=True, text=True, timeout=900)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT"):
            return json.loads(line[len("RESULT"):])
    raise RuntimeError(f"torch flex_attention failed: {proc.stderr[-2000:]}")
