"""Would FA3's variable-length backward over runs of equal ids beat the block-sparse
backward on the benchmark's documents? The block-sparse forward (map from the ids) with
FA3's varlen backward over the runs (R sequences a row, a static bound: the number of
documents is known only on the device), beside the block-sparse step through
`fused_attn` and FA3 varlen for both passes, one process, round-robin; the hybrid's
gradients against the block-sparse ones first. An upper bound: no device check that
the runs are whole documents, no fallback. `python -m benchmarks.tune.documents_varlen_backward`"""
import jax
import jax.numpy as jnp

from benchmarks import bench_block_sparse as bench
from benchmarks.common import time_interleaved
import fusedattn
from fusedattn import block_sparse as bs
from fusedattn.api import build_call
from fusedattn.backends import flash
from fusedattn.block_sparse.attention import block_sparse_attention_with_lse
from fusedattn.sequence import SequenceDescriptor

B, S, H, D = bench.B, bench.S, bench.H, bench.D


def runs_of(ids):
    start = jnp.concatenate([jnp.ones((ids.shape[0], 1), bool), ids[:, 1:] != ids[:, :-1]], 1)
    return jnp.cumsum(start.astype(jnp.int32), axis=1)   # 1-based run ids


def hybrid(R):
    @jax.custom_vjp
    def f(q, k, v, ids):
        out, _ = block_sparse_attention_with_lse(q, k, v, bs.from_segment_ids(ids, pad_id=None))
        return out

    def fwd(q, k, v, ids):
        out, lse = block_sparse_attention_with_lse(q, k, v, bs.from_segment_ids(ids, pad_id=None))
        return out, (q, k, v, ids, out, lse)

    def bwd(res, do):
        q, k, v, ids, out, lse = res
        seq = SequenceDescriptor.from_segment_ids(runs_of(ids), max_segments=R)
        config, inputs = build_call(q, k, v, sequence=seq)
        flash._forward_kernel()   # registers the FFI targets
        g = flash.backward(config, inputs, out, lse, do)
        return g.q, g.k, g.v, None
    f.defvjp(fwd, bwd)
    return f


def step(fn, mode, do):
    if mode == "fwd":
        return jax.jit(lambda q, k, v, ids: fn(q, k, v, ids))
    def grads(q, k, v, ids, do):
        return jax.vjp(lambda q, k, v: fn(q, k, v, ids), q, k, v)[1](do)
    return lambda q, k, v, ids, _g=jax.jit(grads): _g(q, k, v, ids, do)


def main():
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (jax.random.normal(x, (B, S, H, D), jnp.bfloat16) for x in keys)
    ids = jnp.asarray(bench._doc_ids())
    fns = {"block_sparse": lambda q, k, v, ids: fusedattn.fused_attn(
        q, k, v, mask_mod=bench.doc_mod, score_mod_args=(ids,))}
    for R in (4, 8, 16):
        fns[f"hybrid R{R}"] = hybrid(R)
        fns[f"varlen R{R}"] = (lambda R: lambda q, k, v, ids: fusedattn.fused_attn(
            q, k, v, sequence=SequenceDescriptor.from_segment_ids(runs_of(ids), max_segments=R),
            backend="flash"))(R)
    # correctness of the hybrid against block_sparse
    g0 = step(fns["block_sparse"], "fwd+bwd", do)(q, k, v, ids)
    g1 = step(fns["hybrid R16"], "fwd+bwd", do)(q, k, v, ids)
    for a, b in zip(g0, g1):
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        print("rel", float(jnp.linalg.norm(a - b) / jnp.linalg.norm(a)))
    for mode in ("fwd", "fwd+bwd"):
        calls = {}
        for name, fn in fns.items():
            if mode == "fwd" and name.startswith("hybrid"):
                continue
            f = step(fn, mode, do)
            jax.block_until_ready(f(q, k, v, ids))
            calls[name] = (f, (q, k, v, ids))
        for name, t in time_interleaved(calls).items():
            print(f"{mode:8s} {name:14s} {t * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
