"""Random score_mods and mask_mods for differential tests of the flex lowering
(tests/test_flex_fuzz.py on CPU, tests/gpu/test_flex_fuzz_gpu.py on cuDNN).

A grammar draws Python source over (s, b, h, q, k) and the fixed score_mod_args
``ARGS``: arithmetic, division, exp / log / log1p / tanh / sigmoid / sin / cos / abs /
sqrt / pow / erf, min / max / clip / where, integer ``//`` and ``%`` of positions,
comparisons and boolean logic of b, h, q, k, float and int arguments indexed by head
and batch, constants of awkward size (all float32-exact, so the program text and the
function agree on them), nested several levels, masks written inside the score_mod,
and a few forms the lowering must refuse (`REFUSED`). The source is kept, so a
failure prints a function to paste.
"""
from __future__ import annotations

import dataclasses
import random
import re
from typing import Callable, List, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Literal

# The modules under test, in one place (the package layout is moving).
from fusedattn.backends.cudnn import flex as cudnn_flex  # noqa: F401  (re-exported)
from fusedattn.backends.cudnn.lowering import lower as flex_lowering  # noqa: F401

from . import flex_interpreter  # noqa: F401

B, S, H, H_KV, D = 2, 12, 4, 2, 8
ARG_NAMES = ("w", "t", "z", "u", "n", "m")  # float [H], [B], [B, H], [8]; int [H], [B]


def arg_values(rng: np.random.Generator, b: int = B, h: int = H) -> Tuple[jax.Array, ...]:
    """score_mod_args of a call with b rows and h query heads."""
    return (jnp.asarray(rng.uniform(0.5, 1.5, h), jnp.float32),
            jnp.asarray(rng.uniform(-1.0, 1.0, b), jnp.float32),
            jnp.asarray(rng.uniform(-1.0, 1.0, (b, h)), jnp.float32),
            jnp.asarray(rng.uniform(-1.0, 1.0, 8), jnp.float32),
            jnp.asarray(rng.integers(0, 4, h), jnp.int32),
            jnp.asarray(rng.integers(0, 4, b), jnp.int32))


# Constants of awkward size, each exact in float32.
_CONSTS = [float(np.float32(c)) for c in (
    0.5, 2.0, -1.0, 3.0, 0.1, 1 / 3, -0.7, 1e-3, 1e-7, 2.0 ** -20, 37.5, 3e4, 65504.0,
    -0.0, 1.0, 7.0, 1e6, 0.999)]
_SMALL = [float(np.float32(c)) for c in (0.5, 2.0, -1.0, 0.1, 1 / 3, -0.7, 1e-3, 0.25, 1.5)]
VARIANTS = ("plain", "causal", "window", "padding", "gqa")

# Forms the lowering must refuse (cuDNN's graph has no such operation on the score or
# on positions), with a fragment of the reason it must give.
REFUSED = [
    ("u[q % 8] + s", "gather"),
    ("s + jnp.cumsum(s, axis=-1)", "cumsum"),
    ("s + (q & 3).astype(s.dtype)", "bitwise"),
    ("jnp.round(s)", "round"),
    ("jnp.arctan(s)", "atan"),
    ("s - jnp.max(s, axis=-1, keepdims=True)", "reduce_max"),
    ("lax.select_n(jnp.broadcast_to(q % 3, s.shape), s, 2.0 * s, -s)", "select_n"),
    ("s + jnp.sort(s, axis=-1)", "sort"),
    ("s * u[jnp.abs(q - k) % 8]", "gather"),
]


@dataclasses.dataclass(frozen=True)
class Program:
    """One drawn function: its source, what it is, what the lowering must do."""
    index: int
    kind: str              # "score", "mask" or "both"
    score_src: Optional[str]
    mask_src: Optional[str]
    variant: str
    refuse: Optional[str]  # a fragment of the reason, for a form that must be refused

    def functions(self) -> Tuple[Optional[Callable], Optional[Callable]]:
        env = {"jnp": jnp, "jax": jax, "lax": lax}
        args = ", ".join(ARG_NAMES)
        score = eval(f"lambda s, b, h, q, k, {args}: {self.score_src}", env) \
            if self.score_src else None
        mask = eval(f"lambda b, h, q, k, {args}: {self.mask_src}", env) \
            if self.mask_src else None
        return score, mask

    def describe(self) -> str:
        return (f"#{self.index} [{self.variant}] score_mod={self.score_src!r} "
                f"mask_mod={self.mask_src!r}")


