"""The block_sparse backend: a mask runs only the blocks its block map lists, on our
Mosaic GPU kernels (`fusedattn.block_sparse`) on Hopper.

cuDNN's graph has no block list: a mask it does not recognise runs every tile there
(a dense mask as a bias over all S^2 pairs), or falls back to XLA. Masks taken here:

* a mask_mod of positions: its static map is built once per config at trace time, and
  `details` gives explain() its density;
* a mask_mod that reads arrays (score_mod_args), the batch or the head index, and the
  drop-ins' dense boolean mask (`config.dense_mask_shape`): the map is built on the
  device in every call from the call's arrays (`device_map`), and the kernels evaluate
  the mask in partial blocks (array reads hoisted per row / column, `hoisting`; the
  dense mask read tile by tile);
* a score_mod that reads arrays by position (``scale[doc[b, q]]``): cuDNN's graph has
  no gather, so with or without a mask it runs here (`block_sparse.kernel_score`);
* any other score_mod, where cuDNN refuses it (`defers_to`).

What the kernels cannot evaluate (an operation Mosaic GPU cannot compile,
`block_sparse.mosaic_ops`) is refused by name, before any kernel compiles.

The built-in causal mask and window are ANDed in, and so are padding lengths and packed
segments (per-row key intervals; such a call's map is built on the device): padded
query rows see no key, so they give 0. Under packing the mask_mod and score_mod see
positions inside the segments (read per row and column, `terms.InSegments`; a score_mod
of q_idx - kv_idx alone over shared segments reads by diagonals, `in_segments`). The
config's score_mod (if any) runs inside the kernel, its array reads hoisted per row,
column or (batch, head). q, k, v may be bshd or sbhd (read in place) or packed (sliced
apart). Anything else is a reason, and dispatch moves on; `supports` decides from the
config alone (shapes and dtypes of the arrays), cached per config.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from .. import block_sparse, partitioning
from ..block_sparse import builtin, kernel_bwd_fused, recognise
from ..block_sparse.attention import (block_sparse_attention_backward,
                                      block_sparse_attention_with_lse, on_hopper)
from ..block_sparse.builders import from_element
from ..block_sparse.dependence import Reads, mask_mod_reads
from ..block_sparse import kernel_score, mosaic_ops
from ..block_sparse.hoisting import MASK, Unsupported, by_difference, reason
from ..block_sparse.kernel_parts import BLOCK
from ..block_sparse.terms import Dense, ElementMask, InSegments, MaskMod
from ..config import AttnConfig
from ..inputs import AttnInputs, pack_like_inputs, unpack_qkv
from ..score_mods import Masked, Reindexed, Starts, reindexed_config
from . import native_op
from .xla.tiles import one_tile

DTYPES = ("bfloat16", "float16")
HEAD_DIMS = (64, 128)
# The kernels' implementation (`block_sparse.attention.IMPLEMENTATIONS`). Tests set
# "reference" to run the whole path (dispatch, map on the device, list walks) on CPU.
IMPLEMENTATION = "mosaic"


def parts(config: AttnConfig):
    """(mask_mod, score_mod) of the config's score_mod, None where it has none."""
    mod = config.score_mod
    return (mod.mask_mod, mod.score_mod) if isinstance(mod, Masked) else (None, mod)


def in_segments(config: AttnConfig, fn, args, score: bool, inputs=None):
    """(`fn`, its args) as the kernels run them: under packed sequences `fn` sees the
    segments' positions, appended to its args (`InSegments`). `args` are the call's
    arrays (`inputs` its AttnInputs), or their specs when `inputs` is None.

    A score_mod of ``q_idx - kv_idx`` alone (a T5 table, ALiBi) under segments shared
    by queries and keys runs as it is: a visible pair lies in one segment, so its
    positions there differ by what the raw ones do, and its reads stay per diagonal."""
    if fn is None or not config.is_packed or (score and _score_by_difference(config)):
        return fn, tuple(args)
    positions = ([jax.ShapeDtypeStruct((config.batch, n), jnp.int32)
                  for n in (config.s_q, config.s_kv)] if inputs is None else
                 [inputs.sequence.q_positions, inputs.sequence.kv_positions])
    return InSegments(fn, score=score), (*args, *positions)


