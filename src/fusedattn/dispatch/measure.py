"""Choosing between backends that both run a config exactly, by measured speed.

On CUDA, cudnn and flash (FlashAttention-3) serve the same common training configs,
and which is faster depends on the shape and the GPU (benchmarks/results/SUMMARY.md).
When `backend="auto"` finds
more than one backend of a `RIVALS` group usable, each step of a config is timed on
this GPU the first time a call needs it: "inference" (the forward alone, what a call
nobody differentiates runs) and "training" (forward+backward, what a differentiated
call runs). The faster backend runs that step; the choice is remembered in memory
and in the persistent cache (`fusedattn.plan_cache`, keyed by GPU model and library
versions), and `explain()` prints the timings chosen by. Timing each step only when
needed spares a training job's first step the forward-only timings it never uses.

Measuring one step costs one compilation per rival, side by side (while the random
inputs are made), 0.2 s of warm-up and a few runs per rival, once per config and
machine (its cost: docs/decisions.md, `benchmarks/tune/choice_cost.py`). A
config beyond `MAX_ROWS` query rows is timed at a smaller batch (`measured_config`):
a larger batch repeats the same tiles, and a sharded call's global batch need not fit
on one device. ``FUSEDATTN_MEASURE=0`` turns it off: the preference order decides
(cudnn first). A measurement that fails (out of memory, a kernel error) is stated in
the plan, and the preference order decides.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import math
import os
import threading
import time
from typing import Callable, Dict, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from .. import plan_cache
from ..backends import extension, flash
from ..config import AttnConfig
from ..inputs import AttnInputs
from ..sequence import SequenceDescriptor
from .registry import load_backend

log = logging.getLogger("fusedattn")

ENV_MEASURE = "FUSEDATTN_MEASURE"
# Per platform, backends that may run the same configs; listed in preference order.
RIVALS: Dict[str, Tuple[str, ...]] = {"cuda": ("cudnn", "flash")}
# Each timing repeats a step for about this long, best of ROUNDS interleaved rounds,
# after WARM_SECONDS of running every step: the GPU's clocks settle after the
# compilations, and without the warm-up a close choice flipped (docs/decisions.md).
MIN_SECONDS = 0.01
ROUNDS = 5
WARM_SECONDS = 0.2
# What stored timings mean; bumped when what or how we measure changes, so choices
# stored before are measured again. 2: flash trains every config it runs, and the
# warm-up before the rounds. 3: one entry per step.
STORE_REVISION = 3
# The steps a choice is made for: "inference" times the forward alone (calls nobody
# differentiates), "training" forward + backward (differentiated calls).
STEPS = ("inference", "training")


@dataclasses.dataclass(frozen=True)
class Choice:
    """The backend a measurement picked for one step of one config, and why."""
    step: str                # one of STEPS
    backend: str
    timings: Tuple[Tuple[str, float], ...]  # (backend, ms per step) per rival measured
    source: str              # "measured now", "persistent cache", or why none decided

    def describe(self) -> str:
        what = "forward" if self.step == "inference" else "forward+backward"
        rows = ", ".join(f"{name} {ms:.3f} ms" for name, ms in self.timings)
        return f"{self.step} ({what}{': ' + rows if rows else ''}; {self.source}) -> {self.backend}"


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


def pick(step: str, timings: Sequence[Tuple[str, float]], source: str) -> Choice:
    """The fastest backend (ties go to the earlier, preferred, one)."""
    return Choice(step, min(timings, key=lambda t: t[1])[0], tuple(timings), source)


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


def choose(config: AttnConfig, platform: str, candidates: Tuple[str, ...], step: str,
           measure: Optional[Callable[[AttnConfig, Tuple[str, ...], str], list]] = None,
           identity: Optional[dict] = None) -> Choice:
    """The measured choice among `candidates` for `step` of `config` (memory, then
    disk, then a measurement). `measure(config, candidates, step)` returns
    [(name, seconds per step)]; `identity` names the machine for the persistent cache
    (None: not persisted). A measurement that fails leaves the choice to the
    preference order (candidates[0]) for this process, and the choice says why."""
    if step not in STEPS:
        raise ValueError(f"step must be one of {STEPS}, got {step!r}")
    key = (config, platform, candidates, step)
    with _lock:
        found = _choices.get(key)
        if found is None:
            found = _load_or_measure(config, candidates, step, measure or measure_on_device,
                                     identity)
            _choices[key] = found
        return found


def _load_or_measure(config, candidates, step, measure, identity) -> Choice:
    disk_identity = None if identity is None else stored_identity(identity, config,
                                                                    candidates, step)
    stored = None if disk_identity is None else plan_cache.load_json(disk_identity)
    if _valid(stored, candidates):
        return pick(step, [tuple(t) for t in stored], "persistent cache")
    t0 = time.perf_counter()
    timed = measured_config(config)
    try:
        timings = [(name, 1e3 * seconds) for name, seconds in measure(timed, candidates, step)]
    except Exception as e:  # out of memory, a kernel error: say so, keep the preference
        log.warning("fusedattn: measuring %s for %s (%s) failed: %s", candidates,
                    config.short(), step, e)
        first_line = str(e).splitlines()[0][:200] if str(e) else ""
        return Choice(step, candidates[0], (), f"measuring {' and '.join(candidates)} failed "
                      f"({type(e).__name__}: {first_line}): preference order decides")
    found = pick(step, timings, "measured now" + (
        f" at batch {timed.batch} of {config.batch}" if timed is not config else ""))
    log.info("fusedattn: %s: %s (%.2f s)", config.short(), found.describe(),
             time.perf_counter() - t0)
    if disk_identity is not None:
        plan_cache.store_json(disk_identity, [list(t) for t in timings])
    return found


def stored_identity(identity: dict, config: AttnConfig, candidates: Tuple[str, ...],
                    step: str) -> dict:
    """The persistent cache's key of a choice on the machine `identity` names."""
    return {**identity, "what": "backend-choice", "revision": STORE_REVISION, "step": step,
            "config": repr(config), "candidates": list(candidates)}


