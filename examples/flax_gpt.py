"""A small GPT in Flax (linen), trained on a synthetic next-token task with three
attention functions: Flax's default, fusedattn (`fusedattn.flax.attention_fn`, told
``is_causal`` or given Flax's causal mask) and
`jax.nn.dot_product_attention(implementation="cudnn")`. Prints the step time of each
(median waiting for every step, and mean of steps dispatched back to back) and its
loss, and saves a loss plot (PNG) when matplotlib is installed.

    python examples/flax_gpt.py                 # CPU-small: seconds on a laptop
    python examples/flax_gpt.py --gpu-real      # b8 s2047 d1024 h8, 4 layers, on a GPU

A path that refuses the config (cudnn off a GPU, or at an odd sequence length) is
reported with its error instead of timed.
"""
from __future__ import annotations

import argparse
import functools
import statistics
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import fusedattn.flax


def flax_default(q, k, v):
    causal = nn.make_causal_mask(jnp.ones(q.shape[:2]), dtype=jnp.bool_)
    return nn.dot_product_attention(q, k, v, mask=causal)


def fusedattn_causal_mask(q, k, v):
    """fusedattn given the causal mask as Flax code builds it (a dense boolean mask)."""
    causal = nn.make_causal_mask(jnp.ones(q.shape[:2]), dtype=jnp.bool_)
    return fusedattn.flax.attention_fn(q, k, v, mask=causal)


ATTENTION = {
    "flax default": flax_default,
    "fusedattn": functools.partial(fusedattn.flax.attention_fn, is_causal=True),
    "fusedattn, mask": fusedattn_causal_mask,
    "jax.nn cudnn": functools.partial(jax.nn.dot_product_attention, is_causal=True,
                                      implementation="cudnn"),
}


class Block(nn.Module):
    heads: int
    attention: callable
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        h = nn.LayerNorm(dtype=self.dtype)(x)
        qkv = nn.DenseGeneral((3, self.heads, d // self.heads), dtype=self.dtype)(h)
        att = self.attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2])
        x = x + nn.DenseGeneral(d, axis=(-2, -1), dtype=self.dtype)(att)
        h = nn.LayerNorm(dtype=self.dtype)(x)
        return x + nn.Dense(d, dtype=self.dtype)(nn.gelu(nn.Dense(4 * d, dtype=self.dtype)(h)))


class GPT(nn.Module):
    vocab: int
    dim: int
    heads: int
    layers: int
    attention: callable
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.dim, dtype=self.dtype)(tokens)
        x = x + self.param("pos", nn.initializers.normal(0.02), (tokens.shape[1], self.dim))
        for _ in range(self.layers):
            x = Block(self.heads, self.attention, self.dtype)(x)
        return nn.Dense(self.vocab, dtype=jnp.float32)(nn.LayerNorm(dtype=self.dtype)(x))


def batches(key, batch, seq, vocab):
    """Counting sequences mod vocab from random starts with random strides: the next
    token follows from the previous two, so the loss falls fast."""
    while True:
        key, k1, k2 = jax.random.split(key, 3)
        start = jax.random.randint(k1, (batch, 1), 0, vocab)
        stride = jax.random.randint(k2, (batch, 1), 1, 4)
        yield (start + stride * jnp.arange(seq + 1)) % vocab


def train(name, args):
    model = GPT(args.vocab, args.dim, args.heads, args.layers, ATTENTION[name],
                jnp.bfloat16 if args.bf16 else jnp.float32)
    data = batches(jax.random.PRNGKey(1), args.batch, args.seq, args.vocab)
    params = model.init(jax.random.PRNGKey(0), next(data)[:, :-1])
    opt = optax.adamw(3e-3)
    state = opt.init(params)

    def step(params, state, tokens):
        def loss_fn(p):
            logits = model.apply(p, tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss
    # Donated, as a training loop does: the step updates params and state in place.
    step = jax.jit(step, donate_argnums=(0, 1))

    losses, times = [], []
    for i in range(args.steps):
        tokens = next(data)
        start = time.perf_counter()
        params, state, loss = step(params, state, tokens)
        losses.append(float(loss))  # waits for the step
        if i > 0:  # the first step compiles
            times.append(time.perf_counter() - start)
    # Steps dispatched back to back, waiting once: the host prepares a step while the
    # device runs the last, so launch costs that a wait per step exposes overlap.
    start = time.perf_counter()
    for _ in range(PIPELINED):
        params, state, loss = step(params, state, tokens)
    float(loss)
    pipelined = (time.perf_counter() - start) / PIPELINED
    return losses, (statistics.median(times) if times else float("nan")), pipelined


PIPELINED = 20


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpu-real", action="store_true",
                   help="b8 s2047 d1024 h8, 4 layers, bf16 (a GPU's size)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--plot", default="flax_gpt_loss.png", help="PNG path ('' for none)")
    args = p.parse_args(argv)
    if args.gpu_real:
        args.batch, args.seq, args.dim, args.heads, args.layers = 8, 2047, 1024, 8, 4
        args.vocab, args.bf16 = 512, True
    print(f"GPT b{args.batch} s{args.seq} d{args.dim} h{args.heads} x{args.layers} layers, "
          f"{args.steps} steps on {jax.devices()[0].platform}")
    curves = {}
    for name in ATTENTION:
        try:
            losses, step_time, pipelined = train(name, args)
        except Exception as e:  # a path that refuses this config
            print(f"  {name:14s} refused: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
            continue
        curves[name] = losses
        print(f"  {name:14s} {step_time * 1e3:8.2f} ms/step waiting for each, "
              f"{pipelined * 1e3:8.2f} back to back   loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    if args.plot:
        try:
            import matplotlib  # noqa: PLC0415 - optional
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt  # noqa: PLC0415
        except ImportError:
            print("  (no matplotlib: no plot)")
            return curves
        for name, losses in curves.items():
            plt.plot(losses, label=name)
        plt.xlabel("step"), plt.ylabel("loss"), plt.legend(), plt.yscale("log")
        plt.savefig(args.plot, dpi=120)
        print(f"  plot: {args.plot}")
    return curves


if __name__ == "__main__":
    main()
