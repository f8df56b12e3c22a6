"""b1 s16384 h8 d64 forward+backward on the CPU without a dense score matrix.

The work runs in a child process (benchmarks/long_sequence.py) that measures
its own peak resident memory (Linux VmHWM, reset after compilation; ru_maxrss
where that is unavailable). It must stay far below the 8 GiB that the fp32
scores of one dense ``[1, 8, 16384, 16384]`` matrix would take: we allow 2 GiB,
JAX runtime, inputs and outputs included (measured: about 0.8 GiB). About 15-30 s
on 2 cores.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "long_sequence.py")


@pytest.mark.slow
def test_long_sequence_fwd_bwd_memory_and_values():
    result = subprocess.run([sys.executable, SCRIPT, "--seq", "16384", "--heads", "8", "--dim", "64"],
                            capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    dense = report["dense_fp32_scores_bytes"]
    assert dense == 8 * 16384 * 16384 * 4
    assert report["peak_rss_bytes"] < 2 * 1024 ** 3 <= dense / 4, report
    checks = report["checks"]
    assert checks["finite"]
    assert checks["rows_out_rel_error"] < 1e-4, checks
    assert checks["rows_dq_rel_error"] < 1e-4, checks
    assert checks["dv_sum_rel_error"] < 1e-4, checks
    assert checks["dk_sum_over_abs"] < 1e-3, checks