def config_reason(config: AttnConfig, kernels: bool = True) -> Optional[str]:
    """What the kernels (with `kernels` False: the list walks in XLA,
    `block_sparse_xla`) cannot run, from the config alone (None: they can)."""
    mask_mod, _ = parts(config)
    # (the walks take a built-in window too, where cudnn and flash cannot run it (float32)
    # and XLA would tile the scores: measured faster there, docs/decisions.md; causal
    # masks and packed segments measured alike or not at all, so they stay with xla)
    built_in = not kernels and config.window is not None and not one_tile(config)
    rules = (
        # (a score_mod with no in-kernel form: `args_reason` below says why)
        # (under packing every score_mod runs here: cuDNN refuses them with segments)
        # (the kernels take any other score_mod too; dispatch asks cudnn first,
        # `defers_to`)
        (mask_mod is None and not config.has_dense_mask and not _score_by_position(config)
         and not (config.is_packed and config.score_mod is not None)
         and not (kernels and config.score_mod is not None)
         and not built_in and args_reason(config) is None,
         "runs a mask_mod's or a dense boolean mask's block map, or a score_mod reading "
         "arrays by position; this call has none (cudnn and flash skip the built-in "
         "masks' blocks)" if kernels else
         "runs a block map of a mask_mod, a dense boolean mask, a score_mod reading arrays "
         "by position, or a window whose scores XLA would tile; this call has none"),
        (config.is_fp8, "no FP8 kernels"),
        (kernels and config.dtype not in DTYPES,
         f"dtype {config.dtype}: kernels are {'/'.join(DTYPES)}"),
        (config.d_qk != config.d_v or (kernels and config.d_qk not in HEAD_DIMS),
         f"head dims {config.d_qk}/{config.d_v}: "
         + (f"kernels take d_qk == d_v in {HEAD_DIMS}" if kernels else "takes d_qk == d_v")),
        (config.sequence not in ("dense", "padding", "packed"),
         f"sequence {config.sequence!r}: takes dense, padded or packed sequences"),
        (config.has_bias or config.has_dropout or config.softmax != "vanilla",
         "takes no bias, dropout or sink softmax"),
        (config.unseen_rows == "mean" and config.sequence != "dense",
         "writes the mean of the values to rows that see no key only without padding "
         "or packing (padded query rows give 0)"),
        # (past a block boundary the outputs are sliced from padded arrays, and XLA fuses
        # the drop-in's own average into those slices: measured faster, docs/decisions.md)
        (config.unseen_rows == "mean" and (config.s_q % BLOCK or config.s_kv % BLOCK),
         f"writes the mean of the values to rows that see no key only at lengths that are "
         f"whole {BLOCK}-blocks"),
    )
    why = next((why for broken, why in rules if broken), None)
    if why is None:   # (arrays closed over count as arrays read)
        why = args_reason(config)
    if why is None and kernels:
        why = lowering_reason(config)
    if why is None and kernels and plain_score_mod(config) and not _reindexed(config):
        # (a batch / head split runs the shard's form, `native_op`; where that has none
        # here, the call stays with XLA, which runs it whole)
        shard = reindexed_config(config, Starts())
        shard_why = args_reason(shard) or lowering_reason(shard)
        why = shard_why and f"on a shard of a batch / head split: {shard_why}"
    return why


def plain_score_mod(config: AttnConfig) -> bool:
    """A score_mod with no mask_mod, dense mask, packing or read by position: cuDNN runs
    it where it can (`defers_to`)."""
    mask_mod, score_mod = parts(config)
    return (score_mod is not None and mask_mod is None and not config.has_dense_mask
            and not config.is_packed and not _score_by_position(config))


def _arg_specs(config: AttnConfig):
    return [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in config.score_mod_arg_specs]


