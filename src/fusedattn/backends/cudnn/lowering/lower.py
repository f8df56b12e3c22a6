"""A JAX score_mod / mask_mod -> a program of cuDNN pointwise operations.

The function cuDNN runs is `masked_score_mod`: the user's score_mod, then the
mask_mod and fusedattn's own masks (causal of either alignment, windows,
padding lengths) as a select to -inf, since cuDNN turns its built-in masks off
when a score_mod is set. It is traced to a jaxpr over the call's shapes (score
``[b, h, s_q, s_kv]``, batch ``[b, 1, 1, 1]``, head ``[1, h, 1, 1]``, q_idx
``[1, 1, s_q, 1]``, kv_idx ``[1, 1, 1, s_kv]``) and split by what each value
depends on:

* *static* values (only batch, head, score_mod_args, lengths, constants) are
  evaluated by XLA at call time into small float tensors (``[b|1, h|1, 1, 1]``
  for per-head slopes and the like) that the graph takes as inputs (`inputs`);
* *dynamic* values (anything that depends on the score or an index) become
  instructions of the program (csrc/cuda/cudnn_flex.h has the grammar).

The backward program (score_mod_bprop) is JAX's derivative of the score_mod with
respect to the score, lowered the same way and multiplied by the incoming gradient
``g``; the masks stay out of it (cuDNN's dS is already 0 wherever P is). It reads
the forward's score-chain values (``wN``) rather than recomputing them, recomputes
what depends on positions alone, and reads the score through the forward's own ``id``
(`_read_score_through_forward`). A primitive cuDNN cannot express on dynamic values (a
gather, a reduction, integer bit operations) raises `Unsupported` naming it;
`tests/support/flex_interpreter.py` runs programs with NumPy for tests.

What compiles is not always what cuDNN's engines take: a graph they refuse is
refused at the support probe with cuDNN's message, and the call falls back.

Index arithmetic stays in int32 (ops named ``add.i`` and the like; integer static
inputs are int32 tensors), and the masks are written in the forms of cuDNN's own
(row >= column + offset; column + left + 1 > row): cuDNN's engines take offsets and two masks in that form and refuse them computed in fp32
(benchmarks/tune/flex_ops.py, the ``-int`` probes).

The program text is canonical (it is made from the jaxpr, not from the
function's identity), so it is the cache key's part for the score_mod:
two equal lambdas share a graph; different ones never collide.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Literal

from ....config import AttnConfig
from ....jaxprs import flatten, name_of
from ....score_mods import Masked
from . import derivative as flex_derivative
from . import hoist as flex_hoist
from . import ranges as flex_ranges
from .program import (Program, Unsupported, expand, is_int, kept_whole, live, parse_lines,
                      reads_score)

__all__ = ["Lowered", "Unsupported", "lower", "masked_score_mod", "unbroadcast"]


@dataclasses.dataclass(frozen=True)
class Lowered:
    """A lowered score_mod: the two programs and what feeds their static inputs."""
    forward: str
    bprop: str
    input_shapes: Tuple[Tuple[int, int, int, int], ...]
    input_ints: Tuple[bool, ...]  # which static inputs are int32 (else float32)
    # Evaluates the static inputs from (score_mod_args, q_lengths, kv_lengths).
    evaluate: Callable = dataclasses.field(compare=False, repr=False, hash=False)
    # The query-only terms left out of the forward program (`flex_hoist`), as text
    # ("" when none), and what evaluates them from (score_mod_args, lengths): an fp32
    # [b|1, h|1, s_q, 1] array to add to the LSE, or None.
    row_terms: str = ""
    row_shift: Callable = dataclasses.field(compare=False, repr=False, hash=False,
                                            default=lambda args, lengths: None)
    # The largest magnitude the forward's result provably reaches (`ranges`; inf: unknown).
    magnitude: float = math.inf


def masked_score_mod(config: AttnConfig, score_mod: Optional[Callable],
                     mask_mod: Optional[Callable]) -> Callable:
    """``f(score, batch, head, q_idx, kv_idx, *args, [q_len, kv_len])``: the score_mod,
    then every mask of the config as -inf (lengths are passed when padded)."""
    n_args = len(config.score_mod_arg_specs)
    left, right = config.window_bounds()

    def f(score, batch, head, q_idx, kv_idx, *rest):
        args, lengths = rest[:n_args], rest[n_args:]
        s = score if score_mod is None else score_mod(score, batch, head, q_idx, kv_idx, *args)
        visible = None

        def both(a, b):
            return b if a is None else a & b
        if mask_mod is not None:
            visible = mask_mod(batch, head, q_idx, kv_idx, *args)
        if lengths:
            q_len, kv_len = (x[batch] for x in lengths)
            visible = both(visible, (q_idx < q_len) & (kv_idx < kv_len))
        centre = q_idx
        if config.bottom_right:
            centre = q_idx + ((kv_len - q_len) if lengths else config.s_kv - config.s_q)
        # cuDNN's own mask forms (its diagonal band mask), which its engines recognise.
        if right >= 0:  # row + right >= column
            visible = both(visible, (centre + right if right else centre) >= kv_idx)
        if left >= 0:  # column + left + 1 > row
            visible = both(visible, kv_idx + (left + 1) > centre)
        return s if visible is None else jnp.where(visible, s, -jnp.inf)
    return f


def _specs(config: AttnConfig):
    i32 = jnp.int32
    b, h, sq, skv = config.batch, config.h_q, config.s_q, config.s_kv
    specs = [jax.ShapeDtypeStruct((b, h, sq, skv), jnp.float32),
             jax.ShapeDtypeStruct((b, 1, 1, 1), i32), jax.ShapeDtypeStruct((1, h, 1, 1), i32),
             jax.ShapeDtypeStruct((1, 1, sq, 1), i32), jax.ShapeDtypeStruct((1, 1, 1, skv), i32)]
    specs += [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in config.score_mod_arg_specs]
    if config.is_padded:
        specs += [jax.ShapeDtypeStruct((b,), i32)] * 2
    return specs


def lower(config: AttnConfig, score_mod: Optional[Callable],
          mask_mod: Optional[Callable] = None) -> Lowered:
    """The programs of `config`'s masks composed with score_mod / mask_mod (raises
    `Unsupported` with the reason)."""
    specs = _specs(config)
    # The bprop needs the score_mod's derivative only where a pair is visible: cuDNN
    # multiplies it into dS = P * (dP - D), and P is 0 wherever a mask removed the
    # pair. So the masks stay out of the bprop (cuDNN's engines take a plain one).
    unmasked = score_mod.score_mod if isinstance(score_mod, Masked) else score_mod
    n_args = len(config.score_mod_arg_specs)

    def derivative(score, batch, head, q_idx, kv_idx, *rest):
        if unmasked is None:
            return jnp.ones_like(score)
        mod = lambda s: fused(s, batch, head, q_idx, kv_idx, *rest[:n_args])  # noqa: E731
        return jax.grad(lambda s: jnp.sum(mod(s)))(score)
    try:
        forward_mod = score_mod
        if unmasked is not None:
            fused, rewrites = flex_derivative.with_fused_derivatives(unmasked,
                                                                    specs[:5 + n_args])
            if rewrites:  # the bprop reads the rewritten forward's values
                forward_mod = dataclasses.replace(score_mod, score_mod=fused) \
                    if isinstance(score_mod, Masked) else fused
        f = masked_score_mod(config, forward_mod, mask_mod)
        fwd = jax.make_jaxpr(f)(*specs)
        bwd = jax.make_jaxpr(derivative)(*specs)
    except Exception as e:  # a function that does not trace: say so
        raise Unsupported(f"score_mod / mask_mod did not trace: {type(e).__name__}: {e}") from e
    forward_texts: Dict[str, str] = {}

    def lower_one(closed, first: int, masks: frozenset = frozenset()) -> Program:
        eqns, consts, env = flatten(closed, keep=kept_whole)
        consts = {v: np.asarray(c) for v, c in consts.items()}  # jax arrays too
        out = name_of(env, closed.jaxpr.outvars[0])
        is_bprop = closed is bwd
        p = Program(first, consts, forward_texts if is_bprop else None, masks,
                     tuple(pf.lines) if is_bprop else ())
        invars = closed.jaxpr.invars
        result = p.lower(live(eqns, [out]), out, dict(zip((invars[0], invars[3], invars[4]),
                                                           ("s", "q", "k"))))
        if is_bprop:
            result = p.times_gradient(result)
        p.lines = _prune(p.lines, result)
        return p

    pf = lower_one(fwd, 0)
    # The bprop reads the forward's score chain (float values), nothing else of it.
    on_chain = reads_score(pf.lines)
    forward_texts = {re.sub(r"\bv(\d+)", r"w\1", line): f"w{i}"
                     for i, line in enumerate(pf.lines) if on_chain[i]}
    masks = frozenset(expand(pf.lines, m.group(1)) for m in (
        re.fullmatch(r"sel:(v\d+),[^,]+,c-inf", line) for line in pf.lines) if m)
    pb = lower_one(bwd, len(pf.inputs), masks)
    if pb.dropped_mask and not _constant_times_gradient(pb.lines):
        # Past the dropped select the derivative reads the score or positions, which
        # may be NaN / inf where the mask hid the pair (0 * NaN): keep the select.
        pb = lower_one(bwd, len(pf.inputs))
    row, row_text = _hoist_row_terms(pf, pb)
    programs = [(pf, fwd), (pb, bwd)]
    _read_score_through_forward(programs[0][0], programs[1][0])
    shapes = tuple(_input_shape(p, v) for p, _ in programs for v in p.inputs)
    ints = tuple(is_int(v) for p, _ in programs for v in p.inputs)

    def evaluate(args: Sequence[jax.Array], lengths: Sequence[jax.Array]):
        b, h = config.batch, config.h_q
        batch = jnp.arange(b, dtype=jnp.int32).reshape(b, 1, 1, 1)
        head = jnp.arange(h, dtype=jnp.int32).reshape(1, h, 1, 1)
        values = []
        for p, closed in programs:
            env = _evaluate_static(p, closed, batch, head, list(args) + list(lengths))
            values += [_materialize(p, env, v, s) for v, s in zip(p.inputs, shapes[len(values):])]
        return values

    def row_shift(args: Sequence[jax.Array], lengths: Sequence[jax.Array]):
        if not row:
            return None
        batch = jnp.arange(config.batch, dtype=jnp.int32).reshape(-1, 1, 1, 1)
        head = jnp.arange(config.h_q, dtype=jnp.int32).reshape(1, -1, 1, 1)
        env = _evaluate_static(pf, fwd, batch, head, list(args) + list(lengths))
        q_idx = jnp.arange(config.s_q, dtype=jnp.float32).reshape(1, 1, -1, 1)
        total = jnp.zeros((1, 1, 1, 1), jnp.float32)
        for coef, factors, atom in row:
            value = jnp.float32(coef) * (q_idx if atom == "q" else 1.0)
            for var in factors + ((atom,) if atom not in ("1", "q") else ()):
                value = value * _materialize(pf, env, var, _input_shape(pf, var)).astype(
                    jnp.float32)
            total = total + value
        return total
    (pf, _), (pb, _) = programs
    _masks_after_score_mod(pf, pb)
    pb.lines = _static_factors_last(pb.lines)
    return Lowered("|".join(pf.lines), "|".join(pb.lines), shapes, ints, evaluate, row_text,
                   row_shift, flex_ranges.bound(pf.lines, config.s_q, config.s_kv))


def _static_factors_last(lines: List[str]) -> List[str]:
    """A dynamic value times an expression of static values alone (`unbroadcast`: per-head
    values, constants) is multiplied into the expression's leaves instead, so no
    intermediate keeps a static input's small shape: ``g * (a2 * a3)`` becomes
    ``(g * a2) * a3`` and ``g * (1 + a1)`` ``g * 1 + g * a1``. A program with another
    use of such an expression stays as it was (`flex.reason` refuses it)."""
    parsed = parse_lines(lines)
    static = set(range(len(parsed))) - _dynamic_lines(parsed)
    arithmetic = {i for i in static if parsed[i][0] in _DISTRIBUTES}
    if not arithmetic:
        return lines
    out: List[str] = []
    new: Dict[str, str] = {}  # old value token -> token in `out`

    def emit(line: str) -> str:
        out.append(line)
        return f"v{len(out) - 1}"

    def times(d: str, token: str) -> str:  # d * (the static expression `token`)
        if not (token.startswith("v") and int(token[1:]) in arithmetic):
            return d if token == "c1.0" else emit(f"mul:{d},{token}")
        op, (x, *rest) = parsed[int(token[1:])]
        if op == "mul":
            return times(times(d, x), rest[0])
        if op == "div" and not (rest[0].startswith("v") and int(rest[0][1:]) in static):
            return emit(f"div:{times(d, x)},{rest[0]}")
        if op in ("add", "sub"):
            return emit(f"{op}:{times(d, x)},{times(d, rest[0])}")
        if op == "neg":
            return emit(f"neg:{times(d, x)}")
        raise _Keep
    try:
        for i, (op, args) in enumerate(parsed):
            if i in arithmetic:
                continue
            held = [j for j, a in enumerate(args) if a.startswith("v") and int(a[1:]) in arithmetic]
            if not held:
                new[f"v{i}"] = emit(f"{op}:{','.join(new.get(a, a) for a in args)}")
            elif op == "mul" and len(held) == 1:
                new[f"v{i}"] = times(new.get(args[1 - held[0]], args[1 - held[0]]), args[held[0]])
            else:
                raise _Keep
    except _Keep:
        return lines
    return out


class _Keep(Exception):
    """A static expression `_static_factors_last` cannot move."""


_DISTRIBUTES = frozenset({"mul", "div", "add", "sub", "neg"})


def _dynamic_lines(parsed) -> set:
    """Numbers of the instructions that read the score, gradient, a position or a
    forward value, directly or through another such instruction."""
    dynamic = set()
    for i, (op, args) in enumerate(parsed):
        if any(a in ("s", "q", "k", "g") or a[0] == "w" or (a[0] == "v" and int(a[1:]) in dynamic)
               for a in args):
            dynamic.add(i)
    return dynamic


def unbroadcast(lines: Sequence[str]) -> List[str]:
    """The arithmetic instructions of a program that read no score, gradient, position
    nor forward value: their results keep a static input's small shape instead of the
    scores' (``1 + n[h]``)."""
    parsed = parse_lines(lines)
    dynamic = _dynamic_lines(parsed)
    return [f"{op}:{','.join(args)}" for i, (op, args) in enumerate(parsed)
            if i not in dynamic and op.split(".")[0] not in _PREDICATES]