class Grammar:
    def __init__(self, rng: random.Random):
        self.r = rng

    def const(self, small: bool = False) -> str:
        return repr(self.r.choice(_SMALL if small else _CONSTS))

    # ---- integer expressions of positions, heads, batches ----------------------------
    def iexpr(self, depth: int) -> str:
        r = self.r
        leaves = ["q", "k", "(q - k)", "h", "n[h]", "jnp.abs(q - k)"]
        if depth <= 0 or r.random() < 0.4:
            # per-batch values are rarer: cuDNN 9.19 misreads them (cudnn_flex refuses)
            return r.choice(("b", "m[b]")) if r.random() < 0.04 else r.choice(leaves)
        a, c = self.iexpr(depth - 1), r.choice((2, 3, 4, 5, 7, 16))
        form = r.randrange(8)
        if form == 0:
            return f"({a} // {c})"
        if form == 1:
            return f"({a} % {c})"
        if form == 2:
            return f"({a} + {self.iexpr(depth - 1)})"
        if form == 3:
            return f"({a} - {self.iexpr(depth - 1)})"
        if form == 4:
            return f"({a} * {r.choice((2, 3, -1))})"
        if form == 5:
            return f"jnp.minimum({a}, {self.iexpr(depth - 1)})"
        if form == 6:
            return f"jnp.maximum({a}, {r.choice((0, 1, 5))})"
        return f"jnp.abs({a})"

    def pred(self, depth: int, score: bool = False) -> str:
        """A predicate of positions / heads / batches (and of the score if `score`)."""
        r = self.r
        if depth > 0 and r.random() < 0.3:
            op = r.choice(("&", "|"))
            return f"({self.pred(depth - 1, score)} {op} {self.pred(depth - 1, score)})"
        if depth > 0 and r.random() < 0.1:
            return f"(~{self.pred(depth - 1, score)})"
        if score and r.random() < 0.2:
            return f"({self.fexpr(1)} {r.choice(('>', '<', '>='))} {self.const(True)})"
        cmp = r.choice(("<", "<=", ">", ">=", "==", "!="))
        rhs = self.iexpr(depth - 1) if r.random() < 0.6 else str(r.choice((0, 1, 3, 8)))
        return f"({self.iexpr(depth - 1)} {cmp} {rhs})"

    # ---- float expressions ------------------------------------------------------------
    def fleaf(self) -> str:
        r = self.r
        x = r.random()
        if x < 0.45:
            return "s"
        if x < 0.6:
            return self.const()
        if x < 0.75:
            return f"{self.iexpr(1)}.astype(s.dtype)"
        if r.random() < 0.1:
            return r.choice(("z[b, h]", "t[b]"))
        return r.choice(("w[h]", "n[h].astype(s.dtype)"))

    def fexpr(self, depth: int) -> str:
        r = self.r
        if depth <= 0 or r.random() < 0.2:
            return self.fleaf()
        a = self.fexpr(depth - 1)
        form = r.randrange(22)
        unary = {
            0: f"jnp.exp(jnp.tanh({a}) * {self.const(True)})",
            1: f"jnp.log1p(jnp.abs({a}))",
            2: f"jnp.log(jnp.abs({a}) + 1.5)",
            3: f"jnp.tanh({a})",
            4: f"jax.nn.sigmoid({a})",
            5: f"jnp.sin({a})",
            6: f"jnp.cos({a})",
            7: f"jnp.abs({a})",
            8: f"jnp.sqrt(jnp.abs({a}) + 0.25)",
            9: f"jnp.power(jnp.abs({a}) + 0.5, {r.choice((0.5, 1.5, 2.0, -1.0, 3.0))})",
            10: f"({a}) ** 2",
            11: f"jax.scipy.special.erf({a})",
            12: f"jnp.clip({a}, -2.0, {float(np.float32(float(self.const(True)) + 3.0))!r})",
            13: f"(-{a})",
        }
        if form in unary:
            return unary[form]
        b_ = self.fexpr(depth - 1)
        binary = {
            14: f"({a} + {b_})",
            15: f"({a} - {b_})",
            16: f"({a} * {b_})",
            17: f"({a} / (jnp.abs({b_}) + 1.0))",
            18: f"jnp.minimum({a}, {b_})",
            19: f"jnp.maximum({a}, {b_})",
            20: f"jnp.where({self.pred(1, score=True)}, {a}, {b_})",
            21: f"({a} / {r.choice((3.0, -0.5, 7.0, float(np.float32(1e-3))))!r})",
        }
        return binary[form]

    def score_mod(self) -> str:
        r = self.r
        body = self.fexpr(r.randint(1, 4))
        if not re.search(r"(?<![\w.])s(?![\w.])", body):  # reads the score
            body = f"(s + {body})"
        form = r.random()
        if form < 0.35:
            body = f"s + {body}"
        elif form < 0.5:
            body = f"s * {body}"
        if r.random() < 0.12:  # a mask inside the score_mod
            body = f"jnp.where({self.pred(2)} | (q == k), {body}, -jnp.inf)"
        return body

    def mask_mod(self) -> str:
        # (q == k) keeps each row one visible key: rows all masked are a convention
        # of each backend, not what the lowering computes.
        return f"{self.pred(self.r.randint(1, 3))} | (q == k)"