@functools.lru_cache(maxsize=256)
def mask_reads(config: AttnConfig) -> Reads:
    """What the mask_mod reads besides positions (traced from the config's shapes)."""
    mask_mod, _ = parts(config)
    if mask_mod is None:
        return Reads(batch=False, head=False, args=False)
    return mask_mod_reads(mask_mod, _arg_specs(config), config.batch, config.h_q,
                          config.s_q, config.s_kv)


@functools.lru_cache(maxsize=256)
def _score_by_difference(config: AttnConfig) -> bool:
    """Whether the score_mod, under segments shared by queries and keys, reads positions
    only through q_idx - kv_idx (`hoisting.by_difference`)."""
    score_mod = parts(config)[1]
    if score_mod is None or not config.shared_segments:
        return False
    try:
        return by_difference(score_mod, _arg_specs(config), config.batch, config.h_q,
                             config.s_q, config.s_kv)
    except Exception:  # cannot be traced here: read by segment positions (`args_reason`)
        return False


@functools.lru_cache(maxsize=256)
def _score_by_position(config: AttnConfig) -> bool:
    """Whether the score_mod reads arrays by a position (what cuDNN cannot run)."""
    score_mod, specs = in_segments(config, parts(config)[1], _arg_specs(config), score=True)
    try:
        split = kernel_score.split(score_mod, specs, config.batch, config.h_q,
                                   config.s_q, config.s_kv)
    except Exception:  # no in-kernel form: `args_reason` says why
        return False
    return split is not None and split.by_position


@functools.lru_cache(maxsize=256)
def args_reason(config: AttnConfig) -> Optional[str]:
    """Why a call with score_mod_args cannot run here (None: it can): each part reading
    them must have an in-kernel form (`hoisting`)."""
    mask_mod, score_mod = parts(config)
    specs = _arg_specs(config)
    try:
        try:  # (the split the kernels run, cached: no second hoisting of the score_mod)
            kernel_score.split(*in_segments(config, score_mod, specs, score=True),
                               config.batch, config.h_q, config.s_q, config.s_kv)
        except Unsupported as e:
            return str(e) + (" (under packed sequences the positions inside the segments "
                             "are read per row and column, so reads by q_idx - kv_idx "
                             "are hoisted only where the query and key segments are the "
                             "same and the score_mod reads no position otherwise)"
                             if config.is_packed else "")
        if mask_mod is None or not mask_reads(config).args:
            return None
        reads = mask_reads(config)
        # (packed: as the map's MaskMod term hoists it, `kernel_mask`)
        return reason(*in_segments(config, mask_mod, specs, score=False),
                      config.batch if reads.batch or config.is_packed else 1,
                      config.h_q if reads.head else 1, config.s_q, config.s_kv, MASK)
    except Exception as e:  # a function that cannot be traced here: a reason, not a crash
        return f"score_mod_args: {type(e).__name__}: {e}"


@functools.lru_cache(maxsize=256)
def lowering_reason(config: AttnConfig) -> Optional[str]:
    """Why the kernels cannot evaluate the parts of the call's mask_mod or score_mod
    that run in them as written (those reading no array; a score_mod with its
    derivative): an operation Mosaic GPU cannot compile (`mosaic_ops`). Parts that read
    arrays are split by `hoisting`, which checks the same (`args_reason`)."""
    mask_mod, score_mod = parts(config)
    specs = _arg_specs(config)
    index = [jax.ShapeDtypeStruct((), jnp.int32)] * 4
    found = []
    # (packed: the mask_mod is key intervals or reads its positions, split by `hoisting`)
    if mask_mod is not None and not config.is_packed and not mask_reads(config).args:
        found += [("mask_mod", n) for n in mosaic_ops.missing(mask_mod, *index, *specs)]
    if score_mod is not None and _reads_no_array(config):
        found += [("score_mod", n) for n in mosaic_ops.missing(
            score_mod, jax.ShapeDtypeStruct((), jnp.float32), *index, *specs,
            derivative_of=0)]
    if not found:
        return None
    return (f"the kernels cannot evaluate {', '.join(f'the {w} ' + repr(n) for w, n in found)}:"
            f" Mosaic GPU cannot compile it in jax {jax.__version__}")