# How a program reads a static boolean (``ne:aN,c0.0``) and combines predicates: these
# ran on cuDNN with their small shapes; static arithmetic is what crashed.
_PREDICATES = frozenset({"eq", "ne", "gt", "ge", "lt", "le", "and", "or", "not", "sel"})


def _hoist_row_terms(pf: Program, pb: Program):
    """Leaves the forward's query-only terms out of it (`flex_hoist`), and inputs no
    program reads any more out of both. Returns the terms with their static inputs as
    vars, ((coefficient, factor vars, atom: "1", "q" or a var), ...), and as text."""
    if not pf.lines or any(t.startswith("w") for t in flex_hoist.tokens(pb.lines)):
        return (), ""  # (the bprop reads forward values by number)
    token_var = {f"a{pf.first_input + i}": v for i, v in enumerate(pf.inputs)}
    shapes = {t: _input_shape(pf, v) for t, v in token_var.items()}
    result = pf.lines[-1].split(":")[1] if pf.lines[-1].startswith("id:") \
        else f"v{len(pf.lines) - 1}"
    lines, result, terms = flex_hoist.hoist(pf.lines, result, shapes)
    if not terms:
        return (), ""
    pf.lines = _prune(lines, result)
    unused = flex_hoist.unused_inputs(0, len(pf.inputs), pf.lines, pb.lines)
    if unused:  # e.g. a query offset that only the hoisted terms read
        kept = [i for i in range(len(pf.inputs) + len(pb.inputs)) if i not in unused]
        mapping = {f"a{old}": f"a{new}" for new, old in enumerate(kept)}
        pf.lines = flex_hoist.rename_inputs(pf.lines, mapping)
        pb.lines = flex_hoist.rename_inputs(pb.lines, mapping)
        pf.inputs = [v for i, v in enumerate(pf.inputs) if i not in unused]
    return (tuple((c, tuple(token_var[f] for f in factors), token_var.get(atom, atom))
                  for c, factors, atom in terms), flex_hoist.describe(terms))


