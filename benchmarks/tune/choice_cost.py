"""Where does a cold `backend="auto"` first call spend its time? In a fresh process,
after a cuDNN training step (as `bench_first_call.py` runs one first), it times each
part of what the first auto call adds: loading FlashAttention-3, a first flash step
(its kernels' first use in the process), then the first auto step, whose log lines
give the measurement's share (`backend_choice`: the training step of both rivals
compiled side by side, warm-up, timed rounds; the rest is the user's own step
compiled); then each step's measurement again.

    python -m benchmarks.tune.choice_cost [d] [causal 0/1]     (b4 s4096 h16, default d128)
"""
from __future__ import annotations

import logging
import sys
import time

t_start = time.perf_counter()
import jax  # noqa: E402
import numpy as np  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import fusedattn  # noqa: E402
from fusedattn.dispatch import measure as bc  # noqa: E402
from fusedattn.config import AttnConfig  # noqa: E402
from fusedattn.dispatch import load_backend  # noqa: E402


def timed(phases, name, fn):
    t = time.perf_counter()
    out = fn()
    phases[name] = time.perf_counter() - t
    return out


def main():
    d = int(sys.argv[1]) if len(sys.argv) > 1 else 128
    causal = len(sys.argv) > 2 and sys.argv[2] == "1"
    mask = "causal" if causal else "none"
    config = AttnConfig(batch=4, s_q=4096, s_kv=4096, h_q=16, h_kv=16, d_qk=d, d_v=d,
                        dtype="bfloat16", scale=d ** -0.5, mask=mask)
    logging.basicConfig(level=logging.INFO, format="  log: %(message)s")
    jnp.zeros(1).block_until_ready()
    phases = {"import + GPU start": time.perf_counter() - t_start}
    q = jnp.ones((4, 4096, 16, d), jnp.bfloat16)

    def step(backend, factor):
        return jax.jit(jax.grad(lambda q: jnp.sum(
            fusedattn.fused_attn(q, q, q, mask=mask, backend=backend) * factor)))
    timed(phases, "cudnn probe + first cudnn step", lambda: step("cudnn", 1)(q).block_until_ready())
    timed(phases, "load the flash backend", lambda: load_backend("flash"))
    timed(phases, "first flash step (FA3's kernels' first use)",
          lambda: step("flash", 3)(q).block_until_ready())
    timed(phases, "first auto step (measurement logged above)",
          lambda: step("auto", 2)(q).block_until_ready())
    for what in bc.STEPS:
        timed(phases, f"measure {what} again",
              lambda: bc.measure_on_device(config, ("cudnn", "flash"), what))
    # Ways to make the measurement's inputs, each first used at a shape of its own
    # (compile + run): why backend_choice makes them as random bits on the host.
    bf16 = jnp.dtype(jnp.bfloat16)

    def on_device(impl, sample):
        def draw(shapes):
            keys = jax.random.split(jax.random.key(1, impl=impl), len(shapes))
            return [sample(key, shape) for key, shape in zip(keys, shapes)]
        return lambda shapes: jax.jit(draw, static_argnums=0)(shapes)
    draws = {
        "threefry normal": on_device("threefry2x32",
                                     lambda k, s: jax.random.normal(k, s, bf16)),
        "rbg normal": on_device("rbg", lambda k, s: jax.random.normal(k, s, bf16)),
        "rbg uniform": on_device("rbg", lambda k, s: jax.random.uniform(k, s, bf16, -2, 2)),
        "numpy normal": lambda shapes: [jax.device_put(np.random.default_rng(i).standard_normal(
            s, np.float32).astype(bf16)) for i, s in enumerate(shapes)],
        "host bits (backend_choice)": lambda shapes: bc._random_inputs(shapes, bf16),
    }
    for i, (name, draw) in enumerate(draws.items()):
        shapes = ((4, 4096, 16, d + 8 * (i + 1)),) * 4
        timed(phases, f"inputs by {name} (first use)",
              lambda: jax.block_until_ready(draw(shapes)))
    print(f"b4 s4096 h16 d{d} causal={causal}")
    for name, sec in phases.items():
        print(f"  {sec:6.3f} s  {name}")


if __name__ == "__main__":
    main()
