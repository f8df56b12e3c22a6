"""Command line: `python -m fusedattn info` and `python -m fusedattn demo`."""
from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from . import dispatch, explain, fused_attn
from .backends import extension
from .vendor import cuda_lines, rocm_lines


def _x64():
    """The float64 context manager under either of its JAX names."""
    if hasattr(jax, "enable_x64"):
        return jax.enable_x64(True)
    from jax.experimental import enable_x64
    return enable_x64()




def info(_args) -> int:
    platform = dispatch.current_platform()
    print(f"fusedattn      {__import__('fusedattn').__version__}")
    print(f"jax / jaxlib   {jax.__version__} / {getattr(__import__('jaxlib'), '__version__', '?')}")
    print(f"platform       {platform}")
    for d in jax.devices():
        print(f"device         {d.id}: {getattr(d, 'device_kind', d)}")
    print(f"native         {extension.status()}")
    if platform == "cuda":
        v = extension.versions()
        if "cudnn" in v:
            print(f"cudnn          runtime {v['cudnn']} (built with {v['cudnn_compiled']}), "
                  f"frontend {v['cudnn_frontend']}, CUDA {v['cuda_compiled']}")
    for line in (rocm_lines() if platform == "rocm" else cuda_lines() if platform == "cuda"
                 else cuda_lines() + rocm_lines()):
        print(line)
    print()
    # Two representative requests: training attention and recommender small-seq.
    for title, shape_q, shape_kv, opts in (
            ("training: b2 s1024 h8 d64 bf16 causal", (2, 1024, 8, 64), (2, 1024, 8, 64),
             dict(mask="causal")),
            ("small-seq: n4096 s_q1 s_kv16 h8 d128 bf16", (4096, 1, 8, 128), (4096, 16, 8, 128), {})):
        q = jax.ShapeDtypeStruct(shape_q, jnp.bfloat16)
        kv = jax.ShapeDtypeStruct(shape_kv, jnp.bfloat16)
        print(title)
        print(explain(q, kv, kv, **opts).table())
        print()
    return 0


def _reference(q, k, v, do):
    """Float64 forward and gradients through jax.nn's dense XLA path on the CPU.

    Independent of every fusedattn backend: it is JAX's own reference math.
    """
    cpu = jax.devices("cpu")[0]
    with _x64():
        args = [jax.device_put(np.asarray(a, np.float64), cpu) for a in (q, k, v, do)]

        def f(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")

        out, vjp = jax.vjp(f, *args[:3])
        grads = vjp(args[3])
        return [np.asarray(x) for x in (out, *grads)]


def demo(args) -> int:
    b, s, h, d = args.batch, args.seq, args.heads, args.head_dim
    dtype = jnp.bfloat16
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, v, do = (jax.random.normal(key, (b, s, h, d), dtype) for key in keys)
    plan = explain(q, k, v, mask="causal")
    print(plan)

    def loss(q, k, v):
        out = fused_attn(q, k, v, mask="causal")
        return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32)), out

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
    t0 = time.perf_counter()
    (_, out), grads = jax.block_until_ready(step(q, k, v))
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(args.reps):
        (_, out), grads = step(q, k, v)
    jax.block_until_ready(grads)
    step_ms = (time.perf_counter() - t0) / args.reps * 1e3

    ref = _reference(q, k, v, do)
    print(f"\nforward+backward b{b} s{s} h{h} d{d} bf16 causal on {plan.chosen}: "
          f"{step_ms:.2f} ms/step (first call incl. compile {compile_s:.2f} s)")
    worst = 0.0
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), ref):
        err = np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want)
        worst = max(worst, err)
        print(f"  {name:3s} relative error vs float64 reference: {err:.2e}")
    ok = worst < 4e-2  # bf16 tolerance
    print("OK" if ok else "FAIL: error above the bf16 tolerance 4e-2")
    return 0 if ok else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fusedattn")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, devices, native extension and backend availability")
    p = sub.add_parser("demo", help="a forward+backward step on the best backend, checked")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    return {"info": info, "demo": demo}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
