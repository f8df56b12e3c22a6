"""What the cudnn backend can run: the graph key a config builds, the reasons it
refuses from the config alone, cuDNN version gates, and the probe that asks the C++ side
to build the graphs (so an unsupported config gets cudnn-frontend's own message)."""
from __future__ import annotations

from typing import Optional

from ... import fp8_scaling
from ...config import AttnConfig
from ...score_mods import Alibi
from .. import extension, native_op
from . import flex, graphs
from .graphs import Probe

from ...inputs import AttnInputs

TARGET_FWD = "fusedattn_cudnn_fwd"
TARGET_BWD = "fusedattn_cudnn_bwd"
# The same handlers without the command-buffer trait, for graphs whose execute
# copies from host memory (ALiBi slopes): XLA never captures them.
TARGET_FWD_NOCMDBUF = "fusedattn_cudnn_fwd_nocmdbuf"
TARGET_BWD_NOCMDBUF = "fusedattn_cudnn_bwd_nocmdbuf"
# FP8 graphs (fp8.py) copy nothing from the host: command-buffer safe.
TARGET_FP8_FWD = "fusedattn_cudnn_fp8_fwd"
TARGET_FP8_BWD = "fusedattn_cudnn_fp8_bwd"
TARGETS = (TARGET_FWD, TARGET_BWD, TARGET_FWD_NOCMDBUF, TARGET_BWD_NOCMDBUF, TARGET_FP8_FWD,
           TARGET_FP8_BWD)
DTYPES = ("bfloat16", "float16")
_INT32_MAX = 2**31 - 1

# cuDNN version gates that cudnn-frontend does not enforce itself, in one place:
# (predicate on the config, minimum runtime cuDNN version, what needs it).
VERSION_GATES = (
    (lambda c: c.softmax != "vanilla", 91300,
     "off-by-one / learnable softmax (cuDNN sink tokens)"),
)

_CODES = {
    "layout": {"bshd": 0, "sbhd": 1},
    "qkv_packing": {"separate": 0, "qkv": 1, "kv": 2},
    "mask": {"none": 0, "causal": 1, "causal_bottom_right": 2},
    "softmax": {"vanilla": 0, "off_by_one": 1, "learnable": 2},
    "sequence": {"dense": 0, "padding": 1, "packed": 2},
}


def graph_key(config: AttnConfig) -> str:
    """The string that names this config's graphs (parsed by csrc/cuda/cudnn_params.h)."""
    left, right = config.window_bounds() if (config.window is not None or config.causal) \
        else (-1, -1)
    bias = config.bias_shape or (0, 0, 0, 0)
    fields = (
        ("b", config.batch), ("sq", config.s_q), ("skv", config.s_kv),
        ("hq", config.h_q), ("hkv", config.h_kv), ("dqk", config.d_qk), ("dv", config.d_v),
        ("bf16", int(config.dtype == "bfloat16")),
        ("layout", _CODES["layout"][config.layout]),
        ("packing", _CODES["qkv_packing"][config.qkv_packing]),
        ("mask", _CODES["mask"][config.mask]),
        ("wl", left), ("wr", right),
        ("bias_b", bias[0]), ("bias_h", bias[1]), ("bias_sq", bias[2]), ("bias_skv", bias[3]),
        ("scale", repr(float(config.scale))),
        ("softmax", _CODES["softmax"][config.softmax]),
        ("dropout", repr(float(config.dropout))),
        ("seq", _CODES["sequence"][config.sequence]),
        ("segs", config.max_segments if config.is_packed else 1),
        ("det", int(config.deterministic)),
        ("alibi", int(flex.uses_cudnn_alibi(config))),
        ("fp8", int(config.is_fp8)),
        ("fp8_do", int(config.is_fp8 and config.fp8_do == "e5m2")),
        ("fp8_grad", int(config.is_fp8 and config.fp8_grad == "e5m2")),
        ("flex", ""), ("flexb", ""), ("flexin", ""),
    )
    if flex.is_flex(config):  # the programs hold the masks: none for cuDNN
        overrides = flex.key_fields(config)
        fields = tuple((name, overrides.get(name, value)) for name, value in fields)
    return ";".join(f"{name}={value}" for name, value in fields)


