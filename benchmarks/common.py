"""Shared benchmark plumbing: timing, device ceilings, metadata, result files.

Every benchmark reports against ceilings measured on the same device in the
same process (a device-to-device copy and a large bf16 matmul), never
datasheet numbers.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import platform
import random
import re
import statistics
import sys
import time
import traceback
from typing import Callable, Dict, List, Optional, Tuple

import jax
import jax.numpy as jnp

RESULTS_DIR = os.path.join(os.path.dirname(__file__), "results")


def _block(x):
    return jax.tree_util.tree_map(lambda a: a.block_until_ready() if hasattr(a, "block_until_ready") else a, x)


def _time_round(fn: Callable, args: tuple, reps: int) -> float:
    """Seconds per call over `reps` back-to-back calls (launch gaps overlap as in a training step)."""
    t0 = time.perf_counter()
    out = None
    for _ in range(reps):
        out = fn(*args)
    _block(out)
    return (time.perf_counter() - t0) / reps


def time_fn(fn: Callable, *args, warmup: int = 3, reps: int = 20, rounds: int = 5) -> float:
    """Median seconds per call of a jitted `fn(*args)` over `rounds` rounds of `reps` calls."""
    for _ in range(warmup):
        _block(fn(*args))
    return statistics.median(_time_round(fn, args, reps) for _ in range(rounds))


def warmed(fn: Callable, *args) -> Callable:
    """`fn`, compiled and run once more on `args` (raises if it cannot run them)."""
    for _ in range(2):
        _block(fn(*args))
    return fn


def row_grid(shape: str, b: int, s: int, h_q: int, h_kv: int, d: int):
    """For one shape: (row, mode, config, flops) of every row, causal and not, forward
    and forward+backward; the row starts as {shape, causal, mode}."""
    from fusedattn.config import AttnConfig  # noqa: PLC0415
    for causal in (False, True):
        cfg = AttnConfig(batch=b, s_q=s, s_kv=s, h_q=h_q, h_kv=h_kv, d_qk=d, d_v=d,
                         dtype="bfloat16", mask="causal" if causal else "none")
        for mode in ("fwd", "fwd+bwd"):
            yield ({"shape": shape, "causal": causal, "mode": mode}, mode, cfg,
                   cfg.flops(backward=(mode == "fwd+bwd")))


def fwd_bwd(fn: Callable) -> Callable:
    """A jit of one forward and one backward of `fn(q, k, v)`, given d_out."""
    def run(q, k, v, d_out):
        _, vjp = jax.vjp(fn, q, k, v)
        return vjp(d_out)
    return jax.jit(run)


def step(fn: Callable, mode: str, q, k, v, d_out) -> Tuple[Callable, tuple]:
    """(jitted callable, its args) of `mode` ("fwd" or "fwd+bwd") of `fn(q, k, v)`."""
    return (jax.jit(fn), (q, k, v)) if mode == "fwd" else (fwd_bwd(fn), (q, k, v, d_out))


def warm_into(calls: Dict[str, Tuple[Callable, tuple]], name: str, fn: Callable,
              args: tuple) -> Optional[str]:
    """`calls[name] = (fn, args)` once `warmed`; else the error, in a line, for the row's
    notes (an implementation that cannot run a shape is reported, not fatal)."""
    try:
        calls[name] = (warmed(fn, *args), args)
        return None
    except Exception as e:  # noqa: BLE001
        text = " ".join(str(e).split())[:400]  # (the reason follows the first line)
        return f"{type(e).__name__}: {text}"


def time_row(row: dict, calls: Dict[str, Tuple[Callable, tuple]], flops: float,
             **timing) -> None:
    """Each call's TFLOP/s (row[name]) and ms (row[name + "_ms"]), timed round-robin
    (`timing`: time_interleaved's rounds / min_round_s)."""
    for name, t in time_interleaved(calls, **timing).items():
        row[name] = flops / t / 1e12
        row[name + "_ms"] = t * 1e3


def time_interleaved(calls: Dict[str, Tuple[Callable, tuple]], rounds: int = 7,
                     min_round_s: float = 0.025) -> Dict[str, float]:
    """Median seconds per call of each already warmed-up jitted `fn(*args)` in `calls`.

    Rounds go round-robin over the entries, so a drift of the device's clocks
    touches every entry alike and their ratios stay honest. Each round runs them in
    a new (seeded) order: in one fixed order an entry always follows the same
    neighbour, and there two entries running the very same kernels came out several
    percent apart while head to head they ran alike (docs/decisions.md). Each
    round repeats a call until it lasts about `min_round_s`, so short kernels are not
    timed against host jitter.
    """
    reps = {name: max(3, math.ceil(min_round_s / max(_time_round(fn, args, 1), 1e-6)))
            for name, (fn, args) in calls.items()}
    samples: Dict[str, List[float]] = {name: [] for name in calls}
    order = random.Random(0)
    for _ in range(rounds):
        names = list(calls)
        order.shuffle(names)
        for name in names:
            fn, args = calls[name]
            samples[name].append(_time_round(fn, args, reps[name]))
    return {name: statistics.median(s) for name, s in samples.items()}


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


COLLECTIVES = ("all-gather", "all-reduce", "collective-permute", "all-to-all", "reduce-scatter")


def collectives(hlo_text: str) -> Dict[str, int]:
    """How many of each collective the compiled HLO holds (async pairs counted once).
    The same count as the sharding tests' helper; the benchmarks do not import tests."""
    return {c: len(re.findall(rf"= [^=]*? {c}(?:-start)?\(", hlo_text)) for c in COLLECTIVES}


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
        from fusedattn.backends import extension as native
        meta.update(native.versions())
    except Exception:
        pass
    return meta


def device_slug(meta: Dict) -> str:
    """The device name as it goes into result file names ("nvidia_h200")."""
    return re.sub(r"[^A-Za-z0-9]+", "_", str(meta.get("device", "gpu"))).strip("_").lower()


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


def run_main(main: Callable[[], None]) -> None:
    """Runs a benchmark's main: a failure prints its traceback and exits 1 (ci/cuda.sh
    logs it and goes on with the next benchmark)."""
    try:
        main()
    except Exception:
        traceback.print_exc()
        sys.exit(1)
