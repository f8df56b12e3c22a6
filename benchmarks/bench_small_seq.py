"""Small-seq attention: GB/s and fraction of measured copy bandwidth.

30720 query tokens x h (8, 16) x d (128, 256, 512) x kv (4, 16) full lengths,
plus ragged lengths (uniform in [1, 15], mean 8, of a 16-key padding), bf16,
MHA. Side by side: our kernels (fused_attn_small_seq, backend small_seq; the
ragged case also with packed keys), jax.nn.dot_product_attention xla (the
dense padded einsum), jax.nn cudnn and our cudnn path (fused_attn backend
cudnn), each where it runs.

Bytes: the fewest our kernels must move for that input (q, k, v valid keys,
o; backward adds do, o, dq, dk, dv; padded dk/dv are written in full). The
fraction is GB/s over the copy bandwidth measured in the same process. The
backward time is (forward + backward) - forward.

  python -m benchmarks.bench_small_seq [--quick]
"""
from __future__ import annotations

import argparse
import os

# Every provider of a case stays ready for interleaved timing; the largest case
# (h16 d512, ragged: padded and packed keys, two calls' gradients in flight, XLA's
# scratch) needs more than JAX's default 75% of the device's memory.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import fusedattn  # noqa: E402
from benchmarks.common import (device_meta, measure_ceilings, print_table,  # noqa: E402
                               time_interleaved, warmed, write_results)
from fusedattn.sequence import SequenceDescriptor  # noqa: E402
from fusedattn.small_seq_api import fused_attn_small_seq  # noqa: E402

TOKENS = 30720
ELEM = 2  # bf16


def _providers(lengths, packed_offsets):
    """name -> f(q, k, v) for padded k, v [n, s, h, d] (packed: [total, h, d])."""
    lens = jnp.asarray(lengths)
    seq = SequenceDescriptor.from_lengths(jnp.ones_like(lens), lens)
    out = {
        "small_seq": lambda q, k, v: fused_attn_small_seq(q, k, v, sequence=lens, backend="small_seq"),
        "jax.nn xla": lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, key_value_seq_lengths=lens, implementation="xla"),
        "jax.nn cudnn": lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, key_value_seq_lengths=lens, implementation="cudnn"),
        "fusedattn cudnn": lambda q, k, v: fusedattn.fused_attn(q, k, v, sequence=seq, backend="cudnn"),
    }
    if packed_offsets is not None:
        offs = jnp.asarray(packed_offsets)
        out["small_seq packed"] = lambda q, k, v: fused_attn_small_seq(
            q, k, v, sequence=offs, backend="small_seq")
    return out


def _bytes(n, h, d, s, lengths, packed):
    row = h * d * ELEM
    valid = int(np.sum(lengths))
    kv_read = 2 * valid * row
    fwd = 2 * n * row + kv_read  # q, o + valid k, v
    kv_write = 2 * (valid if packed else n * s) * row
    bwd = 4 * n * row + kv_read + kv_write + n * h * 4  # q, o, do, dq + k, v + dk, dv + lse
    return fwd, bwd


def _compiled_pair(fn, q, k, v, d_o):
    """Jitted forward and forward+backward of `fn`, compiled and run once (raises if it cannot)."""
    step = jax.jit(lambda q, k, v, d_o: jax.vjp(fn, q, k, v)[1](d_o))
    return warmed(jax.jit(fn), q, k, v), warmed(step, q, k, v, d_o)


