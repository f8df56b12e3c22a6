"""score_mods on one GPU: our cuDNN score_mod path (any JAX function, lowered), what
`auto` runs (the block-sparse kernels for a score_mod cuDNN refuses), our plain cuDNN,
the XLA backend and PyTorch flex_attention (torch.compile), forward and
forward+backward, TFLOP/s (causal halved; forward+backward = 3.5x the forward).

JAX rows run round-robin in this process (benchmarks/common.py); PyTorch runs in a
child process (the two frameworks do not share GPU memory) timing its rows the
same way, on the same shapes. b4 s4096 h16 d128 bf16.

    python -m benchmarks.bench_flex [--only CASE,CASE,...] [--no-torch]

Writes benchmarks/results/flex_<device>.json (not with `--only` or `--no-torch`: the page
keeps every row beside its anchor).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os

import jax
import jax.numpy as jnp

import fusedattn
from benchmarks.bench_attention import _inputs
from benchmarks import torch_flex
from benchmarks.common import (device_meta, device_slug, print_table, run_main, step, time_row,
                               warm_into, write_results)
from fusedattn import score_mods
from fusedattn.backends.cudnn import causal_chunks
from fusedattn.config import AttnConfig

B, S, H, D = 4, 4096, 16, 128
SLOPES = jnp.asarray(score_mods.alibi_slopes(H))

# name -> (score_mod, mask_mod, mask, uses slopes)
CASES = {
    "relative_position": (lambda s, b, h, q, k: s + 0.01 * (q - k), None, "none", False),
    "softcap": (lambda s, b, h, q, k: 30.0 * jnp.tanh(s / 30.0), None, "none", False),
    "alibi_lambda": (lambda s, b, h, q, k, sl: s + sl[h] * (k - q), None, "causal", True),
    "causal_relative_position": (lambda s, b, h, q, k: s + 0.01 * (q - k), None, "causal",
                                 False),
    "document_mask": (None, lambda b, h, q, k: (q // 1024) == (k // 1024), "none", False),
    # (cuDNN's engines have no backward for a clip: `auto` runs the block-sparse kernels)
    "causal_clip": (lambda s, b, h, q, k: jnp.clip(s, -2.0, 2.0), None, "causal", False),
}

# Query chunk counts tried for causal cases (FUSEDATTN_FLEX_CAUSAL_CHUNKS), beside the
# default (one call, whose hidden tiles cuDNN skips); a mask_mod's case tries one call
# (its default is the chunks of fusedattn.backends.cudnn.mask_chunks).
CHUNKS = (4,)


@contextlib.contextmanager
def _chunk_count(impl: str):
    """FUSEDATTN_FLEX_CAUSAL_CHUNKS as an implementation's name says (-chunksN)."""
    n = impl.rpartition("-chunks")[2] if "-chunks" in impl else None
    previous = os.environ.get(causal_chunks.ENV_CHUNKS)
    if n is not None:
        os.environ[causal_chunks.ENV_CHUNKS] = n
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(causal_chunks.ENV_CHUNKS, None)
        else:
            os.environ[causal_chunks.ENV_CHUNKS] = previous


# The cases as torch flex_attention score_mods and mask_mods (`torch_flex` runs and
# times them).
TORCH_CASES = r'''
slopes = torch.tensor([2 ** (-8.0 * (i + 1) / H) for i in range(H)], device="cuda")
cases = {
  "relative_position": (lambda s, b, h, i, j: s + 0.01 * (i - j), None),
  "softcap": (lambda s, b, h, i, j: 30.0 * torch.tanh(s / 30.0), None),
  "alibi_lambda": (lambda s, b, h, i, j: s + slopes[h] * (j - i), lambda b, h, i, j: j <= i),
  "causal_relative_position": (lambda s, b, h, i, j: s + 0.01 * (i - j), lambda b, h, i, j: j <= i),
  "document_mask": (None, lambda b, h, i, j: (i // 1024) == (j // 1024)),
  "causal_clip": (lambda s, b, h, i, j: torch.clamp(s, -2.0, 2.0), lambda b, h, i, j: j <= i),
}
'''


