"""Does cuDNN skip the fully masked blocks of a mask written into a score_mod? Times,
round-robin in one process, our plain causal cuDNN call beside the same causal mask
as a lowered mask_mod alone, with a relative-position score_mod, and the unmasked
score_mod. b4 s4096 h16 d128 bf16, TFLOP/s with the causal FLOP count (half) for
every row, so a rate near the plain causal one means the blocks were skipped. GPU.

    python -m benchmarks.tune.flex_mask_speed
"""
from __future__ import annotations

import os

import jax.numpy as jnp

import fusedattn
from benchmarks.bench_attention import _inputs
from benchmarks.common import print_table, run_main, step, time_row, warm_into
from fusedattn import score_mods
from fusedattn.backends.cudnn import causal_chunks
from fusedattn.config import AttnConfig

os.environ[causal_chunks.ENV_CHUNKS] = "1"  # one call each: what cuDNN itself skips

B, S, H, D = 4, 4096, 16, 128


def relpos(s, b, h, q, k):
    return s + 0.01 * (q - k)


def mask_first(s, b, h, q, k):
    """The causal select on the raw score first (where cuDNN's own mask sits), then the
    score_mod: exact while the score_mod keeps -inf at -inf."""
    return jnp.where(q >= k, s, -jnp.inf) + 0.01 * (q - k)


def mask_first_and_last(s, b, h, q, k):
    """As `mask_first`, and the mask again after the score_mod (exact for any)."""
    return jnp.where(q >= k, mask_first(s, b, h, q, k), -jnp.inf)


def softcap(s, b, h, q, k):
    return 30 * jnp.tanh(s / 30)


def alibi(s, b, h, q, k):
    return s + 0.01 * (h + 1) * (k - q)


def padded_relpos(s, b, h, q, k):
    """A padding-like select (keys past 4000 hidden) inside the score_mod."""
    return jnp.where(k < 4000, relpos(s, b, h, q, k), -jnp.inf)


FORMS = {  # name -> fused_attn keyword arguments ("chunks": FUSEDATTN_FLEX_CAUSAL_CHUNKS)
    "plain causal": dict(mask="causal"),
    "mask_mod q >= k": dict(mask_mod=lambda b, h, q, k: q >= k),
    "relpos + causal": dict(mask="causal", score_mod=relpos),
    "relpos + causal, 4 chunks": dict(mask="causal", score_mod=relpos, chunks=4),
    "mask first, relpos": dict(score_mod=mask_first),
    "mask, relpos, mask": dict(score_mod=mask_first_and_last),
    "relpos, no mask": dict(score_mod=relpos),
    "softcap + causal": dict(mask="causal", score_mod=softcap),
    "softcap + causal, 4 chunks": dict(mask="causal", score_mod=softcap, chunks=4),
    "alibi + causal": dict(mask="causal", score_mod=alibi),
    "built-in alibi + causal": dict(mask="causal", score_mod=score_mods.alibi(H)),
    "alibi slopes lambda + causal": dict(
        mask="causal", score_mod=lambda s, b, h, q, k, sl: s + sl[h] * (k - q),
        score_mod_args=(jnp.asarray(score_mods.alibi_slopes(H)),)),
    "padded relpos + causal": dict(mask="causal", score_mod=padded_relpos),
    "plain window 1024": dict(mask="causal", window=(1024, 0)),
    "relpos + window 1024": dict(mask="causal", window=(1024, 0), score_mod=relpos),
    "prefix-LM 512": dict(mask_mod=lambda b, h, q, k: (q >= k) | (k < 512)),
    "relpos + prefix-LM 512": dict(score_mod=relpos, mask_mod=lambda b, h, q, k: (q >= k) | (k < 512)),
}


def main():
    q, k, v, do = _inputs(B, S, H, H, D)
    causal = AttnConfig(batch=B, s_q=S, s_kv=S, h_q=H, h_kv=H, d_qk=D, d_v=D,
                        dtype="bfloat16", mask="causal")
    rows = []
    for mode in ("fwd", "fwd+bwd"):
        row = {"mode": mode}
        calls = {}
        for name, kw in FORMS.items():
            kw = dict(kw)
            os.environ[causal_chunks.ENV_CHUNKS] = str(kw.pop("chunks", 1))
            if mode == "fwd":
                plan = fusedattn.explain(q, k, v, backend="cudnn", **kw)
                print(name, [line for line in str(plan).splitlines() if "lowered" in line],
                      flush=True)
            fn = lambda q, k, v, kw=kw: fusedattn.fused_attn(q, k, v, backend="cudnn", **kw)  # noqa: E731
            why = warm_into(calls, name, *step(fn, mode, q, k, v, do))
            if why is not None:
                reason = dict(fusedattn.explain(q, k, v, backend="cudnn", **kw).reasons)
                print(f"{name} {mode}: {why}; cudnn: {reason.get('cudnn')}", flush=True)
        time_row(row, calls, causal.flops(backward=mode == "fwd+bwd"))
        rows.append(row)
    print_table(rows, ["mode"] + list(FORMS))


if __name__ == "__main__":
    run_main(main)