def _prune(lines: List[str], result: str) -> List[str]:
    """The instructions `result` needs, renumbered, ending with it (an `id` when the
    result is not an instruction of its own)."""
    parsed = parse_lines(lines)
    order = sorted(_needed(parsed, result))
    new_index = {f"v{old}": f"v{i}" for i, old in enumerate(order)}
    out = [f"{parsed[i][0]}:{','.join(new_index.get(a, a) for a in parsed[i][1])}" for i in order]
    result = new_index.get(result, result)
    if result != f"v{len(out) - 1}":
        out.append(f"id:{result}")
    return out


def _masks_after_score_mod(forward: Program, bprop: Program) -> None:
    """Orders the forward in the frontend's own form of a score_mod and its masks:
    each value's score chain first (the first operand too, before a value of positions,
    where the operation commutes), its score-independent operands (a mask's comparison
    of positions) right before it, and every select to -inf with a comparison of its
    own. The native side generates a forward's index nodes from the latest float value,
    so each mask's indices are generated from the score it masks: the form in which
    cuDNN skips the tiles a causal mask hides."""
    parsed = parse_lines(forward.lines)
    reads_score = []
    for op, args in parsed:
        reads_score.append(any(a == "s" or (a.startswith("v") and reads_score[int(a[1:])])
                               for a in args))
    lines: List[str] = []
    emitted: Dict[int, str] = {}  # old value -> its token in `lines`
    order: Dict[int, int] = {}    # old value -> new number (first emission), for wN

    def visit(i: int, fresh: bool = False) -> str:
        if i in emitted and not (fresh and not reads_score[i]):
            return emitted[i]
        op, args = parsed[i]
        tokens = dict.fromkeys(range(len(args)))
        is_mask = op == "sel" and args[2] == "c-inf"
        # the score chain first, then what only positions and inputs give
        for j in sorted(range(len(args)), key=lambda j: not _reads(args[j], reads_score)):
            a = args[j]
            tokens[j] = visit(int(a[1:]), fresh or (is_mask and j == 0)) \
                if re.fullmatch(r"v\d+", a) else a
        slots = list(range(len(args)))
        if op in _COMMUTATIVE and re.fullmatch(r"v\d+|q|k", args[0]) \
                and not _reads(args[0], reads_score) and _reads(args[1], reads_score):
            slots.reverse()  # the score chain before a value of positions (see below)
        lines.append(f"{op}:{','.join(tokens[j] for j in slots)}")
        emitted[i] = f"v{len(lines) - 1}"
        order.setdefault(i, len(lines) - 1)
        return emitted[i]
    needed = _needed(parsed, f"v{len(parsed) - 1}")
    for i in range(len(parsed)):  # values the result does not read (the bprop's) first
        if i not in needed:
            visit(i)
    visit(len(parsed) - 1)
    forward.lines = lines
    renumber = {f"w{old}": f"w{new}" for old, new in order.items()}
    bprop.lines = [f"{op}:{','.join(renumber.get(a, a) for a in args)}"
                   for op, args in parse_lines(bprop.lines)]


