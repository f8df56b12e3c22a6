"""The cuDNN backend's support probe: building a config key's three graphs (through
the extension's `cudnn_check_support`), with the persistent plan cache on both
sides of it, and the bound of the extension's in-process graph cache.

A probe hands cuDNN the serialized plans `fusedattn.plan_cache` stored for the key
on this GPU model / cuDNN / cudnn-frontend, so a known config's graphs load
without cuDNN's heuristics and kernel compilation; the graphs it had to build from
scratch have their plans stored for the next process.

Plan autotuning (`set_autotune`, `FUSEDATTN_AUTOTUNE`): a graph built from scratch
times every execution plan cuDNN offers for it and runs the fastest
(csrc/cuda/cudnn_autotune.h) instead of the one cuDNN's heuristics rank first. Its
plans are stored apart from the heuristics' ones, so switching it on tunes configs
the cache already knows. Off by default: the heuristics' plan was measured as fast
as the tuned one while tuning makes a first build several times slower
(docs/decisions.md, benchmarks/bench_autotune.py).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from typing import Dict, Optional, Tuple

from ... import plan_cache
from .. import extension

GRAPHS = ("forward_inference", "forward_training", "backward")


@dataclasses.dataclass(frozen=True)
class Probe:
    """What building a config's three graphs (in the order of `GRAPHS`) said."""
    ok: bool
    message: str
    workspace: Tuple[int, int, int] = (0, 0, 0)
    # Seconds each graph took to build (when it was built), and the wall time of the
    # probe that built them: the three build concurrently, so it is about the
    # slowest one, not the sum.
    build_seconds: Tuple[float, float, float] = (0.0, 0.0, 0.0)
    wall_seconds: float = 0.0
    # Whether the graph's execute copies from host memory (ALiBi slopes): such
    # graphs go through the targets XLA does not capture into command buffers.
    host_copies: Tuple[bool, bool, bool] = (False, False, False)
    # Built from a plan the persistent cache held (no heuristics, no compilation).
    from_plan: Tuple[bool, bool, bool] = (False, False, False)
    # Per graph: a stored plan that did not load, or a plan that could not be serialized.
    plan_notes: Tuple[str, str, str] = ("", "", "")
    # Per graph: the execution plan it runs (cudnn-frontend's name), and what timing
    # every plan found when it was autotuned (the extension's `tuning` dict), else None.
    plan_names: Tuple[str, str, str] = ("", "", "")
    tuning: Tuple[Optional[dict], Optional[dict], Optional[dict]] = (None, None, None)

    def describe(self) -> str:
        """One line per graph: its plan and how it was picked, for explain()."""
        if not self.ok or not any(self.plan_names):
            return ""
        lines = []
        for graph, name, loaded, tuned in zip(GRAPHS, self.plan_names, self.from_plan,
                                              self.tuning):
            how = "stored plan" if loaded else "heuristics' first plan"
            if tuned:
                how = (f"autotuned among {tuned['plans']}: {tuned['chosen_ms']:.3f} ms, "
                       f"heuristics' {tuned['heuristic']} {tuned['heuristic_ms']:.3f} ms"
                       if tuned["plans"] > 1 else f"autotune: {tuned['note'] or 'one plan'}")
            lines.append(f"  {graph}: {name or '?'} ({how})")
        return "cuDNN plans:\n" + "\n".join(lines)


_probe_lock = threading.Lock()
_probes: Dict[str, Probe] = {}
_assumed: Optional[Probe] = None  # set by assume_supported()


@contextlib.contextmanager
def assume_supported(workspace_bytes: int = 0):
    """Skip the native probe: every config passing `config_reason` counts as supported,
    with this workspace size. For lowering / `jax.export` on a host without a GPU;
    a call run with too small a workspace fails with an FFI error saying so. Which
    graphs copy from host memory is then decided from the config (ALiBi)."""
    global _assumed
    previous = _assumed
    _assumed = Probe(True, "assumed", (workspace_bytes,) * 3)
    try:
        yield
    finally:
        _assumed = previous


def assumed() -> Optional[Probe]:
    """The probe `assume_supported` stands in with, or None outside it."""
    return _assumed


def probe(key: str, targets: Tuple[str, ...]) -> Probe:
    """Build (or find) the three cuDNN graphs of a config key, concurrently, after
    registering the FFI `targets`; cached per key."""
    if _assumed is not None:
        return _assumed
    found = _probes.get(key)
    if found is not None:
        return found
    with _probe_lock:
        found = _probes.get(key)
        if found is None:
            why = extension.ensure_targets(targets, "cuda")
            if why is not None:  # not cached: the extension may load later
                return Probe(False, why)
            r = _check_support(extension.module("cuda"), key)

            def per_graph(field, default):
                return tuple(type(default)(r.get(field, {}).get(g, default)) for g in GRAPHS)
            found = Probe(bool(r["ok"]), r["message"], per_graph("workspace", 0),
                          per_graph("build_seconds", 0.0), float(r.get("wall_seconds", 0.0)),
                          per_graph("host_copies", False), per_graph("from_plan", False),
                          per_graph("plan_notes", ""), per_graph("plan_names", ""),
                          tuple(dict(r.get("tuning", {})).get(g) for g in GRAPHS))
            _probes[key] = found
    return found


