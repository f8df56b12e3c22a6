"""cudnn-frontend's own validation of the graphs we build, without a GPU.

The compiled CUDA extension's `cudnn_validate_graphs(key, sm_version)` builds the
three graphs of a config key exactly as the handlers do (csrc/cuda/cudnn_graph.cc,
`make_graph`) and runs only the frontend's validation for that architecture: its
support-surface checks, nothing that needs a device. So on a CPU machine this
checks that the built-in score_mods are wired the way the frontend accepts (as
lowered programs, and ALiBi through cuDNN's ALiBi mask where no program runs), and
that the configs `backends/cudnn.py` refuses for frontend reasons are refused by
the frontend too. It cannot show that cuDNN then finds an engine, nor the numbers
(tests/gpu/test_cudnn.py does, on a GPU).

The extension comes from an installed build (`fusedattn._cuda`) or from the tree
that `ci/compile_cuda.sh` builds (build/compile-cuda), or FUSEDATTN_CUDA_EXTENSION
(a path to the .so); without one the tests skip, saying so.
"""
from __future__ import annotations

import dataclasses
import glob
import importlib
import importlib.util
import os

import pytest

from fusedattn import score_mods
from fusedattn.backends import cudnn
from fusedattn.config import AttnConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SM_VERSIONS = (90, 100)  # Hopper, Blackwell


