"""Where no kernel runs a mask (the Mosaic GPU kernels lack the head dim or dtype, or
the GPU is not a Hopper; cuDNN and FA3 cannot run it either), is the block map walked in
plain JAX (`block_sparse.reference`, the block_sparse_xla backend) faster than XLA over
all S^2 pairs? b4 s4096 h16, d 128 and 256 bf16 and d 128 float32, fwd / fwd+bwd ms,
round-robin in one process beside dispatch's choice where that is a kernel; the walks
with each (batch, head)'s tiles in `reference.GROUPS` runs and in one ("walk:G1"). The
walk's forward is checked against XLA's first.

    python -m benchmarks.tune.walk_fallback [d128-float32 ...]
"""
from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import step, time_interleaved, warm_into
import fusedattn
from fusedattn import block_sparse as bs
from fusedattn.block_sparse import reference
from fusedattn.block_sparse.attention import block_sparse_attention

B, S, H = 4, 4096, 16
DOCS = (512, 1024, 512, 2048)


def documents(b, h, i, j, ids):
    return ids[b, i] == ids[b, j]


def window(b, h, i, j):
    return (j <= i) & (i - j < 512)


def every_pair(b, h, i, j, ids):
    """Reads an array and hides nothing: every block is walked (the walks' worst case)."""
    return ids[b, j] >= 0


# The walks' runs per (batch, head) to time (`reference.GROUPS`, its default first).
WALK_GROUPS = (reference.GROUPS, 1)


def main():
    default_groups = reference.GROUPS
    ids = jnp.asarray(np.broadcast_to(np.concatenate(
        [np.full(n, k, np.int32) for k, n in enumerate(DOCS)]), (B, S)).copy())
    wmap = bs.block_map(window, s_q=S, s_kv=S)
    cmap = bs.from_builtin(S, mask="causal")
    only = sys.argv[1:]   # e.g. d128-float32: those configs alone
    for d, dtype in ((128, jnp.bfloat16), (256, jnp.bfloat16), (128, jnp.float32)):
        if only and f"d{d}-{jnp.dtype(dtype).name}" not in only:
            continue
        ks = jax.random.split(jax.random.PRNGKey(d), 4)
        q, k, v, do = (jax.random.normal(x, (B, S, H, d), dtype) for x in ks)
        rows = {
            "documents": (
                lambda q, k, v, **kw: fusedattn.fused_attn(q, k, v, mask_mod=documents,
                                                           score_mod_args=(ids,), **kw),
                lambda q, k, v: block_sparse_attention(
                    q, k, v, bs.from_segment_ids(ids, pad_id=None),
                    implementation="reference")),
            "every pair": (
                lambda q, k, v, **kw: fusedattn.fused_attn(q, k, v, mask_mod=every_pair,
                                                           score_mod_args=(ids,), **kw),
                lambda q, k, v: block_sparse_attention(
                    q, k, v, bs.block_map(every_pair, B, 1, S, S, args=(ids,)),
                    implementation="reference")),
            "causal": (
                lambda q, k, v, **kw: fusedattn.fused_attn(q, k, v, mask="causal", **kw),
                lambda q, k, v: block_sparse_attention(q, k, v, cmap,
                                                       implementation="reference")),
            "window": (
                lambda q, k, v, **kw: fusedattn.fused_attn(q, k, v, mask_mod=window, **kw),
                lambda q, k, v: block_sparse_attention(q, k, v, wmap,
                                                       implementation="reference")),
        }
        for name, (auto, walk) in rows.items():
            plan = fusedattn.explain(q, k, v, mask_mod=window) if name == "window" else \
                fusedattn.explain(q, k, v, mask="causal") if name == "causal" else \
                fusedattn.explain(q, k, v, mask_mod=documents if name == "documents"
                                  else every_pair, score_mod_args=(ids,))
            xla = functools.partial(auto, backend="xla")
            got, want = jax.jit(walk)(q, k, v), jax.jit(xla)(q, k, v)
            err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
            for mode in ("fwd", "fwd+bwd"):
                calls, notes = {}, {}
                runs = [(f"walk:G{g}", functools.partial(walk), g) for g in WALK_GROUPS]
                runs.append(("xla", functools.partial(xla), None))
                if plan.chosen not in ("block_sparse_xla", "xla"):
                    runs.append(("auto:" + plan.chosen, auto, None))
                for label, fn, groups in runs:
                    reference.GROUPS = groups or default_groups   # (read when traced)
                    f, args = step(fn, mode, q, k, v, do)
                    why = warm_into(calls, label, f, args)
                    if why:
                        notes[label] = why
                reference.GROUPS = default_groups
                times = time_interleaved(calls, rounds=5)
                cells = "  ".join(f"{n} {t * 1e3:.3f} ms" for n, t in times.items())
                print(f"d{d} {jnp.dtype(dtype).name} {name} {mode}: {cells}  "
                      f"(max |walk - xla| fwd {err:.3g}; auto: {plan.chosen})"
                      f"{' ' + str(notes) if notes else ''}", flush=True)


if __name__ == "__main__":
    main()