def _valid(stored, candidates) -> bool:
    def positive(x):
        return isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0
    return (isinstance(stored, list) and len(stored) == len(candidates)
            and all(isinstance(t, list) and len(t) == 2 and t[0] == name and positive(t[1])
                    for t, name in zip(stored, candidates)))


@functools.lru_cache(maxsize=None)
def machine_identity() -> dict:
    """What a stored choice is valid for: the GPU model and every library version that
    could change a timing."""
    versions = extension.versions()
    return {"gpu": jax.devices()[0].device_kind, "jax": jax.__version__,
            "jaxlib": jax.lib.__version__ if hasattr(jax.lib, "__version__") else None,
            "cudnn": versions.get("cudnn"), "cudnn_frontend": versions.get("cudnn_frontend"),
            "flash_attn3_jax": flash.package_version()}


def clear() -> None:
    """Forget in-memory choices (tests)."""
    with _lock:
        _choices.clear()


# ---- timing on the device -------------------------------------------------------------
def measure_on_device(config: AttnConfig, candidates: Tuple[str, ...], step: str):
    """[(name, seconds per step)] for each candidate: `step` ("inference": forward;
    "training": forward + backward) on random inputs of the config's shapes on the
    default device, timed round-robin.

    Dispatch runs inside the trace of the user's jit, where every JAX call is staged
    into that trace instead of running. JAX's trace state is per thread, so the
    measurement runs on a thread of its own, where calls execute."""
    result: list = []

    def run():
        try:
            result.append(_measure(config, candidates, step))
        except BaseException as e:  # re-raised in the caller's thread
            result.append(e)
    thread = threading.Thread(target=run, name="fusedattn-measure")
    thread.start()
    thread.join()
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


# (kept, set) bits that turn random 16-bit words into numbers of random sign and
# magnitude in [1/8, 2): kept are the sign, the exponent's two low bits and the
# mantissa; set is the exponent of 1/8.
_HALF_BITS = {"bfloat16": (0x81FF, 0x3E00), "float16": (0x8FFF, 0x3000)}
_OFFSET = 997  # elements between the timing inputs' starts in their random buffer


def _random_inputs(shapes, dtype):
    """Random device arrays of `shapes`, made on the host: one random buffer (bf16 /
    fp16 as random bits, above; other dtypes standard normal), each array read from it
    at its own offset (_OFFSET elements apart, not a multiple of any head dim, so no
    row of one array is a row of another). Drawing them on the GPU costs seconds of XLA
    compilation and first run, these a fraction of that (docs/decisions.md); on the
    host most of the cost is first touching new memory, so one buffer serves all arrays."""
    sizes = [math.prod(shape) for shape in shapes]
    n = max(sizes) + _OFFSET * (len(shapes) - 1)
    rng = np.random.default_rng(0)
    bits = _HALF_BITS.get(jnp.dtype(dtype).name)
    if bits is None:
        flat = rng.standard_normal(n, np.float32).astype(dtype)
    else:
        flat = ((rng.integers(0, 1 << 16, n, np.uint16) & bits[0]) | bits[1]).view(dtype)
    return [jax.device_put(flat[i * _OFFSET:i * _OFFSET + size].reshape(shape))
            for i, (shape, size) in enumerate(zip(shapes, sizes))]


