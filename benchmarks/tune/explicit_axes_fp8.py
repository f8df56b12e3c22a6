"""Which collectives does a precision="fp8" training step hold under a mesh with
Explicit axes (JAX's default for jax.make_mesh) on host CPU devices, and how are the
native calls' results typed?

The XLA emulation's FP8 calls go through the same partitioning rule as cuDNN's
(backends/native_op.py), but its kernels type their results themselves; cuDNN's are FFI
calls, whose results carry no sharding type. So the second part lowers the cuDNN step
for CUDA (no GPU needed) and prints the sharding type of every native call's results:
typed unsharded, FP8 current scaling's dequantize made the partitioner gather them.

    JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        python -m benchmarks.tune.explicit_axes_fp8
"""
from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import fusedattn
from fusedattn import dispatch
from fusedattn.backends import cudnn

SPLITS = (("batch", P("x")), ("heads", P(None, None, "x")))


def collectives(f, args):
    text = jax.jit(f).lower(*args).compile().as_text()
    lines = [line.strip()[:240] for line in text.splitlines()
             if re.search(r" (all-gather|all-to-all|all-reduce|collective-permute)(-start)?\(", line)]
    return lines


def step_of(backend, precision):
    def loss(q, k, v):
        out = fusedattn.fused_attn(q, k, v, mask="causal", precision=precision, backend=backend)
        return jnp.sum(out.astype(jnp.float32))
    return jax.grad(loss, argnums=(0, 1, 2))


def emulation():
    for axis_type in (jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto):
        for split, spec in SPLITS:
            mesh = jax.make_mesh((2,), ("x",), axis_types=(axis_type,))
            q = jnp.ones((4, 256, 8, 64), jnp.bfloat16)
            placed = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, q, q)]
            for precision in ("default", "fp8"):
                try:
                    lines = collectives(step_of("xla", precision), placed)
                except Exception as e:  # noqa: BLE001
                    lines = [f"{type(e).__name__}: {str(e)[:300]}"]
                print(f"xla {axis_type.name} {split} precision={precision}: {len(lines)}")
                for line in lines:
                    print("    " + line)


def native_calls(jaxpr):
    """(step, result types) of every native call in a jaxpr, nested ones included."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "custom_partitioning":
            yield eqn.params["static_args"][0].step, [str(v.aval) for v in eqn.outvars]
        for param in eqn.params.values():
            for item in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(item, "jaxpr", item)   # (cond's branches are a tuple)
                if isinstance(inner, jax.extend.core.Jaxpr):
                    yield from native_calls(inner)


def cudnn_types():
    os.environ[dispatch.ENV_PLATFORM] = "cuda"
    dispatch.clear_cache()
    mesh = jax.make_mesh((2,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
    with cudnn.assume_supported(workspace_bytes=1 << 20):
        for split, spec in SPLITS:
            q = jax.ShapeDtypeStruct((4, 256, 8, 128), jnp.bfloat16,
                                     sharding=NamedSharding(mesh, spec))
            traced = jax.jit(step_of("cudnn", "fp8")).trace(q, q, q)
            print(f"cudnn Explicit {split} precision=fp8, results of the native calls:")
            for step, types in dict(native_calls(traced.jaxpr.jaxpr)).items():
                print(f"    {step}: {', '.join(types)}")
    dispatch.clear_cache()


def main():
    print("jax", jax.__version__, jax.devices()[0].platform, len(jax.devices()))
    emulation()
    cudnn_types()


if __name__ == "__main__":
    main()
