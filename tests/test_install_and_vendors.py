"""The README's two set-up commands are the ones CI runs; the vendor extras' code paths
that need no GPU answer with a line instead of an ImportError; a ROCm build for other
gfx architectures is a reason, not a launch failure."""
from __future__ import annotations

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_readme_commands_are_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Install and test: two commands", 1)[1].split("```bash", 1)[1]
    commands = [line.split("#")[0].strip() for line in block.split("```", 1)[0].splitlines()
                if line.strip()]
    assert commands == ['pip install ".[test]"', "python -m pytest -q -n auto --dist loadfile"], \
        commands
    ci = (ROOT / "ci" / "cpu.sh").read_text()
    assert re.search(r'pip install -q "\.\[test\]"', ci)
    assert "python3 -m pytest -q -n auto --dist loadfile" in ci


def test_info_without_vendor_packages_says_so():
    out = subprocess.run([sys.executable, "-m", "fusedattn", "info"], capture_output=True,
                         text=True, timeout=300, env={"FUSEDATTN_PLATFORM": "cpu",
                                                     "PATH": "/usr/bin:/bin",
                                                     "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr
    try:
        import cupy  # noqa: F401
    except ImportError:
        assert "cupy           not installed (pip install 'fusedattn[cuda]'" in out.stdout
    try:
        from hip import hip  # noqa: F401
    except ImportError:
        assert "hip-python     not installed (pip install 'fusedattn[rocm]'" in out.stdout


def test_rocm_extension_built_for_other_architectures_is_a_reason(monkeypatch):
    """With hip-python reporting a gfx the extension was not built for, the ROCm
    extension counts as unavailable and says why (small_seq and ck then give that
    reason), rather than failing at the first kernel launch."""
    import types

    from fusedattn import vendor as vendor_info
    from fusedattn.backends import extension as native
    module = types.SimpleNamespace(hip_architectures="gfx90a;gfx942")
    monkeypatch.setattr(vendor_info, "rocm_archs", lambda: ["gfx1100"])
    why = native.architecture_reason(module)
    assert "built for gfx90a;gfx942, not this GPU's gfx1100" in why
    monkeypatch.setattr(vendor_info, "rocm_archs", lambda: ["gfx942:sramecc+:xnack-"])
    assert native.architecture_reason(module) is None
    monkeypatch.setattr(vendor_info, "rocm_archs", lambda: None)  # hip-python absent
    assert native.architecture_reason(module) is None