def config_reason(config: AttnConfig) -> Optional[str]:
    """What this backend cannot do, decided from the config alone (None: ask cuDNN)."""
    if config.dtype not in DTYPES:
        return f"dtype {config.dtype}: cuDNN fused attention here is {'/'.join(DTYPES)} only"
    if config.is_fp8:
        why = fp8_scaling.config_reason(config)
        if why is not None:
            return why
    why = score_mod_reason(config)
    if why is not None:
        return why
    if config.sequence not in _CODES["sequence"]:
        return f"sequence kind {config.sequence!r} is served by the small_seq backend"
    if config.is_packed and config.layout != "bshd":
        return "packed (THD) sequences need the bshd layout (cuDNN ragged offsets address rows)"
    if config.is_packed and config.has_bias:
        return "bias with packed (THD) sequences is not supported by cuDNN's ragged layout"
    if config.is_packed:
        width = (3 if config.qkv_packing == "qkv" else 2 if config.qkv_packing == "kv" else 1) \
            * max(config.h_q, config.h_kv) * max(config.d_qk, config.d_v)
        if config.batch * max(config.s_q, config.s_kv) * width > _INT32_MAX:
            return "packed tensors beyond 2^31 elements (int32 ragged offsets)"
    if config.mask != "none" and config.window is not None and config.window[1] not in (0, -1):
        return f"window right side {config.window[1]} with a causal mask"
    return None


def score_mod_reason(config: AttnConfig) -> Optional[str]:
    """Why cuDNN cannot run this config's score_mod (None: no score_mod, or one it runs)."""
    if config.score_mod is None:
        return None
    lowered = flex.reason(config)
    if lowered is None or not isinstance(config.score_mod, Alibi):
        return lowered
    dedicated = flex.alibi_reason(config)
    return None if dedicated is None else f"{lowered}; and cuDNN's own ALiBi: {dedicated}"


def version_reason(config: AttnConfig, cudnn_version: Optional[int]) -> Optional[str]:
    """The first VERSION_GATES entry the runtime cuDNN fails for this config."""
    if cudnn_version is None:
        return None
    for needs, minimum, what in VERSION_GATES:
        if needs(config) and cudnn_version < minimum:
            return (f"{what} needs cuDNN >= {minimum // 10000}.{minimum % 10000 // 100}, "
                    f"runtime is {cudnn_version}")
    return None


def probe(config: AttnConfig) -> Probe:
    """Build (or find) the config's three cuDNN graphs, concurrently; cached per key."""
    return graphs.probe(graph_key(config), TARGETS)



def graphs_config(config: AttnConfig) -> AttnConfig:
    """The config whose graphs run `config`: one batch entry's where it runs per entry."""
    return native_op.entry_config(config) if flex.per_entry(config) else config


def supports(config: AttnConfig) -> Optional[str]:
    """None when cuDNN runs `config` (its graphs build), else the reason."""
    why = config_reason(config)
    if why is None and graphs.assumed() is None:
        why = extension.reason("cuda") or version_reason(config, extension.cudnn_version())
    if why is None:
        result = probe(graphs_config(config))
        why = None if result.ok else f"cuDNN: {result.message}"
        if why is not None and flex.is_flex(config):
            why = (f"cuDNN: the score_mod lowered to pointwise operations has no engine on "
                   f"this GPU / cuDNN (tests/gpu/test_flex_gpu.py lists what runs): "
                   f"{result.message}")
    return why


def register_targets():
    """FFI targets on first use; on a host without the extension (lowering only) a no-op."""
    if extension.gpu_platform() == "cuda":
        extension.ensure_targets(TARGETS, "cuda")