# Float operations whose operands may swap. cuDNN 9.19's backward gives dQ / dK far off
# (out and dV right) when an add's first operand is a function of positions and its
# second the score chain (``tanh(q // 16) + s``; ``s + tanh(q // 16)`` is right):
# the score chain goes before such a value (constants and static inputs keep their
# place: the frontend's own forms, soft-capping's ``c * tanh``; tests/gpu/test_flex_gpu.py
# position_term_first).
_COMMUTATIVE = frozenset({"add", "mul", "max", "min"})


def _reads(token: str, reads_score: List[bool]) -> bool:
    return token == "s" or (re.fullmatch(r"v\d+", token) is not None
                            and reads_score[int(token[1:])])


def _needed(parsed, result: str) -> set:
    """The numbers of the instructions `result` reads, itself included."""
    needed, stack = set(), [result]
    while stack:
        t = stack.pop()
        if t.startswith("v") and int(t[1:]) not in needed:
            needed.add(int(t[1:]))
            stack.extend(parsed[int(t[1:])][1])
    return needed


def _read_score_through_forward(forward: Program, bprop: Program) -> None:
    """A bprop that reads the score itself reads it through an ``id`` the forward makes
    first and reads the score through: the form of the frontend's own soft-capping,
    whose bprop reads a value on the forward's chain. A bprop reading an ``id`` no
    forward instruction reads got a wrong dV from cuDNN (docs/decisions.md)."""
    if "s" not in flex_hoist.tokens(bprop.lines):
        return

    def shift(token, prefix):
        return f"{prefix}{int(token[1:]) + 1}" if re.fullmatch(prefix + r"\d+", token) else token
    forward.lines = ["id:s"] + [
        f"{op}:{','.join('v0' if a == 's' else shift(a, 'v') for a in args.split(','))}"
        for op, args in (line.split(":") for line in forward.lines)]
    bprop.lines = [
        f"{op}:{','.join('w0' if a == 's' else shift(a, 'w') for a in args.split(','))}"
        for op, args in (line.split(":") for line in bprop.lines)]


