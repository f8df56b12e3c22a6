"""fusedattn: fused attention for JAX on NVIDIA and AMD GPUs, with a portable XLA backend."""
import importlib
from . import fp8, score_mods
from .api import explain, fused_attn
from .config import AttnConfig
from .context_parallel import ContextParallel
from .dispatch import Plan, UnsupportedError
from .jax_nn import dot_product_attention
from .sequence import SequenceDescriptor
from .small_seq_api import fused_attn_small_seq

__all__ = ["fused_attn", "fused_attn_small_seq", "dot_product_attention", "explain", "AttnConfig",
           "ContextParallel", "Plan", "SequenceDescriptor", "UnsupportedError", "fp8", "score_mods"]
__version__ = "0.1.0"


def __getattr__(name):
    # `fusedattn.flax` after a plain `import fusedattn`, loaded on first use: flax is an
    # optional dependency, so the package does not import it up front.
    if name == "flax":
        return importlib.import_module(".flax", __name__)
    raise AttributeError(f"module 'fusedattn' has no attribute {name!r}")

