"""Do the block-sparse kernels gain from taking Q (forward; dq: Q and dO) as register
operands of their score products, where today both operands come from SMEM?
Times the benchmark's rows round-robin in one process, each with the operands in SMEM
and in registers, after checking the two give the same outputs and gradients.
`python -m benchmarks.tune.wgmma_operands [row ...]`"""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import bench_block_sparse as bench
from benchmarks.common import time_interleaved
from fusedattn.block_sparse import kernel_bwd, kernel_fwd

SEEN = set()   # (kernel, whether its first operand came as an array) at trace time


def _spy(module, name, kernel):
    real = getattr(module, name)

    def spied(a, *rest, **kw):
        SEEN.add((kernel, isinstance(a, jax.Array)))
        return real(a, *rest, **kw)
    setattr(module, name, spied)


VARIANTS = {"smem": (False, False), "fwd regs": (True, False), "dq regs": (False, True),
            "both regs": (True, True)}


def main(names):
    _spy(kernel_fwd, "matmul_t", "fwd")
    _spy(kernel_bwd, "matmul_t2", "bwd")
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (jax.random.normal(x, (bench.B, bench.S, bench.H, bench.D), jnp.bfloat16)
                   for x in keys)
    ids = bench._doc_ids()
    extras = {"documents": jnp.asarray(ids), "documents_causal": jnp.asarray(ids),
              "documents_dense_mask": jnp.asarray((ids[:, :, None] == ids[:, None, :])[:, None])}
    fns = bench.cases()
    for mode in ("fwd", "fwd+bwd"):
        calls, outs = {}, {}
        for name in names:
            for label, (fwd_regs, dq_regs) in VARIANTS.items():
                if mode == "fwd" and dq_regs:
                    continue
                kernel_fwd.Q_IN_REGISTERS, kernel_bwd.A_IN_REGISTERS = fwd_regs, dq_regs
                fn, args = bench._step(fns[name], mode, q, k, v, do, extras.get(name))
                SEEN.clear()
                outs[name, label] = jax.block_until_ready(fn(*args))   # traced with the flags
                print(f"{mode} {name} / {label}: traced {sorted(SEEN)}", flush=True)
                calls[f"{name} / {label}"] = (fn, args)
            kernel_fwd.Q_IN_REGISTERS = kernel_bwd.A_IN_REGISTERS = False
            base = jax.tree.leaves(outs[name, "smem"])
            for label in VARIANTS:
                if (name, label) in outs:
                    diff = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
                               for a, b in zip(base, jax.tree.leaves(outs[name, label])))
                    print(f"{mode} {name} / {label}: max |difference| from smem {diff:.3g}", flush=True)
        times = time_interleaved(calls, rounds=9)
        for key, t in times.items():
            print(f"{mode:8s} {key:40s} {t * 1e3:8.3f} ms", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["documents", "documents_dense_mask", "sliding_window:block_sparse",
                          "documents_causal"])
