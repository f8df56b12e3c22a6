"""Choosing between backends that both run a config exactly, by measured speed.

On CUDA, cudnn and flash (FlashAttention-3) serve the same common training configs,
and which is faster depends on the shape: FA3 leads at head dim 128 forward+backward,
cuDNN at head dim 64 (benchmarks/results/SUMMARY.md). When `backend="auto"` finds
more than one backend of a `RIVALS` group usable, the first call of a config times
each of them once on this GPU: the forward alone (what a call without a gradient
runs) and forward+backward (what a training step runs). The faster backend of
each becomes that step's backend, both are remembered in memory and in the
persistent cache (`fusedattn.plan_cache`, keyed by GPU model and library
versions), and `explain()` prints the timings chosen by.

Measuring costs one compilation per step, compiled side by side, and a few runs per
rival, once per config and machine: 0.56-0.63 s at b4 s4096 h16 (H100, 2026-11-24,
benchmarks/tune/choice_cost.py), and a cold first auto step 1.3-1.6 s in all. A
config beyond `MAX_ROWS` query rows is timed at a smaller batch (`measured_config`):
a larger batch repeats the same tiles, and a sharded call's global batch need not fit
on one device. ``FUSEDATTN_MEASURE=0`` turns it off: the preference order decides
(cudnn first). A measurement that
fails (out of memory, a kernel error) is stated in the plan and the preference
order decides.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import importlib
import logging
import math
import os
import threading
import time
from typing import Callable, Dict, Optional, Sequence, Tuple

from . import plan_cache
from .config import AttnConfig

log = logging.getLogger("fusedattn")

ENV_MEASURE = "FUSEDATTN_MEASURE"
# Per platform, backends that may run the same configs; listed in preference order.
RIVALS: Dict[str, Tuple[str, ...]] = {"cuda": ("cudnn", "flash")}
# Each timing repeats a step for about this long, best of ROUNDS interleaved rounds,
# after WARM_SECONDS of running every step (the GPU's clocks settle after the
# compilations; H100, 2026-11-24: with 3 rounds and no such warm-up one run picked
# cudnn for a causal d128 forward that FA3 runs 11% faster). Three measurements of
# b4 s4096 h16 d128 (benchmarks/tune/choice_stability.py) agreed within 1%.
MIN_SECONDS = 0.01
ROUNDS = 5
WARM_SECONDS = 0.2
# What stored timings mean; bumped when what or how we measure changes, so choices
# stored before are measured again. 2 (2026-11-24): flash trains every config it runs
# (earlier entries hold no training time where its backward was wrong) and the
# warm-up before the rounds.
STORE_REVISION = 2


@dataclasses.dataclass(frozen=True)
class Choice:
    """The backends a measurement picked for one config, and why."""
    inference: str           # runs calls without a gradient
    training: str            # runs forward + backward of differentiated calls
    # (backend, forward ms, forward+backward ms or None where it must not train) per
    # rival measured.
    timings: Tuple[Tuple[str, float, Optional[float]], ...]
    source: str              # "measured now" or "persistent cache"

    def describe(self) -> str:
        rows = ", ".join(f"{name} {fwd:.3f} / {'n/a' if step is None else f'{step:.3f}'} ms"
                         for name, fwd, step in self.timings)
        return (f"measured forward / forward+backward ({self.source}): {rows}; "
                f"inference -> {self.inference}, training -> {self.training}")


def enabled() -> bool:
    return os.environ.get(ENV_MEASURE, "1").strip().lower() not in ("0", "false", "off", "no")


def rivals(platform: str, usable: Sequence[str]) -> Tuple[str, ...]:
    """The usable backends of `platform`'s rival group, when the group leads the
    preference order (the first usable backend is one of them) and has two or more."""
    group = RIVALS.get(platform, ())
    if not usable or usable[0] not in group:
        return ()
    found = tuple(name for name in group if name in usable)
    return found if len(found) > 1 else ()


def pick(timings: Sequence[Tuple[str, float, Optional[float]]], source: str) -> Choice:
    """The fastest backend per step (ties go to the earlier, preferred, one); a backend
    without a forward+backward time does not train."""
    inference = min(timings, key=lambda t: t[1])[0]
    trainable = [t for t in timings if t[2] is not None]
    training = min(trainable, key=lambda t: t[2])[0] if trainable else timings[0][0]
    return Choice(inference, training, tuple(timings), source)


# Query rows (batch x query heads x s_q) a measurement times at most: b4 s4096 h32.
MAX_ROWS = 1 << 19


def measured_config(config: AttnConfig) -> AttnConfig:
    """The config a measurement times: `config`, with its batch cut to stay within
    MAX_ROWS query rows (dense configs without bias only, whose batch is only a count)."""
    rows = config.h_q * config.s_q
    if config.batch * rows <= MAX_ROWS or config.has_bias or config.sequence != "dense":
        return config
    return dataclasses.replace(config, batch=max(1, MAX_ROWS // rows))


_choices: Dict[tuple, Choice] = {}
_lock = threading.Lock()  # one measurement at a time: they share the GPU


def choose(config: AttnConfig, platform: str, candidates: Tuple[str, ...],
           measure: Optional[Callable[[AttnConfig, Tuple[str, ...]], list]] = None,
           identity: Optional[dict] = None) -> Choice:
    """The measured choice among `candidates` for `config` (memory, then disk, then a
    measurement). `measure(config, candidates)` returns [(name, fwd s, fwd+bwd s)];
    `identity` names the machine for the persistent cache (None: not persisted).
    Raises whatever the measurement raises."""
    key = (config, platform, candidates)
    with _lock:
        found = _choices.get(key)
        if found is not None:
            return found
        disk_identity = None if identity is None else stored_identity(identity, config,
                                                                        candidates)
        stored = None if disk_identity is None else plan_cache.load_json(disk_identity)
        if _valid(stored, candidates):
            found = pick([tuple(t) for t in stored], "persistent cache")
        else:
            t0 = time.perf_counter()
            timed = measured_config(config)
            timings = [(name, 1e3 * fwd, None if step is None else 1e3 * step)
                       for name, fwd, step in (measure or measure_on_device)(timed, candidates)]
            found = pick(timings, "measured now" + (
                f" at batch {timed.batch} of {config.batch}" if timed is not config else ""))
            log.info("fusedattn: %s: %s (%.2f s)", config.short(), found.describe(),
                     time.perf_counter() - t0)
            if disk_identity is not None:
                plan_cache.store_json(disk_identity, [list(t) for t in timings])
        _choices[key] = found
        return found


def stored_identity(identity: dict, config: AttnConfig, candidates: Tuple[str, ...]) -> dict:
    """The persistent cache's key of a choice on the machine `identity` names."""
    return {**identity, "what": "backend-choice", "revision": STORE_REVISION,
            "config": repr(config), "candidates": list(candidates)}