def torch_times(only=None) -> dict:
    """{case: {mode: seconds}} from PyTorch flex_attention in a child process."""
    cases = TORCH_CASES
    if only is not None:
        cases += f"cases = {{k: c for k, c in cases.items() if k in {sorted(only)!r}}}\n"
    return torch_flex.times(B, S, H, D, cases)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", help="comma-separated cases to run; the page is not written")
    ap.add_argument("--no-torch", action="store_true", help="skip torch flex_attention")
    opts = ap.parse_args()
    only = None if opts.only is None else set(opts.only.split(","))
    if only is not None and only - set(CASES):
        raise SystemExit(f"--only: unknown cases {sorted(only - set(CASES))}")
    if jax.default_backend() != "gpu":
        print("bench_flex: needs a CUDA GPU, skipped")
        return
    meta = device_meta()
    print(f"device {meta.get('device')}  jax {meta.get('jax')}  cuDNN {meta.get('cudnn')}",
          flush=True)
    notes = {}
    try:
        torch = {} if opts.no_torch else torch_times(only)
    except Exception as e:  # noqa: BLE001 - the anchor is reported missing, with why
        torch, notes["torch"] = {}, f"{type(e).__name__}: {str(e)[:300]}"
    q, k, v, do = _inputs(B, S, H, H, D)
    rows = []
    for name, (mod, mask_mod, mask, slopes) in CASES.items():
        if only is not None and name not in only:
            continue
        args = (SLOPES,) if slopes else ()
        cfg = AttnConfig(batch=B, s_q=S, s_kv=S, h_q=H, h_kv=H, d_qk=D, d_v=D,
                         dtype="bfloat16", mask=mask)
        impls = {
            "fusedattn-cudnn-flex": lambda q, k, v, m=mod, mm=mask_mod, a=args, mk=mask:
                fusedattn.fused_attn(q, k, v, mask=mk, score_mod=m, mask_mod=mm,
                                     score_mod_args=a, backend="cudnn"),
            "fusedattn-auto": lambda q, k, v, m=mod, mm=mask_mod, a=args, mk=mask:
                fusedattn.fused_attn(q, k, v, mask=mk, score_mod=m, mask_mod=mm,
                                     score_mod_args=a),
            "fusedattn-xla": lambda q, k, v, m=mod, mm=mask_mod, a=args, mk=mask:
                fusedattn.fused_attn(q, k, v, mask=mk, score_mod=m, mask_mod=mm,
                                     score_mod_args=a, backend="xla"),
            "fusedattn-cudnn-plain": lambda q, k, v, mk=mask:
                fusedattn.fused_attn(q, k, v, mask=mk, backend="cudnn"),
        }
        # The causal score_mod in query chunks (fusedattn.backends.cudnn.causal_chunks), a mask_mod in
        # the chunks its blocks give (fusedattn.backends.cudnn.mask_chunks, off with chunks1).
        for n in CHUNKS if mask == "causal" else (1,) if mask_mod is not None else ():
            # a function of its own: jit would reuse the unchunked trace of the same one
            impls[f"fusedattn-cudnn-flex-chunks{n}"] = (
                lambda q, k, v, f=impls["fusedattn-cudnn-flex"]: f(q, k, v))
        for mode in ("fwd", "fwd+bwd"):
            row = {"case": name, "mode": mode}
            flops = cfg.flops(backward=mode == "fwd+bwd")
            calls = {}
            for impl, fn in impls.items():
                with _chunk_count(impl):  # read when the call is traced
                    why = warm_into(calls, impl, *step(fn, mode, q, k, v, do))
                if why is not None:
                    notes[f"{impl} {name} {mode}"] = why
            time_row(row, calls, flops)
            if torch.get(name, {}).get(mode):
                row["torch-flex"] = flops / torch[name][mode] / 1e12
            ours = row.get("fusedattn-cudnn-flex")
            for other in ("fusedattn-cudnn-plain", "fusedattn-xla", "torch-flex"):
                if ours and row.get(other):
                    row[f"x {other}"] = ours / row[other]
                if row.get("fusedattn-auto") and row.get(other):
                    row[f"auto x {other}"] = row["fusedattn-auto"] / row[other]
            row["auto runs"] = fusedattn.explain(q, k, v, mask=mask, score_mod=mod,
                                                 mask_mod=mask_mod,
                                                 score_mod_args=args).chosen
            for n in CHUNKS + (1,):
                chunked = row.get(f"fusedattn-cudnn-flex-chunks{n}")
                if chunked and row.get("torch-flex"):
                    row[f"chunks{n} x torch-flex"] = chunked / row["torch-flex"]
            rows.append(row)
            print(f"  {name} {mode}: " + ", ".join(f"{i}={row[i]:.0f}" for i in row
                                                   if isinstance(row[i], float) and "x " not in i
                                                   and not i.endswith("_ms")),
                  flush=True)
    print("\nTFLOP/s (bf16; causal halved) and ratios of fusedattn-cudnn-flex")
    print_table(rows, ["case", "mode", "fusedattn-cudnn-flex", "fusedattn-auto", "auto runs",
                       "fusedattn-cudnn-plain", "fusedattn-xla", "torch-flex",
                       "x fusedattn-cudnn-plain", "x fusedattn-xla", "x torch-flex",
                       "auto x fusedattn-xla", "auto x torch-flex"]
                + [f"chunks{n} x torch-flex" for n in CHUNKS + (1,)])
    for key, value in notes.items():
        print(f"note: {key}: {value}")
    meta.update({"notes": notes, "shape": f"b{B} s{S} h{H} d{D}"})
    if only is None and not opts.no_torch:
        print("wrote", write_results(f"flex_{device_slug(meta)}", rows, meta))


if __name__ == "__main__":
    run_main(main)
