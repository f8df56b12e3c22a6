"""`auto` runs a mask_mod that is a built-in mask, or two of them, as that.

``mask_mod=lambda b, h, i, j: (j <= i) & (i - j < 512)`` is ``mask="causal",
window=(511, 0)``: cuDNN and FA3 skip that mask's blocks themselves and their
backward computes fewer products per tile than the block_sparse kernels', so they run
it faster (`docs/decisions.md`). A mask_mod of positions alone is evaluated on every
pair at trace time (`block_sparse.recognise`):

* when it equals a built-in mask, the call is planned as that config (`as_builtin`),
  the score_mod (if any) kept;
* when its query rows fall into one or two runs, each a built-in mask against a range
  of keys (prefix-LM: rows ``[0, P)`` see keys ``[0, P)``, the rest bottom-right
  causal), each run is planned as a call of its own and the outputs are put back
  together row by row (`as_row_groups`, `run_groups`): no merge, since every row is
  computed by exactly one call, and autodiff adds the key gradients. Where block_sparse
  runs the whole call, calls without a gradient run that (`run_groups_to_train`).

``explain()`` says so. A backend asked for by name gets the call as written.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from ..block_sparse import builtin
from ..block_sparse.recognise import Group, form_text, row_groups, whole_form
from ..block_sparse.terms import ElementMask, MaskMod
from ..config import AttnConfig
from ..inputs import AttnInputs
from ..score_mods import Masked


@functools.lru_cache(maxsize=256)
def _groups(config: AttnConfig) -> Optional[Tuple[Group, ...]]:
    """`row_groups` of the config's static mask_mod ANDed with its mask / window."""
    mod = config.score_mod
    if not isinstance(mod, Masked) or config.has_dense_mask or config.sequence != "dense":
        return None
    zeros = tuple(np.zeros(shape, dtype) for shape, dtype in config.score_mod_arg_specs)
    try:   # (a static map's evaluation: positions only, the unread arguments as zeros)
        term = MaskMod.build(mod.mask_mod, zeros, config.batch, config.h_q, config.s_q,
                             config.s_kv)
        return row_groups(ElementMask([term, builtin.intervals(
            config.s_q, config.s_kv, config.mask, config.window)], config.s_q, config.s_kv))
    except Exception:  # noqa: BLE001 - one the host cannot evaluate runs as written
        return None


def _name(config: AttnConfig) -> str:
    return getattr(config.score_mod.mask_mod, "__name__", "mask_mod")


def as_builtin(config: AttnConfig) -> Optional[Tuple[AttnConfig, str]]:
    """(the config with the mask_mod as its built-in mask, the line explain() prints),
    or None when the mask_mod reads more than positions or is no built-in mask."""
    form = whole_form(_groups(config), config.s_kv)
    if form is None:
        return None
    (mask, window), mod = form, config.score_mod
    rewritten = dataclasses.replace(
        config, mask=mask, window=window, score_mod=mod.score_mod,
        score_mod_arg_specs=config.score_mod_arg_specs if mod.score_mod is not None else ())
    note = (f"mask_mod {_name(config)} is {form_text(form)} on every pair "
            f"(compared at trace time): runs as that built-in mask")
    return rewritten, note


def _split_reason(config: AttnConfig) -> Optional[str]:
    """Why the call cannot run as separate calls over its rows (None if it can)."""
    rules = ((config.score_mod.score_mod is None, "a score_mod reads the call's positions"),
             (config.layout in ("bshd", "sbhd") and config.qkv_packing == "separate",
              "packed q, k, v"),
             (not config.has_bias, "a bias"), (not config.has_dropout, "dropout"),
             (not config.is_fp8, "FP8 scales the whole call"))
    return next((why for ok, why in rules if not ok), None)


def as_row_groups(config: AttnConfig):
    """((query rows, key rows, config of that call) per run of rows, the line explain()
    prints), or None when the mask_mod is not such runs of built-in masks (or is a
    single one: `as_builtin`) or the call cannot be split by rows."""
    groups = _groups(config)
    if groups is None or as_builtin(config) is not None or _split_reason(config):
        return None
    calls = tuple((rows, keys, dataclasses.replace(
        config, s_q=rows[1] - rows[0], s_kv=keys[1] - keys[0], mask=form[0],
        window=form[1], score_mod=None, score_mod_arg_specs=()))
        for rows, keys, form in groups)
    parts = "; ".join(f"queries [{r[0]}, {r[1]}) against keys [{k[0]}, {k[1]}) with "
                      f"{form_text(f)}" for r, k, f in groups)
    note = (f"mask_mod {_name(config)} is {parts} (compared at trace time): each runs as "
            f"a call of its own, the rows put back together")
    return calls, note


def run_groups(config: AttnConfig, groups, inputs: AttnInputs, with_lse: bool = False):
    """The call as one call per group (``(q_rows, kv_rows, plan)``), its rows put back
    in order: the output (and with `with_lse` the fp32 lse ``[b, h_q, s_q]``)."""
    axis = config.layout.index("s")
    rows = functools.partial(jax.lax.slice_in_dim, axis=axis)
    results = []
    for q_rows, kv_rows, plan in groups:
        part = AttnInputs(q=rows(inputs.q, *q_rows), k=rows(inputs.k, *kv_rows),
                          v=rows(inputs.v, *kv_rows), softmax_offset=inputs.softmax_offset)
        results.append(plan.run_with_lse(part) if with_lse else plan.run(part))
    if not with_lse:
        return jnp.concatenate(results, axis=axis)
    return (jnp.concatenate([o for o, _ in results], axis=axis),
            jnp.concatenate([lse for _, lse in results], axis=2))


def run_groups_to_train(config: AttnConfig, groups, whole, inputs: AttnInputs):
    """The call as `whole` (one plan of the whole call) where no derivative is taken,
    and as `run_groups` where one is: a custom_vjp whose primal runs `whole` and whose
    forward rule runs the groups, keeping their vjp for the backward."""
    # Only q, k, v (and the sink offsets) are the custom_vjp's arguments; the rest is
    # closed over. A closed-over tracer being differentiated cannot enter a custom_vjp,
    # so the score_mod_args (a static mask_mod's: the groups never read them) enter
    # without a gradient, which is 0 in the groups too.
    names = ("q", "k", "v") + (("softmax_offset",) if inputs.softmax_offset is not None else ())
    rest = inputs._replace(score_mod_args=tuple(
        jax.lax.stop_gradient(a) for a in inputs.score_mod_args))

    def with_arrays(arrays):
        return rest._replace(**dict(zip(names, arrays)))

    @jax.custom_vjp
    def attend(*arrays):
        return whole.run(with_arrays(arrays))

    def forward(*arrays):
        return jax.vjp(lambda *a: run_groups(config, groups, with_arrays(a)), *arrays)

    def backward(vjp, d_out):
        return vjp(d_out)

    attend.defvjp(forward, backward)
    return attend(*(getattr(inputs, name) for name in names))


def inputs_for(config: AttnConfig, inputs: AttnInputs) -> AttnInputs:
    """The call's arrays for a config `as_builtin` made: without score_mod_args when
    only the mask_mod took them."""
    if not config.score_mod_arg_specs and inputs.score_mod_args:
        return inputs._replace(score_mod_args=())
    return inputs
