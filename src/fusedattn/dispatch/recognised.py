"""`auto` runs a mask_mod that is exactly a built-in mask as that mask.

``mask_mod=lambda b, h, i, j: (j <= i) & (i - j < 512)`` is ``mask="causal",
window=(511, 0)``: cuDNN and FA3 skip that mask's blocks themselves and their
backward computes fewer products per tile than the block_sparse kernels', so they run
it faster (`docs/decisions.md`). A mask_mod of positions alone is evaluated on every
pair at trace time (`block_sparse.recognise`); when it equals a built-in mask, the
call is planned as that config, the score_mod (if any) kept, and ``explain()`` says
so. A backend asked for by name gets the call as written.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Tuple

import numpy as np

from ..block_sparse import builtin
from ..block_sparse.recognise import builtin_form
from ..block_sparse.terms import ElementMask, MaskMod
from ..config import AttnConfig
from ..inputs import AttnInputs
from ..score_mods import Masked


@functools.lru_cache(maxsize=256)
def as_builtin(config: AttnConfig) -> Optional[Tuple[AttnConfig, str]]:
    """(the config with the mask_mod as its built-in mask, the line explain() prints),
    or None when the mask_mod reads more than positions or is no built-in mask."""
    mod = config.score_mod
    if not isinstance(mod, Masked) or config.has_dense_mask or config.sequence != "dense":
        return None
    zeros = tuple(np.zeros(shape, dtype) for shape, dtype in config.score_mod_arg_specs)
    try:   # (a static map's evaluation: positions only, the unread arguments as zeros)
        term = MaskMod.build(mod.mask_mod, zeros, config.batch, config.h_q, config.s_q,
                             config.s_kv)
        form = builtin_form(ElementMask([term, builtin.intervals(
            config.s_q, config.s_kv, config.mask, config.window)], config.s_q, config.s_kv))
    except Exception:  # noqa: BLE001 - one the host cannot evaluate runs as written
        return None
    if form is None:
        return None
    mask, window = form
    rewritten = dataclasses.replace(
        config, mask=mask, window=window, score_mod=mod.score_mod,
        score_mod_arg_specs=config.score_mod_arg_specs if mod.score_mod is not None else ())
    name = getattr(mod.mask_mod, "__name__", "mask_mod")
    note = (f"mask_mod {name} is mask={mask!r}" + (f", window={window}" if window else "")
            + " on every pair (compared at trace time): runs as that built-in mask")
    return rewritten, note


def inputs_for(config: AttnConfig, inputs: AttnInputs) -> AttnInputs:
    """The call's arrays for a config `as_builtin` made: without score_mod_args when
    only the mask_mod took them."""
    if not config.score_mod_arg_specs and inputs.score_mod_args:
        return inputs._replace(score_mod_args=())
    return inputs