def _reads_no_array(config: AttnConfig) -> bool:
    """Whether the kernels run the call's score_mod as written (it reads no array)."""
    try:
        return kernel_score.split(*in_segments(config, parts(config)[1], _arg_specs(config),
                                               score=True),
                                  config.batch, config.h_q, config.s_q, config.s_kv) is None
    except Exception:  # noqa: BLE001 (no in-kernel form: `args_reason` said why)
        return False


def static(config: AttnConfig) -> bool:
    """Whether the call's map is static: a mask_mod of positions alone, no dense mask,
    no padding lengths or packed segments."""
    return (not config.has_dense_mask and config.sequence == "dense"
            and mask_reads(config).positions_only)


@functools.lru_cache(maxsize=256)
def block_map(config: AttnConfig) -> block_sparse.BlockMap:
    """The config's static map (a mask_mod of positions; built once per config). Arrays
    it takes but never reads are zeros here, as for any static map."""
    mask_mod, _ = parts(config)
    unread = tuple(np.zeros(shape, dtype) for shape, dtype in config.score_mod_arg_specs)
    return block_sparse.block_map(mask_mod, 1, 1, config.s_q, config.s_kv, args=unread,
                                  mask=config.mask, window=config.window,
                                  block=(BLOCK, BLOCK))


@functools.lru_cache(maxsize=256)
def segment_runs(config: AttnConfig):
    """Under packing, a mask_mod of positions alone whose row at each position sees one
    run of keys or none (prefix-LM, a window): each position's first and last key
    (host arrays, `recognise.row_runs`), found at trace time; else None. Such a mask
    inside the segments is per-row key intervals, whose map needs no pair evaluated."""
    mask_mod, _ = parts(config)
    if mask_mod is None or not config.is_packed or not mask_reads(config).positions_only:
        return None
    # (`row_runs` evaluates it with zeros for the args it never reads)
    term = MaskMod(mask_mod, _arg_specs(config), reads=mask_reads(config), batch=1, heads=1)
    return recognise.row_runs(ElementMask([term], config.s_q, config.s_kv))


def device_map(config: AttnConfig, inputs: AttnInputs) -> block_sparse.BlockMap:
    """The call's map from its arrays (the mask_mod's args, the dense mask, the padding
    lengths), built on the device in this call: the AND of those terms and the built-in
    mask and window."""
    mask_mod, _ = parts(config)
    terms = []
    runs = segment_runs(config)
    if runs is not None:
        terms.append(builtin.in_segments(*runs, inputs.sequence))
    elif mask_mod is not None:   # (packed: it sees positions inside the segments)
        pos = ((inputs.sequence.q_positions, inputs.sequence.kv_positions)
               if config.is_packed else ())
        terms.append(MaskMod.build(mask_mod, tuple(inputs.score_mod_args), config.batch,
                                   config.h_q, config.s_q, config.s_kv, *pos))
    if inputs.dense_mask is not None:
        terms.append(Dense(inputs.dense_mask))
    terms.append(builtin.intervals(config.s_q, config.s_kv, config.mask, config.window,
                                   None if config.sequence == "dense" else inputs.sequence))
    return from_element(ElementMask(terms, config.s_q, config.s_kv), (BLOCK, BLOCK))


