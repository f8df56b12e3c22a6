"""Differential fuzzing of the flex lowering on CPU (tests/flex_fuzz.py draws the
programs): each program's lowered forward scores and bprop dS, run by the NumPy
interpreter, against the function itself (JAX, float64) under plain, causal,
window, padding and GQA calls. Every program ends matched, or refused with the
reason explain() would give; a mismatch or any other error fails.

FUSEDATTN_FUZZ_COUNT sets the fixed-seed count (default 2000); FUSEDATTN_FUZZ_SEED
the seed. `FUSEDATTN_FUZZ_HYPOTHESIS=1` also runs a hypothesis profile that draws
seeds for longer local runs (FUSEDATTN_FUZZ_EXAMPLES, default 500)."""
from __future__ import annotations

import collections
import os

import numpy as np
import pytest

from support import flex_fuzz as ff

COUNT = int(os.environ.get("FUSEDATTN_FUZZ_COUNT", "2000"))
SEED = int(os.environ.get("FUSEDATTN_FUZZ_SEED", "0"))


def _one(program: ff.Program, seed: int, counts: collections.Counter, failures: list) -> None:
    try:
        state, detail = ff.check_cpu(program, seed)
    except Exception as e:  # a crash of the lowering or its evaluation is a failure
        state, detail = "error", f"{type(e).__name__}: {e}"
    if state == "refused":
        config, _ = ff.build(program, ff.arg_values(np.random.default_rng(seed)))
        reason = ff.cudnn_flex.reason(config)  # what explain() shows for cuDNN
        if not reason or "cannot be lowered" not in reason:
            state, detail = "error", f"refused without the reason in explain(): {reason!r}"
        elif program.refuse and program.refuse not in detail:
            state, detail = "error", f"refused for another reason than {program.refuse!r}: {detail}"
        counts["refused: " + _category(detail)] += 1
    elif program.refuse:
        counts["lowered although drawn as refused"] += 1
    counts[state] += 1
    if state in ("mismatch", "error"):
        failures.append(f"{state}: {program.describe()}: {detail[:400]}")


def _category(reason: str) -> str:
    """A refusal's kind: the primitive its reason names."""
    for word in reason.replace("(", " ").replace(")", " ").split():
        if word.startswith("'") and word.endswith("'"):
            return word.strip("'")
    return reason[:40]


def test_fuzzed_programs_match_or_are_refused():
    counts, failures = collections.Counter(), []
    for program in ff.draw(COUNT, seed=SEED):
        _one(program, SEED * 100003 + program.index, counts, failures)
    print(dict(counts))
    assert counts["match"] + counts["refused"] == COUNT, (dict(counts), failures[:10])
    assert counts["match"] > 0.9 * COUNT, dict(counts)  # refusals stay the rare case


@pytest.mark.skipif(os.environ.get("FUSEDATTN_FUZZ_HYPOTHESIS") != "1",
                    reason="long run: FUSEDATTN_FUZZ_HYPOTHESIS=1")
def test_fuzzed_programs_hypothesis_profile():
    from hypothesis import given, settings, strategies as st  # noqa: PLC0415

    @settings(max_examples=int(os.environ.get("FUSEDATTN_FUZZ_EXAMPLES", "500")),
              deadline=None, derandomize=False)
    @given(st.integers(0, 2 ** 31 - 1), st.integers(0, 10 ** 6))
    def run(seed, index):
        program = ff.draw(index % 50 + 1, seed=seed)[-1]
        counts, failures = collections.Counter(), []
        _one(program, seed, counts, failures)
        assert not failures, failures
    run()