def run(quick: bool):
    ceilings = measure_ceilings()
    copy = ceilings["copy_GBps"]
    print(f"copy bandwidth {copy:.0f} GB/s", flush=True)
    rng = np.random.default_rng(0)
    cases = []
    for h in (8, 16):
        for d in (128, 256, 512):
            for kv in (4, 16, "ragged"):
                cases.append((h, d, kv))
    if quick:
        cases = [(16, 128, 4), (16, 128, 16), (16, 128, "ragged"), (16, 512, 16)]
    rows = []
    for h, d, kv in cases:
        s = 16 if kv == "ragged" else kv
        lengths = (rng.integers(1, 16, size=TOKENS) if kv == "ragged"
                   else np.full(TOKENS, kv)).astype(np.int32)
        key = jax.random.PRNGKey(h * 1000 + d)
        ks = jax.random.split(key, 4)
        q = jax.random.normal(ks[0], (TOKENS, 1, h, d), jnp.bfloat16)
        k = jax.random.normal(ks[1], (TOKENS, s, h, d), jnp.bfloat16)
        v = jax.random.normal(ks[2], (TOKENS, s, h, d), jnp.bfloat16)
        d_o = jax.random.normal(ks[3], (TOKENS, 1, h, d), jnp.bfloat16)
        offsets = None
        if kv == "ragged":
            offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        base = {"tokens": TOKENS, "h": h, "d": d, "kv": str(kv), "mean_kv": float(lengths.mean())}
        calls, case_rows = {}, []
        for name, fn in _providers(lengths, offsets).items():
            packed = name.endswith("packed")
            args = (q, k, v)
            if packed:  # the same keys, packed back to back
                valid = np.arange(s)[None, :] < lengths[:, None]
                idx = np.nonzero(valid.reshape(-1))[0]
                args = (q, k.reshape(TOKENS * s, h, d)[idx], v.reshape(TOKENS * s, h, d)[idx])
            row = dict(base, provider=name)
            case_rows.append(row)
            try:
                fwd, step = _compiled_pair(fn, *args, d_o)
            except Exception as e:  # a provider that cannot run this shape: say why
                row["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:240]}"
                print(f"{name:16s} h{h} d{d} kv{kv}: {row['error']}", flush=True)
                continue
            calls[(name, "fwd")] = (fwd, args)
            calls[(name, "all")] = (step, args + (d_o,))
        times = time_interleaved(calls)
        for row in case_rows:
            name = row["provider"]
            if "error" in row:
                continue
            t_f = times[(name, "fwd")]
            t_b = max(times[(name, "all")] - t_f, 1e-9)  # backward = (forward + backward) - forward
            fwd_bytes, bwd_bytes = _bytes(TOKENS, h, d, s, lengths, name.endswith("packed"))
            row.update(fwd_ms=t_f * 1e3, bwd_ms=t_b * 1e3,
                       fwd_GBps=fwd_bytes / t_f / 1e9, bwd_GBps=bwd_bytes / t_b / 1e9)
            row.update(fwd_frac=row["fwd_GBps"] / copy, bwd_frac=row["bwd_GBps"] / copy)
            print(f"{name:16s} h{h} d{d} kv{kv}: fwd {row['fwd_ms']:.3f} ms {row['fwd_frac']:.2f} "
                  f"bwd {row['bwd_ms']:.3f} ms {row['bwd_frac']:.2f}", flush=True)
        rows.extend(case_rows)
        del calls
        del q, k, v, d_o
    _add_speedups(rows)
    meta = dict(device_meta(), **ceilings, tokens=TOKENS, dtype="bfloat16",
                bytes="fewest our kernels move (valid keys; padded dk/dv in full)")
    path = write_results("small_seq" + ("_quick" if quick else ""), rows, meta)
    print_table(rows, ["provider", "h", "d", "kv", "fwd_ms", "fwd_frac", "bwd_ms", "bwd_frac",
                       "fwd_vs_xla", "bwd_vs_xla", "error"])
    _plot(rows, path.replace(".json", ".png"), copy)
    print("wrote", path)


def _add_speedups(rows):
    """Time of jax.nn xla over ours (the same case): > 1 means we are faster."""
    xla = {(r["h"], r["d"], r["kv"]): r for r in rows if r["provider"] == "jax.nn xla" and "fwd_ms" in r}
    for r in rows:
        x = xla.get((r["h"], r["d"], r["kv"]))
        if x is not None and "fwd_ms" in r:
            r["fwd_vs_xla"] = x["fwd_ms"] / r["fwd_ms"]
            r["bwd_vs_xla"] = x["bwd_ms"] / r["bwd_ms"]


def _plot(rows, path, copy):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    providers = sorted({r["provider"] for r in rows})
    cases = sorted({(r["h"], r["d"], r["kv"]) for r in rows}, key=str)
    fig, axes = plt.subplots(2, 1, figsize=(max(8, len(cases) * 0.8), 7), sharex=True)
    width = 0.8 / len(providers)
    for ax, key in zip(axes, ("fwd_frac", "bwd_frac")):
        for i, p in enumerate(providers):
            vals = [next((r.get(key, 0) for r in rows if r["provider"] == p
                          and (r["h"], r["d"], r["kv"]) == c), 0) for c in cases]
            ax.bar(np.arange(len(cases)) + i * width, vals, width, label=p)
        ax.axhline(1.0, color="k", lw=0.5)
        ax.set_ylabel(f"{key.split('_')[0]} / copy BW ({copy:.0f} GB/s)")
    axes[1].set_xticks(np.arange(len(cases)) + 0.4)
    axes[1].set_xticklabels([f"h{h} d{d}\nkv{kv}" for h, d, kv in cases], fontsize=7)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="four cases only")
    run(parser.parse_args().quick)