class BlockSparseBackend(native_op.NativeBackend):
    """Its kernels run through `native_op` like the FFI backends': under a batch / head
    split each device runs its shard, building its shard's map; a mask_mod and a
    score_mod see the call's batch and head numbers there (`native_op`'s score_mod
    reindexing: the shard's first row and head are two more args, so the values the
    kernels read are hoisted from the call's numbers). Its backward step also returns
    the float score_mod_args' gradients (`block_sparse_attention_backward`)."""
    name = "block_sparse"
    platforms = ("cuda",)
    takes_dense_mask = True  # dispatch passes the drop-ins' mask as it is (no bias)
    runs_block_maps = True
    averages_unseen_rows = True  # config.unseen_rows="mean": the forward kernel writes it

    def implementation(self) -> str:
        """What runs the lists (`block_sparse.attention.IMPLEMENTATIONS`)."""
        return IMPLEMENTATION

    def config_reason(self, config: AttnConfig) -> Optional[str]:
        why = config_reason(config)
        if why is None and not on_hopper():
            why = "its Mosaic GPU kernels need a Hopper GPU (compute capability 9.0)"
        return why

    def defers_to(self, config: AttnConfig) -> Optional[str]:
        """The backend `auto` runs `config` on instead, where that one can: a score_mod
        with no mask, no dense mask and no read by position runs on cudnn, whose kernels
        are faster on every tile; here it runs where cuDNN refuses it (its lowering has
        no form for an operation, or its engines none for the graph), ahead of XLA."""
        return "cudnn" if plain_score_mod(config) else None

    def supports(self, config: AttnConfig) -> Optional[str]:
        why = self.config_reason(config)
        if why is None:
            try:   # (both evaluate the mask_mod on the host at trace time)
                if static(config):
                    block_map(config)
                segment_runs(config)
            except Exception as e:  # a mask_mod the map cannot take: a reason, not a crash
                return f"block map: {type(e).__name__}: {e}"
        return why

    def details(self, config: AttnConfig) -> str:
        impl = self.implementation() if on_hopper() else "reference"
        return self._map_details(config) + "; " + backward_note(config, impl)

    def _map_details(self, config: AttnConfig) -> str:
        if static(config):
            return block_map(config).describe()
        sources = []
        if segment_runs(config) is not None:
            sources.append("the mask_mod's runs of keys per position (found at trace "
                           "time) placed in each segment")
        elif parts(config)[0] is not None:
            reads = mask_reads(config)
            read = [name for name, yes in (("score_mod_args", reads.args),
                                           ("the batch index", reads.batch),
                                           ("the head index", reads.head)) if yes]
            sources.append("the mask_mod" + (f" (it reads {' and '.join(read)})" if read else ""))
        if config.has_dense_mask:
            sources.append("the dense boolean mask")
        if config.is_padded:
            sources.append("the padding lengths")
        if config.is_packed:
            sources.append("the packed segments")
        return (f"block map of {BLOCK}x{BLOCK} blocks built on the device in every call from "
                f"{' and '.join(sources)}"
                + (f", with the {config.mask} mask" if config.causal else "")
                + (f", window {config.window}" if config.window else "")
                + ": its density is known only when it runs")

    def _run(self, config: AttnConfig, inputs: AttnInputs, attend, out_specs, *operands):
        """`attend` (a `block_sparse` function) on one device's arrays, `config` theirs;
        `out_specs()`: its results' sharding types where some mesh axes are Explicit."""
        self.require(config, SHARD_NOTE if _reindexed(config) else "")

        def run(inputs, *operands):
            bm = block_map(config) if static(config) else device_map(config, inputs)
            q, k, v = unpack_qkv(config, inputs)
            score_mod, args = in_segments(config, parts(config)[1], inputs.score_mod_args,
                                          score=True, inputs=inputs)
            # (already one device's shard: native_op partitions the call)
            return attend(q, k, v, *operands, bm, scale=config.scale, score_mod=score_mod,
                          score_mod_args=args, implementation=self.implementation(),
                          unseen_rows=config.unseen_rows, layout=config.layout,
                          partitioned=False)
        # (under Explicit axes the map's and the list walks' gathers run with the axes
        # Auto, as the XLA backend's tiles do)
        return partitioning.in_auto_axes(run, inputs.q, out_specs, inputs, *operands)

    # native_op's per-device kernels. They read bshd and sbhd arrays in place; packed
    # q, k, v are sliced apart (copies) and their gradients stacked back.
    def forward(self, config: AttnConfig, inputs: AttnInputs, training: bool):
        dims = (partitioning.output_dims(config), partitioning.LSE_DIMS)
        out, lse = self._run(config, inputs, block_sparse_attention_with_lse,
                             lambda: partitioning.typed_specs(config, inputs.q, dims))
        return out, (lse if training else None)

    def backward(self, config: AttnConfig, inputs: AttnInputs, out, lse, d_out) -> AttnInputs:
        """Gradients of q, k, v and of the float score_mod_args (None for the others)."""
        floats = tuple(x if jnp.issubdtype(jnp.result_type(x), jnp.floating) else None
                       for x in inputs.score_mod_args)
        primal = (inputs.q, inputs.k, inputs.v, floats)  # each gradient typed as its array

        def attend(*args, **kw):
            dq, dk, dv, d_args = block_sparse_attention_backward(
                *args, deterministic=config.deterministic, **kw)
            # (without the segments' positions `in_segments` appended)
            return (*pack_like_inputs(config, dq, dk, dv), d_args[:len(floats)])
        dq, dk, dv, d_args = self._run(
            config, inputs, attend,
            lambda: jax.tree_util.tree_map(lambda x: jax.typeof(x).sharding.spec, primal),
            out, lse, d_out)
        return AttnInputs(dq, dk, dv, score_mod_args=d_args)

    def attention_with_lse(self, config: AttnConfig, inputs: AttnInputs):
        """(out, fp32 natural log-sum-exp [b, h_q, s_q], -inf on rows with no visible key;
        no gradient flows through it)."""
        self.require(config)
        return native_op.attention(self.name, config, inputs, need_lse=True)


