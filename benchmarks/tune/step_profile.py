"""Where a training step's time goes: the GPU kernels of `bench_block_sparse` rows
(fwd+bwd, b4 s4096 h16 d128 bf16), from a `jax.profiler` trace, in launch order with
their time per step, beside the step's own time. Mosaic GPU kernels all share one name,
so the launch order tells the forward from dq and dk / dv.
`python -m benchmarks.tune.step_profile [--fwd] [row ...]` (default: documents, the
dense document mask and plain causal; ``--fwd``: the forward alone)."""
from __future__ import annotations

import glob
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.profiler import ProfileData

from benchmarks import bench_block_sparse as bench
from benchmarks.common import time_interleaved

STEPS = 10


def launches(fn, args):
    """([(kernel name, µs)] of one step in launch order, the µs a step's span (first
    start to last end) leaves the GPU idle, the µs from one step's end to the next's
    start), means over STEPS steps."""
    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(STEPS):
                out = fn(*args)
            jax.block_until_ready(out)
        data = ProfileData.from_file(glob.glob(f"{d}/**/*.xplane.pb", recursive=True)[0])
    events = sorted((e.start_ns, e.name, e.duration_ns, e.end_ns)
                    for plane in data.planes if plane.name.startswith("/device:GPU")
                    for line in plane.lines if line.name.startswith("Stream")
                    for e in line.events)
    per = len(events) // STEPS
    if per * STEPS != len(events):
        print(f"  ({len(events)} kernels over {STEPS} steps: not one step's list repeated)")
    steps = [events[s * per:(s + 1) * per] for s in range(STEPS)]
    idle = np.mean([max(e[3] for e in st) - st[0][0] - sum(e[2] for e in st) for st in steps])
    between = np.mean([b[0][0] - max(e[3] for e in a) for a, b in zip(steps, steps[1:])])
    return [(events[i][1], np.mean([st[i][2] for st in steps]) / 1e3)
            for i in range(per)], idle / 1e3, between / 1e3


def main(names, mode="fwd+bwd"):
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (jax.random.normal(x, (bench.B, bench.S, bench.H, bench.D), jnp.bfloat16)
                   for x in keys)
    ids = bench._doc_ids()
    extras = {"documents": jnp.asarray(ids),
              "documents_dense_mask": jnp.asarray((ids[:, :, None] == ids[:, None, :])[:, None])}
    fns = dict(bench.cases(), causal=bench.plain_causal()[0])
    calls = {}
    for name in names:
        fn, args = bench._step(fns[name], mode, q, k, v, do, extras.get(name))
        total = 0.0
        print(f"{name} ({mode}):", flush=True)
        kernels, idle, between = launches(fn, args)
        for kernel, us in kernels:
            total += us
            print(f"  {us:8.1f} us  {kernel[:110]}")
        print(f"  {total:8.1f} us  in kernels, {idle:.1f} us idle between them, "
              f"{between:.1f} us from one step's last kernel to the next's first", flush=True)
        t0 = time.perf_counter()
        for _ in range(STEPS):
            out = fn(*args)
        host = (time.perf_counter() - t0) / STEPS
        jax.block_until_ready(out)
        print(f"  {host * 1e6:8.1f} us  of the host a call, not waiting", flush=True)
        for n in (10, 100):
            t0 = time.perf_counter()
            for _ in range(n):
                out = fn(*args)
            jax.block_until_ready(out)
            print(f"  {(time.perf_counter() - t0) / n * 1e6:8.1f} us  a step, {n} back to back",
                  flush=True)
        calls[name] = (fn, args)
        # XLA runs a step's kernels as one CUDA graph (command buffer); the profiler
        # may not: the same step compiled without them, timed beside it.
        plain = fn.lower(*args).compile(compiler_options={"xla_gpu_enable_command_buffer": ""})
        jax.block_until_ready(plain(*args))
        calls[f"{name} without command buffers"] = (plain, args)
    for name, t in time_interleaved(calls).items():
        print(f"{name}: step {t * 1e3:.3f} ms", flush=True)


if __name__ == "__main__":
    argv = sys.argv[1:]
    mode = "fwd" if "--fwd" in argv else "fwd+bwd"
    main([a for a in argv if a != "--fwd"] or ["documents", "documents_dense_mask", "causal"],
         mode)
