"""A NumPy interpreter of the programs `fusedattn.flex_lowering` makes: what the cuDNN
graph computes, in float64, so CPU tests check a lowering against the JAX function
itself (csrc/cuda/cudnn_flex.h has the grammar)."""
from __future__ import annotations

import math
from typing import List

import numpy as np

_NP = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide,
       "max": np.maximum, "min": np.minimum, "pow": np.power, "mod": np.fmod,
       "neg": np.negative, "abs": np.abs, "exp": np.exp, "log": np.log, "tanh": np.tanh,
       "sigmoid": lambda x: 1.0 / (1.0 + np.exp(-x)), "sqrt": np.sqrt,
       "rsqrt": lambda x: 1.0 / np.sqrt(x), "sin": np.sin, "cos": np.cos, "tan": np.tan,
       "floor": np.floor, "ceil": np.ceil, "recip": lambda x: 1.0 / x, "id": lambda x: x,
       "eq": np.equal, "ne": np.not_equal, "gt": np.greater, "ge": np.greater_equal,
       "lt": np.less, "le": np.less_equal, "and": np.logical_and, "or": np.logical_or,
       "not": np.logical_not, "sel": lambda c, a, b: np.where(c, a, b),
       "tanh_bwd": lambda dy, x: dy * (1.0 - np.tanh(x) ** 2),
       "sigmoid_bwd": lambda dy, x: dy * np.exp(-x) / (1.0 + np.exp(-x)) ** 2,
       "div.i": lambda a, b: np.trunc(a / b)}


def interpret(program: str, score, q_idx, kv_idx, inputs, grad=None, forward: str = "") -> np.ndarray:
    """Runs a program with NumPy (float64): what the cuDNN graph computes, for tests.
    A bprop's `forward` program is run first for its values (wN)."""
    fwd_values = _run_values(forward, score, q_idx, kv_idx, inputs, None, []) if forward else []
    values = _run_values(program, score, q_idx, kv_idx, inputs, grad, fwd_values)
    return np.asarray(values[-1] if values else score, np.float64)


def _run_values(program, score, q_idx, kv_idx, inputs, grad, fwd_values):
    ops = dict(_NP, erf=np.vectorize(math.erf))
    values: List[np.ndarray] = []
    named = {"s": score, "q": q_idx, "k": kv_idx, "g": grad}

    def operand(t: str):
        if t in named:
            return np.asarray(named[t], np.float64)
        if t[0] == "c":
            return np.float64(float(t[1:]))
        if t[0] == "w":
            return fwd_values[int(t[1:])]
        return values[int(t[1:])] if t[0] == "v" else np.asarray(inputs[int(t[1:])], np.float64)
    with np.errstate(all="ignore"):
        for line in program.split("|") if program else []:
            op, args = line.split(":")
            # int32 ops (".i") compute the same values here: indices and offsets are
            # small integers, exact in float64 (division truncates, as int32's does).
            values.append(ops.get(op, ops[op.split(".")[0]])(*(operand(t) for t in args.split(","))))
    return values