def _load_extension():
    """(module, None) or (None, why not)."""
    import jax
    jax.devices()  # as fusedattn does: the platform's libraries load before ours
    candidates = [os.environ.get("FUSEDATTN_CUDA_EXTENSION")]
    candidates += sorted(glob.glob(os.path.join(ROOT, "build", "compile-cuda", "_cuda*.so")))
    tried = []
    try:
        module = importlib.import_module("fusedattn._cuda")
        if hasattr(module, "cudnn_validate_graphs"):
            return module, None
        tried.append("fusedattn._cuda (built before cudnn_validate_graphs existed)")
    except Exception as e:
        tried.append(f"fusedattn._cuda ({type(e).__name__}: {e})")
    for path in filter(None, candidates):
        try:
            spec = importlib.util.spec_from_file_location("_cuda", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        except Exception as e:
            tried.append(f"{path} ({type(e).__name__}: {e})")
            continue
        if hasattr(module, "cudnn_validate_graphs"):
            return module, None
        tried.append(f"{path} (built before cudnn_validate_graphs existed)")
    return None, "no compiled CUDA extension to load (run ci/compile_cuda.sh): " + "; ".join(tried)


EXT, WHY_NOT = _load_extension()
pytestmark = pytest.mark.skipif(EXT is None, reason=str(WHY_NOT))

BASE = AttnConfig(batch=2, s_q=128, s_kv=128, h_q=4, h_kv=4, d_qk=64, d_v=64, dtype="bfloat16",
                  scale=0.125)
ALIBI = score_mods.alibi(4)
SOFTCAP = score_mods.softcap(20.0)

ACCEPTED = {
    "plain": {},
    "causal-padding": dict(mask="causal", sequence="padding"),
    "alibi-causal": dict(mask="causal", score_mod=ALIBI),
    "alibi-causal-padding": dict(mask="causal", sequence="padding", score_mod=ALIBI),
    "alibi-causal-packed": dict(mask="causal", sequence="packed", max_segments=3, score_mod=ALIBI),
    "alibi-gqa-8/2-d128": dict(mask="causal", h_q=8, h_kv=2, d_qk=128, d_v=128,
                               score_mod=score_mods.alibi(8)),
    "alibi-bias-dropout": dict(mask="causal", bias_shape=(1, 4, 128, 128), dropout=0.1,
                               score_mod=ALIBI),
    "alibi-window-only": dict(window=(32, 0), score_mod=ALIBI),
    "alibi-no-mask": dict(score_mod=ALIBI),
    "alibi-bottom-right-gqa": dict(mask="causal_bottom_right", h_kv=2, score_mod=ALIBI),
    "softcap": dict(score_mod=SOFTCAP),
    "softcap-causal": dict(mask="causal", score_mod=SOFTCAP),
    "softcap-window": dict(window=(16, 16), score_mod=SOFTCAP),
    "softcap-gqa-fp16-d128": dict(h_q=8, h_kv=2, d_qk=128, d_v=128, dtype="float16",
                                  score_mod=SOFTCAP),
    "softcap-learnable-sq<skv": dict(softmax="learnable", s_q=64, score_mod=SOFTCAP),
}

# cuDNN's own ALiBi (`cudnn_flex.alibi_reason`) refuses these because the frontend
# does; the frontend must agree. (With padding lengths: the lowered program runs
# instead, one batch entry at a time.)
REFUSED = {
    "alibi-no-mask": (dict(sequence="padding"), "right_bound needs to be set to 0"),
    "alibi-bottom-right": (dict(mask="causal_bottom_right", sequence="padding"),
                           "is_alibi=False"),
}


@pytest.mark.parametrize("sm", SM_VERSIONS)
@pytest.mark.parametrize("name", list(ACCEPTED))
def test_frontend_accepts_our_graphs(name, sm):
    cfg = dataclasses.replace(BASE, **ACCEPTED[name])
    assert cudnn.config_reason(cfg) is None
    messages = EXT.cudnn_validate_graphs(cudnn.graph_key(cfg), sm)
    assert set(messages) == set(cudnn.GRAPHS)
    assert all(m == "" for m in messages.values()), messages


@pytest.mark.parametrize("sm", SM_VERSIONS)
@pytest.mark.parametrize("name", list(REFUSED))
def test_frontend_refuses_what_we_refuse(name, sm):
    change, fragment = REFUSED[name]
    cfg = dataclasses.replace(BASE, score_mod=ALIBI, **change)
    assert cudnn.flex.alibi_reason(cfg) is not None and cudnn.flex.per_entry(cfg)
    # the key cuDNN's ALiBi would have: the config's without the score_mod, alibi=1
    key = cudnn.graph_key(dataclasses.replace(cfg, score_mod=None)).replace("alibi=0", "alibi=1")
    messages = EXT.cudnn_validate_graphs(key, sm)
    for graph, message in messages.items():
        assert fragment in message, (graph, message)


def test_a_malformed_key_is_reported_not_raised():
    messages = EXT.cudnn_validate_graphs("b=1;sq=2", 90)
    assert all("lacks" in m for m in messages.values()), messages


# ---- FP8 graphs (csrc/cuda/cudnn_fp8_graph.cc) -------------------------------------------
FP8 = dataclasses.replace(BASE, d_qk=128, d_v=128, precision="fp8")

# config change -> per graph: "" (valid) or a fragment of the frontend's refusal, on sm90.
FP8_ON_HOPPER = {
    "d128": ({}, {}),
    "d128-causal-padding-gqa": (dict(mask="causal", sequence="padding", h_kv=2), {}),
    "d128-e4m3-grads": (dict(fp8_do="e4m3", fp8_grad="e4m3"), {}),
    "d64": (dict(d_qk=64, d_v=64), {"backward": "hidden_dim shoud be equal to 128"}),
    "d256": (dict(d_qk=256, d_v=256), {"backward": "hidden_dim shoud be equal to 128"}),
    "causal-bottom-right": (dict(mask="causal_bottom_right"),
                            {g: "Blackwell" for g in cudnn.GRAPHS}),
}


@pytest.mark.parametrize("name", list(FP8_ON_HOPPER))
def test_frontend_fp8_graphs_on_hopper(name):
    change, refused = FP8_ON_HOPPER[name]
    cfg = dataclasses.replace(FP8, **change)
    assert cudnn.config_reason(cfg) is None
    messages = EXT.cudnn_validate_graphs(cudnn.graph_key(cfg), 90)
    for graph, message in messages.items():
        if graph in refused:
            assert refused[graph] in message, (graph, message)
        else:
            assert message == "", (graph, message)


# ---- lowered score_mods (csrc/cuda/cudnn_flex.cc) ------------------------------------------
def _flex_config(name, **change):
    import jax
    import jax.numpy as jnp

    from support import flex_cases
    from fusedattn.validation import build_call
    mod, mask_mod, args, _ = flex_cases.MODS[name]
    h_kv = change.pop("h_kv", 4)
    q = jax.ShapeDtypeStruct((2, 128, 4, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 128, h_kv, 64), jnp.bfloat16)
    return build_call(q, kv, kv, score_mod=mod, mask_mod=mask_mod,
                      score_mod_args=args(4, 2, 128), **change)[0]


@pytest.mark.parametrize("variant", ["plain", "causal-gqa", "padding"])
@pytest.mark.parametrize("name", ["relative_position", "softcap_scaled", "alibi_lambda",
                                  "sigmoid_gate", "log_distance", "prefix_lm", "strided"])
def test_frontend_accepts_lowered_score_mods(name, variant):
    import jax.numpy as jnp

    from fusedattn import SequenceDescriptor
    change = {"plain": {}, "causal-gqa": dict(mask="causal", h_kv=2),
              "padding": dict(sequence=SequenceDescriptor.from_lengths(
                  jnp.array([128, 50]), jnp.array([70, 128])))}[variant]
    cfg = _flex_config(name, **change)
    why = cudnn.config_reason(cfg)
    assert why is None, why
    # lengths are per-batch tensors, which cuDNN 9.19 misreads: one entry at a time
    assert cudnn.flex.per_entry(cfg) == (variant == "padding")
    messages = EXT.cudnn_validate_graphs(cudnn.graph_key(cudnn.support.graphs_config(cfg)), 90)
    assert all(m == "" for m in messages.values()), messages
