"""Is a training step bound by the GPU's power cap? The SM clock and the power, sampled
by nvidia-smi every 20 ms, while the block-sparse documents step of `bench_block_sparse`
(fwd+bwd, b4 s4096 h16 d128 bf16) runs chunks of 100 steps back to back after an idle
second; then the kernels' sum from a profile of 10 steps (after a second idle: full
clocks); then torch flex_attention's documents step, the same chunks, in a child process.
A step whose clock falls at the cap gains less from a kernel that does more per cycle.

    python -m benchmarks.tune.power_clocks [chunks]
"""
from __future__ import annotations

import datetime
import json
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import bench_block_sparse as bench
from benchmarks import torch_flex
from benchmarks.tune.step_profile import launches
from fusedattn import block_sparse as bs
from fusedattn.block_sparse.attention import block_sparse_attention

PER_CHUNK = 100

_TORCH = r'''
ids = torch.tensor(%s, device="cuda", dtype=torch.int32)
fa = torch.compile(flex_attention)
bm = create_block_mask(lambda b, h, i, j: ids[b, i] == ids[b, j], B, None, S, S)
def step():
    o = fa(q, k, v, block_mask=bm)
    torch.autograd.grad(o, (q, k, v), do)
for _ in range(5): step()
torch.cuda.synchronize(); time.sleep(1.0)
res = []
for c in range(%d):
    t0 = time.time()
    for _ in range(%d): step()
    torch.cuda.synchronize(); res.append((t0, time.time()))
print("RESULT" + json.dumps(res))
'''


def chunks(step, sync, n):
    """[(start, end)] wall times of `n` chunks of PER_CHUNK steps, after an idle second."""
    time.sleep(1.0)
    spans = []
    for _ in range(n):
        t0 = time.time()
        for _ in range(PER_CHUNK):
            out = step()
        sync(out)
        spans.append((t0, time.time()))
    return spans


def torch_chunks(n):
    src = torch_flex.setup(bench.B, bench.S, bench.H, bench.D) + _TORCH % (
        bench._doc_ids().tolist(), n, PER_CHUNK)
    proc = subprocess.run([sys.executable, "-c", src], capture_output=True, text=True,
                          timeout=600)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT"):
            return [tuple(x) for x in json.loads(line[len("RESULT"):])]
    raise RuntimeError(f"torch flex_attention failed: {proc.stderr[-2000:]}")


def samples_of(path):
    """[(time, sm MHz, W)] from nvidia-smi's csv."""
    out = []
    for line in open(path).read().splitlines():
        try:
            ts, sm, pw = (x.strip() for x in line.split(","))
            t = datetime.datetime.strptime(ts, "%Y/%m/%d %H:%M:%S.%f").timestamp()
            out.append((t, float(sm), float(pw)))
        except ValueError:
            pass
    return out


def main(n):
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (jax.random.normal(x, (bench.B, bench.S, bench.H, bench.D), jnp.bfloat16)
                   for x in keys)
    ids = jnp.asarray(bench._doc_ids())
    ours = lambda q, k, v, ids: block_sparse_attention(  # noqa: E731
        q, k, v, bs.from_segment_ids(ids, pad_id=None))
    fn, args = bench._step(ours, "fwd+bwd", q, k, v, do, ids)
    for _ in range(3):
        jax.block_until_ready(fn(*args))
    with tempfile.NamedTemporaryFile("w", suffix=".csv") as log:
        # (to a file: a pipe left unread fills and stops the sampler)
        smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw",
                                "--format=csv,noheader,nounits", "-lms", "20"], stdout=log)
        try:
            spans = {"ours": chunks(lambda: fn(*args), jax.block_until_ready, n)}
            time.sleep(1.0)
            kernels, _, _ = launches(fn, args)
            spans["torch"] = torch_chunks(n)
        finally:
            smi.terminate()
            smi.wait()
        samples = np.array(samples_of(log.name))
    print(f"ours, profiled after an idle second: {sum(us for _, us in kernels):.1f} us of "
          f"kernels a step")
    for name, spans_ in spans.items():
        for c, (t0, t1) in enumerate(spans_):
            s = samples[(samples[:, 0] >= t0) & (samples[:, 0] <= t1)] if len(samples) else []
            clock = f"sm {s[:, 1].mean():.0f} MHz  {s[:, 2].mean():.0f} W" if len(s) else "no samples"
            print(f"{name:5s} chunk {c:2d}: {(t1 - t0) / PER_CHUNK * 1e3:.3f} ms a step  {clock}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 20)
