"""Where does a precision="fp8" training step spend its time beside the FP8 kernels?

One jitted forward+backward of fused_attn(..., precision="fp8") (and of the BF16 call,
for comparison), each run a few times under torch.profiler (CUPTI sees every kernel of
the process, XLA's fusions and cuDNN's alike); prints each kernel's mean time per step.

    python benchmarks/tune/fp8_step_kernels.py [b s h]    (default 4 4096 16, causal)
"""
from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
sys.path.insert(0, os.path.dirname(__file__))
from common import fwd_bwd, warmed  # noqa: E402
from fp8_kernels import profiled  # noqa: E402

import fusedattn  # noqa: E402


def kernels(fn, args):
    fn = warmed(fn, *args)
    jax.block_until_ready(fn(*args))
    return profiled(lambda: jax.block_until_ready(fn(*args)))


def main():
    b, s, h = (int(x) for x in sys.argv[1:4]) if len(sys.argv) == 4 else (4, 4096, 16)
    torch.zeros(1, device="cuda")
    key = jax.random.PRNGKey(0)
    q, k, v, do = (jax.random.normal(jax.random.fold_in(key, i), (b, s, h, 128), jnp.bfloat16)
                   for i in range(4))
    for precision in ("fp8", "default"):
        step = fwd_bwd(lambda q, k, v: fusedattn.fused_attn(
            q, k, v, mask="causal", precision=precision, backend="cudnn"))
        rows = kernels(step, (q, k, v, do))
        print(f"b{b} s{s} h{h} d128 causal precision={precision}: "
              f"{sum(t for _, t in rows):.0f} us of kernels per step")
        for name, us in rows:
            print(f"    {us:8.1f} us  {name[:140]}")
        if precision == "fp8":
            text = step.lower(q, k, v, do).compile().as_text()
            if os.environ.get("OUT"):  # the device tool's output folder
                with open(os.path.join(os.environ["OUT"], "fp8_step.hlo"), "w") as f:
                    f.write(text)


if __name__ == "__main__":
    main()