def _check_support(module, key: str) -> dict:
    """The native probe, with the persistent cache's plans in and fresh plans out."""
    _apply_graph_cache_size(module)
    identities = _plan_identities(module, key)
    plans = {}
    for graph, identity in identities.items():
        blob = plan_cache.load(identity)
        if blob is not None:
            plans[graph] = blob
    r = module.cudnn_check_support(key, plans, autotune=autotune_enabled())
    for graph, blob in dict(r.get("plans", {})).items():
        if graph in identities:
            plan_cache.store(identities[graph], bytes(blob))
    return r


# How csrc builds a key's graphs: a stored plan is only valid for the graph it was made
# for, so this changes whenever the same key builds another graph (2: a forward
# program's index nodes generated from its latest value, csrc/cuda/flex.cc).
GRAPH_FORM = 2


def _plan_identities(module, key: str) -> Dict[str, dict]:
    """Per graph, what its stored plan is valid for (empty when the cache is off)."""
    if plan_cache.directory() is None:
        return {}
    device = dict(module.cudnn_device_identity())
    if not device:
        return {}
    versions = dict(module.cudnn_versions())
    base = {"what": "cudnn-plan", "gpu": device["name"], "sm": device["sm"],
            "multiprocessors": device["multiprocessors"],
            "cudnn": versions["cudnn_runtime"], "cudnn_frontend": versions["cudnn_frontend"],
            "key": key, "graph_form": GRAPH_FORM,
            "selection": "autotuned" if autotune_enabled() else "heuristics"}
    return {graph: {**base, "graph": graph} for graph in GRAPHS}


# ---- plan autotuning -----------------------------------------------------------------
ENV_AUTOTUNE = "FUSEDATTN_AUTOTUNE"
AUTOTUNE_DEFAULT = False  # see the module docstring for the measurement behind it
_autotune: Optional[bool] = None  # set_autotune's; None: the environment decides


def set_autotune(enabled: Optional[bool]) -> None:
    """Autotune the cuDNN plans of configs probed from now on (True), run the plan cuDNN's
    heuristics rank first (False), or follow FUSEDATTN_AUTOTUNE / the default (None).
    Graphs already built in this process keep their plans."""
    global _autotune
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool or None, got {enabled!r}")
    _autotune = enabled


def autotune_enabled() -> bool:
    if _autotune is not None:
        return _autotune
    value = os.environ.get(ENV_AUTOTUNE, "")
    if value in ("", None):
        return AUTOTUNE_DEFAULT
    if value not in ("0", "1"):
        raise ValueError(f"{ENV_AUTOTUNE} must be 0 or 1, got {value!r}")
    return value == "1"


# ---- the in-process graph cache's bound ---------------------------------------------
ENV_GRAPH_CACHE_SIZE = "FUSEDATTN_GRAPH_CACHE_SIZE"
_graph_cache_size: Optional[int] = None  # set_graph_cache_size's, until applied
_size_applied = False


def set_graph_cache_size(entries: int) -> None:
    """Keep at most `entries` cuDNN graphs (three per config) in this process; the least
    recently used go first. A graph evicted while a compiled program still calls it is
    rebuilt (or loaded from the persistent cache) on its next call."""
    global _graph_cache_size, _size_applied
    if isinstance(entries, bool) or not isinstance(entries, int) or entries < 1:
        raise ValueError(f"entries must be an int >= 1, got {entries!r}")
    _graph_cache_size, _size_applied = entries, False
    if extension.load("cuda") is not None:
        _apply_graph_cache_size(extension.module("cuda"))


def _apply_graph_cache_size(module) -> None:
    global _size_applied
    if _size_applied:
        return
    size = _graph_cache_size
    if size is None and os.environ.get(ENV_GRAPH_CACHE_SIZE):
        try:
            size = int(os.environ[ENV_GRAPH_CACHE_SIZE])
        except ValueError:
            raise ValueError(f"{ENV_GRAPH_CACHE_SIZE} must be an int >= 1, got "
                             f"{os.environ[ENV_GRAPH_CACHE_SIZE]!r}") from None
        if size < 1:
            raise ValueError(f"{ENV_GRAPH_CACHE_SIZE} must be an int >= 1, got {size}")
    if size is not None:
        module.cudnn_set_cache_capacity(size)
    _size_applied = True


def graph_cache_stats() -> Dict[str, int]:
    """The native graph cache's counters: entries, capacity, builds, from_plans (builds
    from a stored plan), hits, evictions. Empty without the CUDA extension."""
    if extension.load("cuda") is None:
        return {}
    return dict(extension.module("cuda").cudnn_cache_stats())