def backward_note(config: AttnConfig, implementation: str) -> str:
    """Which kernels the backward runs: `kernel_bwd_fused` where the map's mask is one
    documents mask or one dense mask and the call allows it, else the dq and dk / dv
    kernels (or the reference walks: `implementation`). It restates the route's
    conditions (`attention._fused_mask`) in the config's terms, before any array."""
    mask_mod, score_mod = parts(config)
    why = [text for text, bad in (
        ("a score_mod", score_mod is not None),
        ("deterministic=True (it adds dq with atomics)", config.deterministic),
        ("causal, a window, padding lengths or packed segments beside the mask",
         config.is_padded or config.is_packed or builtin.narrows(
             config.s_q, config.s_kv, config.mask, config.window)),
        ("a mask_mod and a dense mask together", mask_mod is not None and config.has_dense_mask))
        if bad]
    if not why:   # (the arrays' own conditions: the kernel's `reason`, as the route asks)
        arrays = kernel_bwd_fused.reason(
            jax.ShapeDtypeStruct((1, config.s_q, 1, config.d_qk), jnp.dtype(config.dtype)),
            seq_first=config.layout == "sbhd", implementation=implementation,
            s_kv=config.s_kv)
        why = [arrays] if arrays else []
    if why:
        return f"backward: the dq and dk / dv kernels (the fused kernel: {'; '.join(why)})"
    if config.has_dense_mask:
        return ("backward: one fused kernel reading the dense mask's bits (not reproducible "
                "bit for bit)")
    return ("backward: one fused kernel where the map's mask is documents alone "
            "(not reproducible bit for bit), else the dq and dk / dv kernels")


# A shard's kernels see its own batch and head numbers; its mask_mod and score_mod get
# the call's as the shard's first row and head (two more int args, `native_op`), so
# what reads them is hoisted: a function whose reads of those numbers have no
# in-kernel form cannot run on the shard.
SHARD_NOTE = (" (on a shard of a batch / head split, where the mask_mod / score_mod reads "
              "the call's batch and head numbers as the shard's first row and head plus its "
              "own: those reads must be hoisted; run this call unsplit or on another "
              "backend)")


def _reindexed(config: AttnConfig) -> bool:
    """Is `config` a shard's, its functions reading the call's numbers (`native_op`)?"""
    return any(isinstance(f, Reindexed) for f in parts(config))


BACKEND = BlockSparseBackend()
native_op.register(BACKEND.name, native_op.Kernels(BACKEND.forward, BACKEND.backward,
                                                    arg_grads=True))
