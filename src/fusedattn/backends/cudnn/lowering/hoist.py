"""Terms of a score_mod that depend on the query row alone leave the cuDNN program.

Softmax is shift-invariant along a row: ``softmax(x + r(q))`` equals ``softmax(x)``
for any finite r that does not depend on the key. A score_mod such as the relative
position ``s + c * (q - k)`` or ALiBi ``s + slope[h] * (k - q)`` adds such a term
(``c * q``, ``-slope[h] * q``), and every pointwise instruction costs the kernel
(docs/decisions.md). So the forward program computes the score without the row terms,
the output and every gradient are unchanged (the backward recomputes the same
program from the same LSE), and only the LSE differs by r. The cudnn kernels add r
to the LSE they return and take it off again before the backward (`cudnn.forward`,
`cudnn.backward`): r holds the call's constants too (a context-parallel block's key
offset), so only LSEs with r added back merge across blocks.

The analysis is linear algebra on the program text: sums, differences, negations
and products with constants or per-(batch, head, query) inputs are expanded into
terms ``coefficient * factors * atom``; a term whose atom is the query index, a
constant or such an input, with such factors, is a row term. It looks through the
masks (``sel(p, x + r, -inf) = sel(p, x, -inf) + r`` and a max of two such selects
with the same r), and leaves the program as it was when the row terms sit anywhere
else (inside a tanh, say), when nothing but them would remain beside the score, or
when the bprop reads forward values (their numbering would change).
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

from .program import fmt, parse_lines

# (coefficient, factors (static input tokens "aN", sorted), atom token: "1", "q",
# "s", "k", "aN", or "vN" for an instruction the expansion does not look into)
Term = Tuple[float, Tuple[str, ...], str]

class _Hoister:
    def __init__(self, lines: Sequence[str], shapes: Dict[str, Tuple[int, int, int, int]]):
        self.lines = list(lines)
        self.parsed = parse_lines(lines)
        self.shapes = shapes  # static input token -> its [b|1, h|1, s_q|1, s_kv|1] shape

    def per_row(self, token: str) -> bool:
        """A static input constant along the keys (a per-head slope, an offset)."""
        return token in self.shapes and self.shapes[token][3] == 1

    def emit(self, op: str, *args: str) -> str:
        text = f"{op}:{','.join(args)}"
        if text in self.lines:  # both selects of an or-mask rebuild the same score
            return f"v{self.lines.index(text)}"
        self.lines.append(text)
        self.parsed.append((op, list(args)))
        return f"v{len(self.lines) - 1}"

    # ---- expansion into terms -----------------------------------------------------------
    def terms(self, token: str) -> List[Term]:
        if token.startswith("c"):
            value = float(token[1:])
            return [(value, (), "1")] if math.isfinite(value) else [(1.0, (), token)]
        if not token.startswith("v"):
            return [(1.0, (), token)]
        op, args = self.parsed[int(token[1:])]
        base = op.split(".")[0]
        if base == "add":
            return self.terms(args[0]) + self.terms(args[1])
        if base == "sub":
            return self.terms(args[0]) + _scaled(self.terms(args[1]), -1.0)
        if base == "neg":
            return _scaled(self.terms(args[0]), -1.0)
        if base == "id":
            return self.terms(args[0])
        if base == "mul":
            for mine, other in ((args[0], args[1]), (args[1], args[0])):
                expanded = self.terms(mine)
                if len(expanded) == 1 and expanded[0][1:] == ((), "1"):
                    return _scaled(self.terms(other), expanded[0][0])
                if self.per_row(mine) and not self.per_row(other):
                    return [(c, tuple(sorted(f + (mine,))), a) for c, f, a in self.terms(other)]
        return [(1.0, (), token)]

    def is_row_term(self, term: Term) -> bool:
        _, factors, atom = term
        return (atom in ("1", "q") or self.per_row(atom)) and all(map(self.per_row, factors))

    # ---- the program without them -------------------------------------------------------
    def hoist(self, token: str) -> Tuple[str, Tuple[Term, ...]]:
        """(a token computing `token` minus its row terms, those terms); the terms are
        empty where nothing is hoisted (the token is then returned as it was)."""
        if token.startswith("v"):
            op, args = self.parsed[int(token[1:])]
            if op == "sel" and args[2] == "c-inf":
                inner, shift = self.hoist(args[1])
                return (self.emit("sel", args[0], inner, "c-inf"), shift) if shift else (token, ())
            if op == "id":
                return self.hoist(args[0])
            if op == "max":
                (a, ra), (b, rb) = self.hoist(args[0]), self.hoist(args[1])
                if ra and ra == rb and all(self._is_mask(t) for t in args):
                    return self.emit("max", a, b), ra
                return token, ()
        terms = _merged(self.terms(token))
        row = tuple(t for t in terms if self.is_row_term(t))
        rest = [t for t in terms if not self.is_row_term(t)]
        if not row or not any(atom == "s" for _, _, atom in rest):
            return token, ()
        return self._sum(rest), row

    def _is_mask(self, token: str) -> bool:
        if not token.startswith("v"):
            return False
        op, args = self.parsed[int(token[1:])]
        return op == "sel" and args[2] == "c-inf"

    def _sum(self, terms: List[Term]) -> str:
        """Instructions adding up `terms`, the score's first."""
        terms = sorted(terms, key=lambda t: t[2] != "s")
        acc = None
        for coef, factors, atom in terms:
            value = atom
            for f in factors:
                value = self.emit("mul", f, value)
            if abs(coef) != 1.0:
                value = self.emit("mul", fmt(abs(coef)), value)
            if acc is None:
                acc = value if coef > 0 else self.emit("neg", value)
            else:
                acc = self.emit("add" if coef > 0 else "sub", acc, value)
        return acc


