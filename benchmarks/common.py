"""Shared benchmark plumbing: timing, device ceilings, metadata, result files.

Every benchmark reports against ceilings measured on the same device in the
same process (a device-to-device copy and a large bf16 matmul), never
datasheet numbers.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import time
from typing import Callable, Dict, List

import jax
import jax.numpy as jnp

RESULTS_DIR = os.path.join(os.path.dirname(__file__), "results")


def _block(x):
    return jax.tree_util.tree_map(lambda a: a.block_until_ready() if hasattr(a, "block_until_ready") else a, x)


def time_fn(fn: Callable, *args, warmup: int = 3, reps: int = 20, rounds: int = 5) -> float:
    """Median seconds per call of a jitted `fn(*args)`.

    Each round times `reps` back-to-back calls (so launch gaps overlap as in a
    training step) and divides; the median over rounds is returned.
    """
    for _ in range(warmup):
        _block(fn(*args))
    per_call = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        out = None
        for _ in range(reps):
            out = fn(*args)
        _block(out)
        per_call.append((time.perf_counter() - t0) / reps)
    return statistics.median(per_call)


def measure_ceilings() -> Dict[str, float]:
    """Measured copy bandwidth (GB/s, bytes read + written) and bf16 matmul TFLOP/s."""
    n_bytes = 1 << 30 if jax.default_backend() != "cpu" else 1 << 26
    x = jnp.ones((n_bytes // 4,), jnp.float32) * 1.5
    copy = jax.jit(lambda a: a + 0.0)  # one read, one write, fused by XLA
    t = time_fn(copy, x, reps=10)
    copy_gbps = 2 * n_bytes / t / 1e9
    n = 8192 if jax.default_backend() != "cpu" else 1024
    key = jax.random.PRNGKey(0)
    a = jax.random.normal(key, (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.fold_in(key, 1), (n, n), jnp.bfloat16)
    mm = jax.jit(lambda a, b: a @ b)
    t = time_fn(mm, a, b, reps=10)
    return {"copy_GBps": copy_gbps, "bf16_matmul_TFLOPs": 2 * n**3 / t / 1e12}


def device_meta() -> Dict[str, str]:
    """Device, software versions and date, recorded with every result file."""
    dev = jax.devices()[0]
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": getattr(dev, "device_kind", str(dev)),
        "platform": jax.default_backend(),
        "jax": jax.__version__,
        "python": platform.python_version(),
    }
    try:
        import jaxlib
        meta["jaxlib"] = jaxlib.__version__
    except Exception:
        pass
    try:
        from fusedattn.backends import native
        meta.update(native.versions())
    except Exception:
        pass
    return meta


def write_results(name: str, rows: List[dict], meta: Dict, out_dir: str = RESULTS_DIR) -> str:
    """Write `<name>.json` (meta + rows); returns the path."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.json")
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return path


def print_table(rows: List[dict], columns: List[str]) -> None:
    """A plain fixed-width table on stdout."""
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(widths[c]) for c in columns))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return "" if v is None else str(v)