def _measure(config: AttnConfig, candidates: Tuple[str, ...], step: str):
    dtype = jnp.dtype(config.dtype)
    shapes = ((config.batch, config.s_q, config.h_q, config.d_qk),
              (config.batch, config.s_kv, config.h_kv, config.d_qk),
              (config.batch, config.s_kv, config.h_kv, config.d_v),
              (config.batch, config.s_q, config.h_q, config.d_v))  # q, k, v, d_out
    arity = 3 if step == "inference" else 4
    sequence = _sequence(config)

    def timed_step(name):
        backend = load_backend(name)

        def attend(q, k, v):
            return backend.attention(config, AttnInputs(q, k, v, sequence=sequence))

        def train(q, k, v, d_out):
            _, vjp = jax.vjp(attend, q, k, v)
            return vjp(d_out)
        return jax.jit(attend if step == "inference" else train)

    # Compiled from shapes, side by side and beside making the inputs: XLA compiles
    # outside the GIL, and compilation is most of a measurement's cost.
    t0 = time.perf_counter()
    abstract = [jax.ShapeDtypeStruct(shape, dtype) for shape in shapes[:arity]]
    tasks = {name: lambda name=name: timed_step(name).lower(*abstract).compile()
             for name in candidates}
    tasks["inputs"] = lambda: jax.block_until_ready(_random_inputs(shapes[:arity], dtype))
    with concurrent.futures.ThreadPoolExecutor(len(tasks)) as pool:
        done = dict(zip(tasks, pool.map(_timed, tasks.values())))
    args = done["inputs"][0]
    compiled = {name: done[name][0] for name in candidates}
    t1 = time.perf_counter()
    # The warm-up (each step's first run included: a step that cannot run raises here)
    # also says how long each call takes, hence how many make a timing.
    last = {}
    while not last or time.perf_counter() - t1 < WARM_SECONDS:
        for name, fn in compiled.items():
            t = time.perf_counter()
            jax.block_until_ready(fn(*args))
            last[name] = time.perf_counter() - t
    reps = {name: min(1024, max(1, math.ceil(MIN_SECONDS / max(t, 1e-6))))
            for name, t in last.items()}
    t2 = time.perf_counter()
    best = {name: float("inf") for name in candidates}
    for _ in range(ROUNDS):
        for name, fn in compiled.items():
            best[name] = min(best[name], _seconds_per_call(fn, args, reps[name]))
    log.info("fusedattn: timing %s (%s): compiled %.2f s (%s), warm-up %.2f s, rounds %.2f s",
             "/".join(candidates), step, t1 - t0,
             ", ".join(f"{name} {sec:.2f}" for name, (_, sec) in done.items()),
             t2 - t1, time.perf_counter() - t2)
    return [(name, best[name]) for name in candidates]


def _sequence(config: AttnConfig) -> Optional[SequenceDescriptor]:
    """A descriptor of the config's kind to time: rows full, a packed row in
    max_segments segments of equal length (shared by q and kv where the config's are)."""
    b, n = config.batch, config.max_segments
    if config.sequence == "padding":
        return SequenceDescriptor.from_lengths(np.full(b, config.s_q, np.int32),
                                               np.full(b, config.s_kv, np.int32))
    if config.sequence != "packed":
        return None

    def segments(s):
        lengths = np.full((b, n), s // n, np.int32)
        lengths[:, -1] += s - lengths.sum(axis=1)
        return lengths, np.cumsum(lengths, axis=1) - lengths
    if config.shared_segments:
        return SequenceDescriptor.from_seqlens_offsets(*segments(config.s_q), q_len=config.s_q)
    return SequenceDescriptor.from_seqlens_offsets(
        *segments(config.s_q), *segments(config.s_kv), q_len=config.s_q, kv_len=config.s_kv)


def _timed(fn):
    """(fn(), seconds it took)."""
    t0 = time.perf_counter()
    return fn(), time.perf_counter() - t0


def _seconds_per_call(fn, args, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / n
