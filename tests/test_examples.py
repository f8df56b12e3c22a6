"""The examples a user copies run on the CPU, each in a fresh process with tiny settings."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CASES = {
    "flax_gpt.py": ["--steps", "30", "--seq", "32", "--dim", "32", "--layers", "1",
                    "--plot", ""],
    "small_seq_serving.py": ["--batches", "2", "--max-batch", "200"],
    "context_parallel.py": ["--seq", "64"],
}


@pytest.mark.parametrize("script", sorted(CASES))
def test_example_runs_on_cpu(script):
    pytest.importorskip("flax")
    pytest.importorskip("optax")
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    env.pop("XLA_FLAGS", None)  # context_parallel.py asks for its own 8 devices
    run = subprocess.run([sys.executable, str(ROOT / "examples" / script), *CASES[script]],
                         env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    if script == "flax_gpt.py":  # fusedattn trains like Flax's default
        lines = {line.split()[0]: line for line in run.stdout.splitlines() if "ms/step" in line}
        assert "fusedattn" in lines and "flax" in lines, run.stdout
