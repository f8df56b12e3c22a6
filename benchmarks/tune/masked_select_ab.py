"""A/B: the block-sparse backward with and without the select of the score's gradient
at zero-probability pairs (`score_mods.zero_where_unseen`), score_mod rows, fwd+bwd,
b4 s4096 h16 d128 bf16, timed round-robin in one process."""
import jax
import jax.numpy as jnp
import numpy as np

import fusedattn
from benchmarks.common import fwd_bwd, time_interleaved, warmed
from fusedattn.block_sparse import kernel_bwd

B, S, H, D = 4, 4096, 16, 128
ids = jnp.asarray(np.repeat(np.arange(4), [512, 1024, 512, 2048])[None].repeat(B, 0), jnp.int32)
slopes = jnp.asarray(2.0 ** -np.arange(1, H + 1), jnp.float32)
scale = jnp.asarray([1.0, 0.9, 1.1, 0.8], jnp.float32)
ROWS = {
    "window+alibi": lambda q, k, v: fusedattn.fused_attn(
        q, k, v, mask_mod=lambda b, h, i, j, sl: (j <= i) & (i - j < 512),
        score_mod=lambda s, b, h, i, j, sl: s + sl[h] * (j - i), score_mod_args=(slopes,),
        backend="block_sparse"),
    "documents+scale": lambda q, k, v: fusedattn.fused_attn(
        q, k, v, mask_mod=lambda b, h, i, j, d, c: d[b, i] == d[b, j],
        score_mod=lambda s, b, h, i, j, d, c: s * c[d[b, i]], score_mod_args=(ids, scale),
        backend="block_sparse"),
}
keys = jax.random.split(jax.random.key(0), 4)
q, k, v, do = (jax.random.normal(x, (B, S, H, D), jnp.bfloat16) for x in keys)
calls = {}
select = kernel_bwd.zero_where_unseen
for name, fn in ROWS.items():
    for variant in ("select", "none"):
        kernel_bwd.zero_where_unseen = select if variant == "select" else (lambda d, p: d)
        f = fwd_bwd(lambda q, k, v, fn=fn: fn(q, k, v))
        calls[f"{name} {variant}"] = (warmed(f, q, k, v, do), (q, k, v, do))
kernel_bwd.zero_where_unseen = select
a = calls["documents+scale select"][0](q, k, v, do)
b = calls["documents+scale none"][0](q, k, v, do)
print("max |diff| dq:", float(jnp.max(jnp.abs(a[0].astype(jnp.float32) - b[0].astype(jnp.float32)))))
for name, t in time_interleaved(calls, rounds=11).items():
    print(f"{name:28s} {t * 1e3:.3f} ms")
