"""Which collectives does a precision="fp8" training step hold under a mesh with
Explicit axes (JAX's default since 0.11) on 8 host CPU devices? The XLA emulation's
FP8 calls go through the same partitioning rule as cuDNN's (backends/native_call.py),
so this tells on CPU whether the all-gather of FP8 tensors that cuDNN's FP8 calls hold
on two GPUs comes from that rule.

    JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        python -m benchmarks.tune.explicit_axes_fp8
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import fusedattn


def collectives(f, args):
    text = jax.jit(f).lower(*args).compile().as_text()
    lines = [line.strip()[:240] for line in text.splitlines()
             if re.search(r" (all-gather|all-to-all|all-reduce|collective-permute)(-start)?\(", line)]
    return lines


def main():
    print("jax", jax.__version__, jax.devices()[0].platform, len(jax.devices()))
    for axis_type in (jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto):
        for split, spec in (("batch", P("x")), ("heads", P(None, None, "x"))):
            mesh = jax.make_mesh((2,), ("x",), axis_types=(axis_type,))
            q = jnp.ones((4, 256, 8, 64), jnp.bfloat16)
            placed = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, q, q)]
            for precision in ("default", "fp8"):
                def loss(q, k, v, precision=precision):
                    out = fusedattn.fused_attn(q, k, v, mask="causal", precision=precision,
                                               backend="xla")
                    return jnp.sum(out.astype(jnp.float32))
                step = jax.grad(loss, argnums=(0, 1, 2))
                try:
                    lines = collectives(step, placed)
                except Exception as e:  # noqa: BLE001
                    lines = [f"{type(e).__name__}: {str(e)[:300]}"]
                print(f"{axis_type.name} {split} precision={precision}: {len(lines)}")
                for line in lines:
                    print("    " + line)


if __name__ == "__main__":
    main()
