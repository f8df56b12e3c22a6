"""The Plan: platform + AttnConfig -> the backend that runs, why not the others, and the
strategy that runs the call (plain, measured rivals, FP8 current scaling, context
parallelism). `Plan.run` executes every call of `fused_attn` and the drop-ins, and
`explain()` prints the same plan.

Backends are listed in `registry` (each exposes the `backends.protocol.Backend`
interface); the preference order per platform is `PREFERENCE` below.

A dense boolean mask (the drop-ins' `mask`) stays a mask for backends that take one
(``takes_dense_mask``: block_sparse) and becomes an additive bias for every other,
here and nowhere else (`config_for` / `inputs_for`): each backend is asked about, and
runs, the config it would receive.

Under `auto`, a mask_mod that equals a built-in mask on every pair is planned as that
mask (`recognised`): the plan's config is then the rewritten one, and explain() says so.
One whose query rows fall into runs that are each a built-in mask of a range of keys
(prefix-LM) runs as one call per run, each with a plan of its own (`groups`); where
block_sparse runs the whole call, calls without a gradient run that instead
(`inference`).

Where backends of a rival group (`measure.RIVALS`: cudnn and flash on CUDA)
can both run a config, `auto` picks by a measurement on this GPU, separately for
calls without a gradient and for training steps, each when a call first needs it
(`MeasuredRivals`); the plan shows the timings.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import threading
from typing import Dict, List, Optional, Tuple

from .. import context_parallel as cp_module
from ..backends import fp8_op, native_op, xla
from ..config import AttnConfig
from ..inputs import mask_as_bias
from ..vendor import current_platform
from . import measure, recognised
from .registry import ALL_BACKENDS, load_backend

log = logging.getLogger("fusedattn")

# Preference order per platform: the first backend that supports a config runs it.
PREFERENCE: Dict[str, Tuple[str, ...]] = {
    # block_sparse serves mask_mods and dense boolean masks: before cudnn, which runs every
    # tile of a mask it does not recognise. A score_mod with no mask it takes only where
    # cudnn refuses it (`_deferred`), so that one never falls to XLA either.
    # block_sparse_xla walks the same maps in XLA: after the vendors' kernels (faster
    # every tile), before XLA over all S^2 pairs.
    "cuda": ("small_seq", "block_sparse", "cudnn", "flash", "block_sparse_xla", "xla"),
    "rocm": ("small_seq", "ck", "xla"),
    "cpu": ("xla",),
}

ENV_BACKEND = "FUSEDATTN_BACKEND"


class UnsupportedError(ValueError):
    """The requested backend cannot serve this config; the message lists every reason."""


def takes_dense_mask(name: str) -> bool:
    return getattr(load_backend(name), "takes_dense_mask", False)


def runs_block_maps(name: Optional[str]) -> bool:
    """Whether backend `name` runs a mask as a block map (block_sparse, and its list
    walks in XLA): its lse is -inf exactly on the rows that see no key, and its
    float score_mod_args get gradients from its backward step."""
    return name is not None and getattr(load_backend(name), "runs_block_maps", False)


def config_for(config: AttnConfig, name: str) -> AttnConfig:
    """The config backend `name` is asked about and runs: a dense mask as it is where the
    backend takes one, else folded into the bias."""
    return config if takes_dense_mask(name) else config.mask_as_bias()


def inputs_for(config: AttnConfig, name: str, inputs):
    """The arrays of `config_for(config, name)`: the mask made a bias where it must be."""
    return inputs if takes_dense_mask(name) else mask_as_bias(config, inputs)


@dataclasses.dataclass(frozen=True)
class MeasuredRivals:
    """Rival backends that all run `config`. Each step (`measure.STEPS`) runs the
    one a measurement on this GPU found fastest, measured the first time a call needs
    that step: `native_op` asks at trace time, so a training job never times
    forward-only calls it does not make. Hashable: it rides in custom_vjp's static
    arguments."""
    config: AttnConfig
    platform: str
    candidates: Tuple[str, ...]

    def choice(self, step: str) -> measure.Choice:
        return measure.choose(self.config, self.platform, self.candidates, step,
                               identity=measure.machine_identity())

    def for_step(self, step: str) -> str:
        return self.choice(step).backend


@dataclasses.dataclass(frozen=True)
class Plan:
    """What dispatch decided: the chosen backend and, for every backend, why (not)."""
    config: AttnConfig
    platform: str
    requested: str
    # The forced backend, or the first usable one (None: no backend can run the config).
    preferred: Optional[str]
    reasons: Tuple[Tuple[str, Optional[str]], ...]  # (backend, None if usable else reason)
    # The distributed plan (context parallelism, or the batch / head split of sharded
    # inputs given to explain()), as lines of text; "" for a single-device call.
    distributed: str = ""
    # Rival backends chosen between per step by measurement (`measure`), or
    # None; `measure_note`: why no measurement decides, where one could have.
    rivals: Optional[MeasuredRivals] = None
    measure_note: str = ""
    context_parallel: Optional[object] = None  # a ContextParallel, run by its strategy
    # How `auto` rewrote the call (a mask_mod run as the built-in mask it equals,
    # `recognised`), or "": `config` is then the rewritten one, unless `groups` is set.
    rewritten: str = ""
    # (query rows, key rows, Plan) per run of rows run as a call of its own
    # (`recognised.as_row_groups`); then `preferred` is None and `reasons` empty.
    groups: Tuple[Tuple[Tuple[int, int], Tuple[int, int], "Plan"], ...] = ()
    # With `groups`: block_sparse's plan of the whole call, run by calls without a
    # gradient (one kernel, no slicing or concatenation), or None. Training steps keep
    # the groups, whose backward is the faster.
    inference: Optional["Plan"] = None

    @property
    def chosen(self) -> Optional[str]:
        """The backend that runs; between measured rivals, the one that trains (asking
        measures the training step if no call has yet)."""
        return self.rivals.for_step("training") if self.rivals else self.preferred

    @property
    def backend(self):
        """The chosen backend object (raises UnsupportedError with every reason)."""
        return load_backend(self.require())

    def require(self) -> str:
        """The backend a plain call runs (the forced or first usable one; between measured
        rivals the preferred one, measuring nothing); UnsupportedError with every reason
        when none can, or when the call runs as several (`groups`)."""
        if self.groups:
            raise UnsupportedError(f"{self.config.short()} runs as a call per run of query "
                                   f"rows ({self._runs()}), not on one backend: Plan.run "
                                   f"runs it, and each of `groups` names its own plan")
        if self.preferred is None:
            raise UnsupportedError(self.error_message())
        return self.preferred

    @property
    def strategy(self) -> str:
        """How `run` executes: "row_groups" (a call per run of rows), "context_parallel",
        "fp8" (current scaling), "measured" (rivals chosen per step) or "plain"."""
        if self.groups:
            return "row_groups"
        if self.context_parallel is not None:
            return "context_parallel"
        if self.config.is_fp8:
            return "fp8"
        return "measured" if self.rivals is not None else "plain"

    def run(self, inputs):
        """Run the call this plan describes on `inputs` (an `AttnInputs`)."""
        if self.groups:
            if self.inference is not None:
                return recognised.run_groups_to_train(self.config, self.groups,
                                                      self.inference, inputs)
            return recognised.run_groups(self.config, self.groups, inputs)
        name = self.require()
        strategy = self.strategy
        inputs = recognised.inputs_for(self.config, inputs)
        config, inputs = config_for(self.config, name), inputs_for(self.config, name, inputs)
        if strategy == "context_parallel":
            return cp_module.attention(config, inputs, self.context_parallel, name)
        if strategy == "fp8":
            return fp8_op.current_scaling_attention(config, inputs, name)
        if strategy == "measured":
            return native_op.attention(self.rivals, config, inputs)[0]
        return load_backend(name).attention(config, inputs)

    def run_with_lse(self, inputs):
        """(out, lse fp32 [b, h_q, s_q], no gradient through lse) of a plain or measured
        plan (the jax.nn drop-in's return_residual)."""
        if self.groups:
            return recognised.run_groups(self.config, self.groups, inputs, with_lse=True)
        name = self.require()
        if self.strategy not in ("plain", "measured"):
            raise UnsupportedError(f"the log-sum-exp is returned by plain calls, not "
                                   f"{self.strategy}")
        inputs = recognised.inputs_for(self.config, inputs)
        config, inputs = config_for(self.config, name), inputs_for(self.config, name, inputs)
        if name == "xla":
            return xla.attention_with_lse(config, inputs)
        own = getattr(load_backend(name), "attention_with_lse", None)
        if own is not None:  # (block_sparse: its support checked first)
            return own(config, inputs)
        return native_op.attention(self.rivals or name, config, inputs, need_lse=True)

    @staticmethod
    def group_label(q_rows: Tuple[int, int], kv_rows: Tuple[int, int]) -> str:
        """How explain() names one of `groups`: its query rows and key rows."""
        return f"queries [{q_rows[0]}, {q_rows[1]}) x keys [{kv_rows[0]}, {kv_rows[1]})"

    def _runs(self) -> List[str]:
        """The backends this plan runs: the chosen one, or each step's between rivals."""
        if self.groups:
            return list(dict.fromkeys(n for *_, p in self.groups for n in p._runs()))
        if self.rivals is not None:
            return list(dict.fromkeys(self.rivals.for_step(s) for s in measure.STEPS))
        return [self.chosen] if self.chosen else []

    def _details(self, name: str) -> str:
        """What a backend says of how it runs this config (e.g. cuDNN's plans), if anything."""
        details = getattr(load_backend(name), "details", None)
        return details(config_for(self.config, name)) if details is not None else ""

    def mask_route(self) -> str:
        """How a dense boolean mask runs (a block map, or a bias and why), or ""."""
        if not self.config.has_dense_mask or self.chosen is None:
            return ""
        if takes_dense_mask(self.chosen):
            return f"dense boolean mask: a block map on {self.chosen} (empty blocks skipped)"
        refusals = "; ".join(f"{name}: {why}" for name, why in self.reasons
                             if why is not None and takes_dense_mask(name))
        return (f"dense boolean mask: an additive bias on {self.chosen} (-0.7 x the dtype's "
                f"largest value where False, every pair computed)"
                + (f"; not a block map because {refusals}" if refusals else ""))

    def error_message(self) -> str:
        return (f"backend {self.requested!r} cannot run this attention "
                f"({self.config.short()}) on platform {self.platform}:\n{self.table()}")

    def table(self) -> str:
        if not self.reasons:   # (a call per run of rows: its groups' plans have tables)
            return ""
        width = max(len(name) for name, _ in self.reasons)
        rows = []
        for name, reason in self.reasons:
            mark = ">>" if name == self.chosen else "  "
            status = "chosen" if name == self.chosen else ("usable" if reason is None else reason)
            rows.append(f"{mark} {name:<{width}}  {status}")
        return "\n".join(rows)

    def __str__(self) -> str:
        head = f"fusedattn plan on {self.platform} for {self.config.short()}"
        lines = [head] + ([self.rewritten] if self.rewritten else [])
        if self.inference is not None:
            lines.append("calls without a gradient run block_sparse over the whole map (one "
                         "kernel, no concatenation); training steps run these calls:")
        if self.groups:
            for q_rows, kv_rows, sub in self.groups:
                lines.append(self.group_label(q_rows, kv_rows) + ":")
                lines += ["    " + line for line in str(sub).splitlines()]
            return "\n".join(lines + ([self.distributed] if self.distributed else []))
        lines.append(self.table())
        if self.rivals is not None:
            lines += ["measured: " + self.rivals.choice(s).describe()
                      for s in measure.STEPS]
        if self.measure_note:
            lines.append(self.measure_note)
        if self.mask_route():
            lines.append(self.mask_route())
        lines += filter(None, (self._details(name) for name in self._runs()))
        if self.distributed:
            lines.append(self.distributed)
        return "\n".join(lines)


def _reason(name: str, config: AttnConfig, platform: str, cp=None) -> Optional[str]:
    backend = load_backend(name)
    if platform not in backend.platforms:
        return f"runs on {'/'.join(backend.platforms)}, not {platform}"
    if config.is_fp8 and not getattr(backend, "fp8", False):
        return getattr(backend, "fp8_reason", "has no FP8 kernels") + (
            " (precision='fp8' runs on cudnn, or emulated by xla)")
    if config.unseen_rows == "mean" and not getattr(backend, "averages_unseen_rows", False):
        return "gives rows that see no key 0; jax.nn's mean of the values is block_sparse's"
    if cp is not None and takes_dense_mask(name) and config.has_dense_mask:
        return "context parallel: a dense mask is not split along the sequence"
    config = config_for(config, name)
    try:
        why = backend.supports(config)
        if why is None and cp is not None:
            why = cp_module.plan_reason(config, cp, backend)
            why = None if why is None else f"context parallel: {why}"
        return why
    except Exception as e:  # a probe that crashed is a reason, never a crash
        return f"support check failed: {type(e).__name__}: {e}"


def _deferred(config: AttnConfig, reasons):
    """`reasons` with a usable backend that defers this config to another usable one
    (`defers_to`: block_sparse takes score_mods cuDNN refuses) marked as deferring."""
    usable = {name for name, why in reasons if why is None}
    out = []
    for name, why in reasons:
        other = getattr(load_backend(name), "defers_to", lambda c: None)(config) \
            if why is None else None
        if other in usable:
            why = f"{other} runs this call (faster); {name} takes it where {other} cannot"
        out.append((name, why))
    return tuple(out)


# Plans are cached per (config, platform, request): a re-trace of a known config
# costs a dict lookup, and the decision is logged once.
_plans: Dict[tuple, Plan] = {}
_unlogged: set = set()   # (keys planned quietly: logged when next asked for)
_plans_lock = threading.Lock()


def plan(config: AttnConfig, backend: str = "auto", platform: Optional[str] = None,
         context_parallel=None, quiet: bool = False) -> Plan:
    """Ask every backend about `config`; pick the first usable one (or the forced one).
    With `context_parallel` (a `ContextParallel`), a backend must also run every block
    of that split. `quiet` (a trial the caller may drop) logs nothing until the same
    plan is asked for again."""
    platform = platform or current_platform()
    requested = backend
    if requested == "auto":
        requested = os.environ.get(ENV_BACKEND, "auto") or "auto"
    if requested != "auto" and requested not in ALL_BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {ALL_BACKENDS}, got {requested!r}")
    key = (config, platform, requested, context_parallel)
    with _plans_lock:
        cached = _plans.get(key)
        if cached is not None and not quiet and key in _unlogged:
            _unlogged.discard(key)
            _log(cached)
    if cached is not None:
        return cached
    rewritten = ""
    split = (recognised.as_row_groups(config)
             if requested == "auto" and context_parallel is None else None)
    if split is not None:
        calls, rewritten = split
        groups = tuple((q_rows, kv_rows, plan(sub, "auto", platform, quiet=quiet))
                       for q_rows, kv_rows, sub in calls)
        # (asked as any backend is: the Hopper check and every other reason apply)
        inference = (plan(config, "block_sparse", platform, quiet=quiet)
                     if _reason("block_sparse", config, platform) is None else None)
        return _cached(key, Plan(config, platform, requested, None, (),
                                 rewritten=rewritten, groups=groups, inference=inference),
                       quiet)
    if requested == "auto":
        found = recognised.as_builtin(config)
        if found is not None:
            config, rewritten = found
    preferred = PREFERENCE.get(platform, ("xla",))
    order: List[str] = list(preferred) + [n for n in ALL_BACKENDS if n not in preferred]
    reasons = tuple((name, _reason(name, config, platform, context_parallel)) for name in order)
    rivals, measure_note = None, ""
    if requested == "auto":
        reasons = _deferred(config, reasons)
        chosen = next((n for n, r in reasons if r is None), None)
        candidates = measure.rivals(platform, [n for n, r in reasons if r is None])
        if candidates and context_parallel is None:
            if measure.enabled():
                # (rivals take no dense mask: they measure and run the bias form)
                rivals = MeasuredRivals(config_for(config, candidates[0]), platform, candidates)
            else:
                measure_note = (f"{' and '.join(candidates)} both run this config; not "
                                f"measured ({measure.ENV_MEASURE}=0): preference "
                                f"order decides")
    else:
        chosen = requested if dict(reasons)[requested] is None else None
    distributed = ""
    if context_parallel is not None:
        distributed = cp_module.describe(config, context_parallel)
    return _cached(key, Plan(config, platform, requested, chosen, reasons, distributed,
                             rivals, measure_note, context_parallel, rewritten), quiet)


def _unmeasured(result: Plan) -> str:
    """The plan's backend, or its rivals (naming them measures nothing)."""
    if result.rivals is not None:
        return f"measured per step among {result.rivals.candidates}"
    return result.preferred or "no backend"


def _cached(key, result: Plan, quiet: bool = False) -> Plan:
    """`result`, kept for `key`; the decision logged the first time (unless `quiet`)."""
    with _plans_lock:
        if key not in _plans:
            if quiet:
                _unlogged.add(key)
            else:
                _log(result)
        _plans[key] = result
    return result


def _log(result: Plan) -> None:
    runs = (f"a call per run of rows ({[_unmeasured(p) for *_, p in result.groups]})"
            if result.groups else _unmeasured(result))
    if result.inference is not None:
        runs += "; without a gradient block_sparse"
    log.info("fusedattn: %s on %s -> %s", result.config.short(), result.platform, runs)


def clear_cache() -> None:
    """Forget cached plans (tests that change the environment use this)."""
    with _plans_lock:
        _plans.clear()
        _unlogged.clear()