def draw(count: int, seed: int = 0, refuse_every: int = 25) -> List[Program]:
    """`count` programs from a fixed seed: mostly score_mods, some mask_mods and both,
    every `refuse_every`-th a form the lowering must refuse."""
    r = random.Random(seed)
    g = Grammar(r)
    out = []
    for i in range(count):
        variant = VARIANTS[i % len(VARIANTS)]
        if refuse_every and i % refuse_every == refuse_every - 1:
            src, why = REFUSED[(i // refuse_every) % len(REFUSED)]
            out.append(Program(i, "score", src, None, variant, why))
            continue
        x = r.random()
        kind = "score" if x < 0.7 else "mask" if x < 0.85 else "both"
        out.append(Program(i, kind, None if kind == "mask" else g.score_mod(),
                           None if kind == "score" else g.mask_mod(), variant, None))
    return out


# ---- the CPU check: the lowering's programs (NumPy interpreter) against JAX ---------------
def call_options(program: Program, s: int = S):
    """fused_attn's keyword arguments of the program's call (its variant)."""
    from fusedattn import SequenceDescriptor  # noqa: PLC0415  (tests only)
    score, mask = program.functions()
    lengths = (jnp.asarray([s, s * 7 // 12], jnp.int32), jnp.asarray([s * 3 // 4, s], jnp.int32))
    change = {"causal": dict(mask="causal"), "window": dict(window=(s // 4, s // 12)),
              "padding": dict(sequence=SequenceDescriptor.from_lengths(*lengths))
              }.get(program.variant, {})
    return dict(score_mod=score, mask_mod=mask, **change), \
        (lengths if program.variant == "padding" else ())


def build(program: Program, args):
    """(config, lengths) of the program's call: bf16 [B, S, H, D], its variant."""
    from fusedattn.validation import build_call  # noqa: PLC0415
    q = jax.ShapeDtypeStruct((B, S, H, D), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((B, S, H_KV if program.variant == "gqa" else H, D), jnp.bfloat16)
    options, lengths = call_options(program)
    config, _ = build_call(q, kv, kv, score_mod_args=args, **options)
    return config, lengths


def _close(got, want, want32, where) -> Optional[str]:
    """None when `got` equals `want` (float64) at `where`, within what float32 itself
    moves it (`want32`): ill-conditioned spots are judged by that spread."""
    got, want, want32 = (np.broadcast_to(np.asarray(x, np.float64), where.shape)
                         for x in (got, want, want32))
    judged = where & (np.isfinite(want) == np.isfinite(want32))
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf where both are masked
        same = (np.isnan(got) == np.isnan(want)) & ((got == want) | ~np.isinf(want))
        tol = 1e-5 * (1.0 + np.abs(want)) + 4.0 * np.abs(np.nan_to_num(want32 - want))
        diff = np.abs(np.nan_to_num(got - want, nan=0.0, posinf=np.inf, neginf=np.inf))
    both = np.isfinite(want) & np.isfinite(got)
    bad = judged & (~same | (both & (diff > tol)) | (np.isfinite(want) != np.isfinite(got)))
    if not bad.any():
        return None
    i = tuple(np.argwhere(bad)[0])
    return f"at {i}: got {got[i]!r}, want {want[i]!r} (float32 {want32[i]!r})"


def check_cpu(program: Program, seed: int) -> Tuple[str, str]:
    """("match" | "refused" | "mismatch", detail) of one program: the forward program's
    scores and the bprop's dS for a random incoming gradient, from the interpreter,
    against the function itself in float64 (what the XLA backend computes)."""
    rng = np.random.default_rng(seed)
    args = arg_values(rng)
    config, lengths = build(program, args)
    try:
        low = flex_lowering.lower(config, config.score_mod)
    except flex_lowering.Unsupported as e:
        return "refused", str(e)
    inputs = [np.asarray(x) for x in low.evaluate(args, lengths)]
    score = rng.standard_normal((B, H, S, S)) * 2.0
    grad = rng.standard_normal((B, H, S, S))
    q_idx, kv_idx = np.arange(S).reshape(1, 1, S, 1), np.arange(S).reshape(1, 1, 1, S)
    got = flex_interpreter.interpret(low.forward, score, q_idx, kv_idx, inputs)
    shift = low.row_shift(args, lengths)
    got = got + (0.0 if shift is None else np.asarray(shift, np.float64))
    d_got = flex_interpreter.interpret(low.bprop, score, q_idx, kv_idx, inputs, grad,
                                       low.forward)
    f = flex_lowering.masked_score_mod(config, config.score_mod, None)
    want, d_want = _reference(f, score, grad, args, lengths, jnp.float64)
    f32 = []  # float32's own values, only to judge a difference (ill-conditioned spots)

    def spread(i):
        if not f32:
            f32.extend(_reference(f, score, grad, args, lengths, jnp.float32))
        return f32[i]
    everywhere = np.ones(want.shape, bool)
    if _close(got, want, want, everywhere) and _close(got, want, spread(0), everywhere):
        return "mismatch", f"forward scores {_close(got, want, spread(0), everywhere)}"
    visible = np.isfinite(want) & np.isfinite(d_want)  # cuDNN's dS is 0 where P is
    if _close(d_got, d_want, d_want, visible) and _close(d_got, d_want, spread(1), visible):
        return "mismatch", f"bprop dS {_close(d_got, d_want, spread(1), visible)}"
    # The magnitude bound (lowering.ranges) holds: unit scores never exceed it.
    unit = flex_interpreter.interpret(low.forward, rng.uniform(-1.0, 1.0, score.shape), q_idx,
                                      kv_idx, inputs)
    largest = float(np.max(np.abs(unit[np.isfinite(unit)]), initial=0.0))
    if largest > low.magnitude * (1.0 + 1e-6) + 1e-6:
        return "mismatch", f"values reach {largest:.6g} past the bound {low.magnitude:.6g}"
    return "match", ""


def _reference(f, score, grad, args, lengths, dtype):
    """The function's values and VJP at `score`, in `dtype`: JAX's own jaxpr, evaluated
    one primitive at a time (eager calls of jitted jnp helpers would compile anew for
    every function; single primitives compile once per shape). b, h, q_idx and kv_idx
    come as whole [B, H, S, S] grids: the function's value at each (b, h, q, kv) is
    the same as from broadcasting ones (the programs are elementwise: reductions are
    among the refused forms, which never get here), and with one shape for nearly every
    operand the primitives compile about 160 times over 2000 programs, not 1100."""
    with jax.enable_x64(dtype == jnp.float64):
        full = lambda x: jnp.broadcast_to(x, (B, H, S, S))  # noqa: E731
        batch = full(jnp.arange(B, dtype=jnp.int32).reshape(B, 1, 1, 1))
        head = full(jnp.arange(H, dtype=jnp.int32).reshape(1, H, 1, 1))
        q_idx = full(jnp.arange(S, dtype=jnp.int32).reshape(1, 1, S, 1))
        kv_idx = full(jnp.arange(S, dtype=jnp.int32).reshape(1, 1, 1, S))

        def both(s, g, *rest):
            out, vjp = jax.vjp(lambda x: f(x, batch, head, q_idx, kv_idx, *rest), s)
            return out, vjp(g)[0]
        rest = list(args) + list(lengths)
        s, g = jnp.asarray(score, dtype), jnp.asarray(grad, dtype)
        closed = jax.make_jaxpr(both)(s, g, *rest)
        out = _eval(closed.jaxpr, closed.consts, [s, g, *rest])
        return [np.asarray(x, np.float64) for x in out]


def _eval(jaxpr, consts, args):
    env = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))

    def read(v):
        return v.val if isinstance(v, Literal) else env[v]
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        sub = next((eqn.params[k] for k in ("jaxpr", "call_jaxpr", "fun_jaxpr")
                    if k in eqn.params), None)
        if sub is not None and eqn.primitive.name in ("pjit", "jit", "custom_jvp_call",
                                                       "custom_vjp_call", "closed_call"):
            inner = sub.jaxpr if hasattr(sub, "jaxpr") else sub
            outs = _eval(inner, getattr(sub, "consts", ()), ins)
        else:
            bound = eqn.primitive.get_bind_params(eqn.params)
            subfuns, params = bound if isinstance(bound, tuple) else ((), bound)
            outs = eqn.primitive.bind(*subfuns, *ins, **params)
            outs = outs if eqn.primitive.multiple_results else [outs]
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]
