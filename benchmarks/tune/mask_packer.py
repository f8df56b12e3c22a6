"""The dense mask's packing into bits, by the CUDA extension's kernel or by XLA, in the
jax.nn drop-in's step (b4 s4096 h16 d128 bf16, the benchmark's document mask and a
causal one), fwd and fwd+bwd, round-robin in one process. Each variant is compiled
ahead of time, the XLA one with the native packer hidden while it traces.
`python -m benchmarks.tune.mask_packer` (needs the built extension)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import fusedattn
from benchmarks import bench_block_sparse as bench
from benchmarks.common import time_interleaved
from fusedattn.block_sparse import kernel_mask


def compiled(fn, args, native: bool):
    jax.clear_caches()   # the map's inner jit would otherwise reuse the other variant's trace
    keep = kernel_mask.extension.ensure_targets
    if not native:
        kernel_mask.extension.ensure_targets = lambda *a, **k: "hidden by mask_packer"
    try:
        out = fn.lower(*args).compile()
    finally:
        kernel_mask.extension.ensure_targets = keep
    jax.block_until_ready(out(*args))
    return out


def main():
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (jax.random.normal(x, (bench.B, bench.S, bench.H, bench.D), jnp.bfloat16)
                   for x in keys)
    ids = bench._doc_ids()
    masks = {"documents": jnp.asarray((ids[:, :, None] == ids[:, None, :])[:, None]),
             "causal": jnp.asarray(np.tril(np.ones((bench.S, bench.S), bool)))[None, None]}
    call = lambda q, k, v, m: fusedattn.dot_product_attention(q, k, v, mask=m)  # noqa: E731
    calls, outs = {}, {}
    for name, mask in masks.items():
        for mode in ("fwd", "fwd+bwd"):
            fn, args = bench._step(call, mode, q, k, v, do, mask)
            for native in (True, False):
                key = f"{name} {mode} {'native' if native else 'xla'}"
                calls[key] = (compiled(fn, args, native), args)
                outs[key] = calls[key][0](*args)
    for key in outs:
        if key.endswith("xla"):
            same = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(
                jax.tree.leaves(outs[key]), jax.tree.leaves(outs[key[:-3] + "native"])))
            print(f"{key[:-4]}: outputs {'identical' if same else 'DIFFER'}", flush=True)
    times = time_interleaved(calls, rounds=11)
    for key, t in times.items():
        print(f"{key}: {t * 1e3:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
