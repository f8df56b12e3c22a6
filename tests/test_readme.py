"""Every ```python block of README.md runs as written, in order, in one fresh Python
process (as a user pasting them into one session would) on the CPU, with the 8 host
devices the multi-device blocks ask for."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNNER = """
import sys, time
blocks = {blocks!r}
env = {{}}
for i, (line, code) in enumerate(blocks):
    start = time.perf_counter()
    try:
        exec(compile(code, f"README.md block at line {{line}}", "exec"), env)
    except Exception:
        print(f"README.md block at line {{line}} failed:", file=sys.stderr)
        raise
    print(f"block at line {{line}}: {{time.perf_counter() - start:.1f}} s")
"""


def python_blocks(text: str):
    """(line, code) of each ```python block."""
    blocks = []
    for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M):
        blocks.append((text[:m.start()].count("\n") + 1, m.group(1)))
    return blocks


def test_readme_python_blocks_run():
    blocks = python_blocks((ROOT / "README.md").read_text())
    assert len(blocks) >= 5
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu", FUSEDATTN_BACKEND="",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    env.pop("FUSEDATTN_BACKEND")
    run = subprocess.run([sys.executable, "-c", RUNNER.format(blocks=blocks)], env=env,
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    print(run.stdout)