def _valid(stored, candidates) -> bool:
    def positive(x):
        return isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0
    return (isinstance(stored, list) and len(stored) == len(candidates)
            and all(isinstance(t, list) and len(t) == 3 and t[0] == name and positive(t[1])
                    and (t[2] is None or positive(t[2]))
                    for t, name in zip(stored, candidates)))


def machine_identity() -> dict:
    """What a stored choice is valid for: the GPU model and every library version that
    could change a timing."""
    import jax  # noqa: PLC0415

    from .backends import flash, native  # noqa: PLC0415
    versions = native.versions()
    return {"gpu": jax.devices()[0].device_kind, "jax": jax.__version__,
            "jaxlib": jax.lib.__version__ if hasattr(jax.lib, "__version__") else None,
            "cudnn": versions.get("cudnn"), "cudnn_frontend": versions.get("cudnn_frontend"),
            "flash_attn3_jax": flash.package_version()}


def clear() -> None:
    """Forget in-memory choices (tests)."""
    with _lock:
        _choices.clear()


# ---- timing on the device -------------------------------------------------------------
def measure_on_device(config: AttnConfig, candidates: Tuple[str, ...]):
    """[(name, forward seconds, forward+backward seconds)] for each candidate, on random
    inputs of the config's shapes on the default device, timed round-robin; the
    forward+backward time is None for a backend whose module's optional
    `training_reason(config)` refuses its backward.

    Dispatch runs inside the trace of the user's jit, where every JAX call is staged
    into that trace instead of running. JAX's trace state is per thread, so the
    measurement runs on a thread of its own, where calls execute."""
    result: list = []

    def run():
        try:
            result.append(_measure(config, candidates))
        except BaseException as e:  # re-raised in the caller's thread
            result.append(e)
    thread = threading.Thread(target=run, name="fusedattn-measure")
    thread.start()
    thread.join()
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


def _measure(config: AttnConfig, candidates: Tuple[str, ...]):
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    from .backends.base import AttnInputs  # noqa: PLC0415
    from .dispatch import load_backend  # noqa: PLC0415

    dtype = jnp.dtype(config.dtype)
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(keys[0], (config.batch, config.s_q, config.h_q, config.d_qk), dtype)
    k = jax.random.normal(keys[1], (config.batch, config.s_kv, config.h_kv, config.d_qk), dtype)
    v = jax.random.normal(keys[2], (config.batch, config.s_kv, config.h_kv, config.d_v), dtype)
    d_out = jax.random.normal(keys[3], (config.batch, config.s_q, config.h_q, config.d_v), dtype)

    def steps(name):
        backend = load_backend(name)
        module = importlib.import_module(f"fusedattn.backends.{name}")
        trains = getattr(module, "training_reason", lambda c: None)(config) is None

        def attend(q, k, v):
            return backend.attention(config, AttnInputs(q, k, v))

        def train(q, k, v, d_out):
            _, vjp = jax.vjp(attend, q, k, v)
            return vjp(d_out)
        return [(jax.jit(attend), (q, k, v))] + ([(jax.jit(train), (q, k, v, d_out))]
                                                 if trains else [])

    calls = {name: steps(name) for name in candidates}
    keys = [(name, i) for name, pair in calls.items() for i in range(len(pair))]
    # Compiled side by side: XLA compiles outside the GIL, and compilation is most of
    # a measurement's cost.
    with concurrent.futures.ThreadPoolExecutor(len(keys)) as pool:
        compiled = dict(zip(keys, pool.map(
            lambda key: _compiled(*calls[key[0]][key[1]]), keys)))
    # The warm-up also says how long each call takes, hence how many make a timing.
    last = {}
    start = time.perf_counter()
    while time.perf_counter() - start < WARM_SECONDS:
        for key, (fn, args) in compiled.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            last[key] = time.perf_counter() - t0
    reps = {key: min(1024, max(1, math.ceil(MIN_SECONDS / max(last[key], 1e-6))))
            for key in keys}
    best = {key: float("inf") for key in keys}
    for _ in range(ROUNDS):
        for key, (fn, args) in compiled.items():
            best[key] = min(best[key], _seconds_per_call(fn, args, reps[key]))
    return [(name, best[name, 0], best.get((name, 1))) for name in candidates]


def _compiled(fn, args):
    """(fn compiled for args, args), run once (a step that cannot run raises here)."""
    import jax  # noqa: PLC0415
    executable = fn.lower(*args).compile()
    jax.block_until_ready(executable(*args))
    return executable, args


def _seconds_per_call(fn, args, n: int) -> float:
    import jax  # noqa: PLC0415
    t0 = time.perf_counter()
    for _ in range(n):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / n
