"""Context parallelism on 8 devices (8 CPU devices when there is no GPU): q, k, v
split along the sequence over mesh axis ``cp``, the ring and all-gather strategies,
forward and gradients checked against the unsplit call.

    python examples/context_parallel.py [--seq 256]
"""
from __future__ import annotations

import os

# Eight host devices when jax has not started yet (a CPU-only machine).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import functools  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import fusedattn  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=256, help="a multiple of 2 * devices")
    p.add_argument("--devices", type=int, default=8)
    args = p.parse_args(argv)
    n = args.devices
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q, k, v = (jax.random.normal(kk, (2, args.seq, 4, 32), jnp.float32) for kk in keys)

    def loss(attend, q, k, v):
        return (attend(q, k, v) ** 2).sum()

    unsplit = lambda q, k, v: fusedattn.fused_attn(q, k, v, mask="causal")  # noqa: E731
    ref, ref_grads = jax.jit(jax.value_and_grad(functools.partial(loss, unsplit),
                                                argnums=(0, 1, 2)))(q, k, v)
    mesh = jax.make_mesh((n,), ("cp",), devices=jax.devices()[:n])
    split = NamedSharding(mesh, P(None, "cp"))
    qs, ks, vs = (jax.device_put(x, split) for x in (q, k, v))
    print(f"q {q.shape} split over {n} devices along the sequence: "
          f"{qs.addressable_shards[0].data.shape} each")
    for strategy in ("ring", "allgather"):
        cp = fusedattn.ContextParallel("cp", strategy=strategy, mesh=mesh)
        attend = lambda q, k, v: fusedattn.fused_attn(  # noqa: E731
            q, k, v, mask="causal", context_parallel=cp)
        step = jax.jit(jax.value_and_grad(functools.partial(loss, attend), argnums=(0, 1, 2)))
        start = time.perf_counter()
        value, grads = step(qs, ks, vs)
        jax.block_until_ready(grads)
        first = time.perf_counter() - start
        start = time.perf_counter()
        jax.block_until_ready(step(qs, ks, vs))
        again = time.perf_counter() - start
        np.testing.assert_allclose(value, ref, rtol=1e-4)
        for g, r in zip(grads, ref_grads):
            np.testing.assert_allclose(g, r, rtol=1e-3, atol=1e-3)
        print(f"  {strategy:9s} forward + gradients match the unsplit call "
              f"(first call {first:.2f} s with compile, then {again * 1e3:.1f} ms); "
              f"dq stays split: {grads[0].sharding.spec}")


if __name__ == "__main__":
    main()