def _source(p: Program, var):
    """The var a chain of static broadcasts starts from, and where its dims land in
    `var` (None: all of them, in order)."""
    dims = None
    while var in p.origin:
        var, kept = p.origin[var]
        dims = kept if dims is None else tuple(dims[d] for d in kept)
    return var, dims


def _constant_times_gradient(lines: List[str]) -> bool:
    """Whether a bprop program reads only the gradient and constants."""
    return all(a == "g" or a[0] in "cv" for a in flex_hoist.tokens(lines))


def _input_shape(p: Program, var) -> Tuple[int, int, int, int]:
    """The 4-d [b|1, h|1, s_q|1, s_kv|1] shape a static input keeps."""
    src, dims = _source(p, var)
    shape = tuple(src.aval.shape)
    if dims is not None:
        full = [1] * len(var.aval.shape)
        for size, d in zip(shape, dims):
            full[d] = size
        shape = tuple(full)
    shape = (1,) * (4 - len(shape)) + shape
    if len(shape) != 4:
        raise Unsupported(f"a static score_mod value of shape {shape} does not broadcast over "
                          f"[b, h, s_q, s_kv]")
    return shape


def _evaluate_static(p: Program, closed, batch, head, rest):
    """Every static value (XLA ops on the real batch / head indices and arguments)."""
    invars = closed.jaxpr.invars
    env = dict(zip(invars[1:3], (batch, head)))
    env.update(zip(invars[5:], rest))
    env.update(p.arrays)

    def read(atom):
        if isinstance(atom, Literal):
            return atom.val
        if atom in p.const:  # a folded scalar: back to the var's shape and dtype (an
            # int32 `h % 4` takes no float 4.0; a select, no scalar case)
            return jnp.full(atom.aval.shape, p.const[atom], atom.aval.dtype)
        return env[atom]
    for eqn in p.static_eqns:  # (a broadcast to full size that no input reads: XLA drops it)
        outs = eqn.prim.bind(*[read(v) for v in eqn.ins], **eqn.params)
        env.update(zip(eqn.outs, outs if eqn.prim.multiple_results else [outs]))
    return env


def _materialize(p: Program, env, var, shape):
    src, _ = _source(p, var)
    dtype = jnp.int32 if is_int(var) else jnp.float32
    return jnp.asarray(env[src]).astype(dtype).reshape(shape)
