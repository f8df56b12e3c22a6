"""Recommender serving with `fused_attn_small_seq`: each request is one query token
over a user's last 1-16 items. Requests arrive in batches of varying size; each
batch is padded to a few fixed sizes (one compiled program per bucket) and runs
with padded keys or packed keys (padding never stored or read). JAX arrays only;
`examples/small_seq_cupy.py` shows the same with cupy buffers on a GPU.

    python examples/small_seq_serving.py [--requests 20000 --batches 20]
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import fusedattn

BUCKETS = (256, 1024, 4096, 16384)  # batch sizes compiled once each


@jax.jit
def serve_padded(q, k, v, lengths):
    return fusedattn.fused_attn_small_seq(q, k, v, sequence=lengths)


@jax.jit
def serve_packed(q, k, v, offsets):
    return fusedattn.fused_attn_small_seq(q, k, v, sequence=offsets)


def pad_to_bucket(n):
    return next((b for b in BUCKETS if b >= n), n)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, default=8)
    p.add_argument("--max-batch", type=int, default=1024)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    h, d = args.heads, args.dim
    served, start = 0, time.perf_counter()
    for _ in range(args.batches):
        n = int(rng.integers(1, args.max_batch + 1))
        lengths = rng.integers(1, 17, size=n).astype(np.int32)
        q = rng.standard_normal((n, 1, h, d), dtype=np.float32)
        k = rng.standard_normal((n, 16, h, d), dtype=np.float32)
        v = rng.standard_normal((n, 16, h, d), dtype=np.float32)
        # Pad the batch to its bucket: padded requests get length 1 and are dropped after.
        m = pad_to_bucket(n)
        pad = lambda x, fill=0: np.concatenate(  # noqa: E731
            [x, np.full((m - n,) + x.shape[1:], fill, x.dtype)])
        out = serve_padded(*(jnp.asarray(pad(x), jnp.bfloat16) for x in (q, k, v)),
                           jnp.asarray(pad(lengths, 1)))[:n]
        # Packed keys: only each request's real keys, [total, h, d], offsets [m + 1].
        plen = pad(lengths, 1)
        offsets = np.concatenate([[0], np.cumsum(plen)]).astype(np.int32)
        keep = np.arange(16)[None, :] < plen[:, None]
        # Rows past offsets[-1] are never read: rounding the total up bounds recompiles.
        rows = -(-int(offsets[-1]) // 2048) * 2048
        k_packed, v_packed = (jnp.asarray(np.pad(pad(x)[keep], ((0, rows - offsets[-1]),
                                                                (0, 0), (0, 0))), jnp.bfloat16)
                              for x in (k, v))
        out_packed = serve_packed(jnp.asarray(pad(q), jnp.bfloat16), k_packed, v_packed,
                                  jnp.asarray(offsets))[:n]
        np.testing.assert_allclose(np.asarray(out_packed, np.float32),
                                   np.asarray(out, np.float32), atol=2e-2)
        served += n
    elapsed = time.perf_counter() - start
    print(f"served {served} requests in {args.batches} batches, padded and packed keys agree; "
          f"{elapsed:.2f} s on {jax.devices()[0].platform} (compiles included)")
    print(fusedattn.explain(jnp.zeros((256, 1, h, d), jnp.bfloat16),
                            jnp.zeros((256, 16, h, d), jnp.bfloat16),
                            jnp.zeros((256, 16, h, d), jnp.bfloat16)))


if __name__ == "__main__":
    main()