def _scaled(terms: List[Term], c: float) -> List[Term]:
    return [(c * coef, f, a) for coef, f, a in terms]


def _merged(terms: List[Term]) -> List[Term]:
    """Like terms added up (zero sums dropped), in a canonical order."""
    total: Dict[Tuple[Tuple[str, ...], str], float] = {}
    for coef, factors, atom in terms:
        total[factors, atom] = total.get((factors, atom), 0.0) + coef
    return sorted((c, f, a) for (f, a), c in total.items() if c != 0.0)


def hoist(lines: Sequence[str], result: str, shapes: Dict[str, Tuple[int, int, int, int]]
          ) -> Tuple[List[str], str, Tuple[Term, ...]]:
    """(lines, result token, row terms) of a forward program computing `result` minus
    its row terms; the lines hold the old instructions too (prune them after). No
    terms: nothing was hoisted."""
    h = _Hoister(lines, shapes)
    new_result, row = h.hoist(result)
    return h.lines, new_result, row


def describe(terms: Sequence[Term]) -> str:
    """The row terms as text (for plans and tests)."""
    def one(t: Term) -> str:
        coef, factors, atom = t
        parts = [repr(coef)] + list(factors) + ([] if atom == "1" else [atom])
        return "*".join(parts)
    return " + ".join(one(t) for t in terms)


def tokens(lines: Sequence[str]) -> List[str]:
    """Every operand token of a program."""
    return [a for _, args in parse_lines(lines) for a in args]


def rename_inputs(lines: Sequence[str], mapping: Dict[str, str]) -> List[str]:
    """The program with static input tokens renamed (``aN`` -> mapping[``aN``])."""
    return [f"{op}:{','.join(mapping.get(a, a) for a in args)}" for op, args in parse_lines(lines)]


def unused_inputs(first: int, count: int, *programs: Sequence[str]) -> Optional[List[int]]:
    """Indices (from `first`) of the `count` inputs no program reads (None: all read)."""
    read = {t for p in programs for t in tokens(p)}
    unused = [i for i in range(first, first + count) if f"a{i}" not in read]
    return unused or None
