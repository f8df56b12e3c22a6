"""`AttnConfig`: every static setting of one attention call.

It is the only object that crosses layers: the API builds it (once, in
`validation.build_call`), dispatch asks each backend `supports(config)`, and the
chosen backend reads it. It is frozen and hashable so it can key caches (the
cuDNN graph cache, jit's static arguments, the dispatch log).

Conventions every backend follows (the float64 oracle in tests/oracle.py is
the reference for all of them):

* Logits: ``s = scale * q.k`` (+ ``bias``) then ``score_mod(s, b, h, i, j, *args)``,
  then masking, then softmax over keys, dropout on the probabilities, times v.
* Positions ``i``/``j`` are positions inside the sequence (for packed rows:
  inside the segment). ``len_q``/``len_kv`` are the true per-sequence lengths.
* ``mask="causal"``: key j visible to query i when ``j <= i``.
  ``mask="causal_bottom_right"``: when ``j <= i + (len_kv - len_q)``.
* ``window=(left, right)`` narrows that band: ``i + o - left <= j <= i + o + right``
  with ``o = len_kv - len_q`` for bottom-right alignment and ``0`` otherwise;
  ``-1`` means unbounded on that side. Causal masks require ``right == 0``.
* ``softmax="off_by_one"`` adds a sink logit of 0 to every row's normaliser;
  ``"learnable"`` adds a per-head sink logit ``softmax_offset[h]``.
* Rows with no visible key produce 0 (never NaN); padded query positions
  produce exactly 0.
* A dense boolean mask (``dense_mask_shape``, the drop-ins' ``mask``) hides the pairs
  it marks False. Backends that take no such mask get it as the bias term
  ``-0.7 * finfo(dtype).max`` (`mask_as_bias`), jax.nn's own constant. A row it
  hides entirely then gives no 0 (the constant shifts all its keys alike); the
  drop-ins, which define such rows, overwrite them on both routes, or ask a backend
  that writes jax.nn's rows itself (``unseen_rows="mean"``: block_sparse) to do so.
* The saved statistic is fp32 log-sum-exp ``[b, h_q, s_q]`` (sink included).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Tuple

MASKS = ("none", "causal", "causal_bottom_right")
SOFTMAX_TYPES = ("vanilla", "off_by_one", "learnable")
LAYOUTS = ("bshd", "sbhd")
# How q, k, v arrive: separately, as one packed [.., 3, h, d] tensor, or q plus a
# packed [.., 2, h, d] kv tensor. Packing is orthogonal to bshd / sbhd.
QKV_PACKINGS = ("separate", "qkv", "kv")
# "ragged": small-seq packed keys (k, v [total_kv_tokens, h, d] addressed by kv
# offsets [b + 1], one query per sequence); only the small_seq backend reads it.
SEQUENCE_KINDS = ("dense", "padding", "packed", "ragged")
DTYPES = ("bfloat16", "float16", "float32")
# "fp8": q, k, v (and o) run through FP8 E4M3 kernels with per-tensor scales
# (fusedattn.fp8); dtype stays the high-precision dtype of the unquantized tensors.
PRECISIONS = ("default", "fp8")
FP8_FORMATS = ("e4m3", "e5m2")


@dataclasses.dataclass(frozen=True)
class AttnConfig:
    # Shapes (after unpacking; in logical bshd order whatever the layout).
    batch: int
    s_q: int
    s_kv: int
    h_q: int
    h_kv: int
    d_qk: int
    d_v: int
    dtype: str
    layout: str = "bshd"
    qkv_packing: str = "separate"
    # Masking and scores.
    mask: str = "none"
    window: Optional[Tuple[int, int]] = None
    # Bias shape as given, 4-d, with 1 on broadcast dimensions; None for no bias.
    bias_shape: Optional[Tuple[int, int, int, int]] = None
    # A dense boolean mask (the drop-ins' `mask`, True: visible): its shape
    # [1|b, 1|h_q, s_q, s_kv]; None for none. Backends that take it read it as a mask
    # (block_sparse: a map built on the device); dispatch gives every other backend the
    # config of `mask_as_bias` and the mask as an additive bias. Left out of repr: the
    # persistent cache keys measured choices by repr, and what is measured never holds one.
    dense_mask_shape: Optional[Tuple[int, int, int, int]] = dataclasses.field(
        default=None, repr=False)
    scale: float = 1.0
    softmax: str = "vanilla"
    dropout: float = 0.0
    # Sequence structure: dense (all tokens valid), padding (per-sequence
    # lengths), packed (several segments per row, at most max_segments),
    # ragged (small-seq packed keys; s_kv is then the bound on keys per sequence).
    sequence: str = "dense"
    max_segments: int = 1
    # Packed: the kv segments are the query segments (`SequenceDescriptor.shared_segments`).
    shared_segments: bool = False
    # score_mod is compared with ==: a function by identity, a built-in score_mod
    # (fusedattn.score_mods: frozen dataclasses) by value; its extra arguments by
    # shape/dtype.
    score_mod: Optional[Callable] = dataclasses.field(default=None, compare=True)
    score_mod_arg_specs: Tuple[Tuple[Tuple[int, ...], str], ...] = ()
    deterministic: bool = False
    precision: str = "default"
    # What a (real) query row that sees no key gives: "zero" (the rule above), or
    # "mean", jax.nn's: the mean of all values. Only the drop-ins ask for "mean", and
    # only of a backend that writes it in its kernels (`averages_unseen_rows`). Left out
    # of repr as dense_mask_shape is: measured backends never take "mean".
    unseen_rows: str = dataclasses.field(default="zero", repr=False)
    # FP8 only: the formats of d_out and of the gradients dq, dk, dv (q, k, v and o
    # are always E4M3), and whether the output stays FP8 (fusedattn.fp8.attention).
    fp8_do: str = "e5m2"
    fp8_grad: str = "e5m2"
    fp8_out: bool = False
    # Which public entry point made the config ("fused_attn" or "small_seq").
    api: str = "fused_attn"

    # ---- derived facts backends ask about -------------------------------
    @property
    def has_bias(self) -> bool:
        return self.bias_shape is not None

    @property
    def has_dense_mask(self) -> bool:
        return self.dense_mask_shape is not None

    def mask_as_bias(self) -> "AttnConfig":
        """This config with its dense mask folded into the bias (`inputs.mask_as_bias`
        makes the matching arrays): what backends that take no dense mask run."""
        if not self.has_dense_mask:
            return self
        shape = self.dense_mask_shape
        if self.has_bias:
            shape = tuple(max(a, b) for a, b in zip(shape, self.bias_shape))
        return dataclasses.replace(self, bias_shape=shape, dense_mask_shape=None)

    @property
    def causal(self) -> bool:
        return self.mask != "none"

    @property
    def bottom_right(self) -> bool:
        return self.mask == "causal_bottom_right"

    @property
    def is_fp8(self) -> bool:
        return self.precision == "fp8"

    @property
    def has_dropout(self) -> bool:
        return self.dropout > 0.0

    @property
    def group_size(self) -> int:
        """Query heads per kv head (1 for MHA, h_q for MQA)."""
        return self.h_q // self.h_kv

    @property
    def is_padded(self) -> bool:
        return self.sequence == "padding"

    @property
    def is_packed(self) -> bool:
        return self.sequence == "packed"

    def window_bounds(self) -> Tuple[int, int]:
        """(left, right) with -1 = unbounded; causal masks force right = 0."""
        left, right = self.window if self.window is not None else (-1, -1)
        if self.causal:
            right = 0
        return left, right

    def flops(self, backward: bool = False) -> float:
        """Matmul FLOPs, halved for causal masks (the convention FA/cuDNN use)."""
        f = 2.0 * self.batch * self.h_q * self.s_q * self.s_kv * (self.d_qk + self.d_v)
        if self.causal:
            f /= 2
        return f * (3.5 if backward else 1.0)  # fwd+bwd = 1 + 2.5 forwards

    def short(self) -> str:
        """One-line description for logs and tables."""
        parts = [f"b{self.batch} sq{self.s_q} skv{self.s_kv} h{self.h_q}/{self.h_kv}",
                 f"d{self.d_qk}" + (f"/{self.d_v}" if self.d_v != self.d_qk else ""),
                 self.dtype, self.layout]
        if self.qkv_packing != "separate":
            parts.append(f"packed-{self.qkv_packing}")
        if self.mask != "none":
            parts.append(self.mask)
        if self.window is not None:
            parts.append(f"window{self.window}")
        if self.has_bias:
            parts.append(f"bias{self.bias_shape}")
        if self.has_dense_mask:
            parts.append(f"bool-mask{self.dense_mask_shape}")
        if self.softmax != "vanilla":
            parts.append(self.softmax)
        if self.has_dropout:
            parts.append(f"dropout{self.dropout}")
        if self.sequence != "dense":
            parts.append(self.sequence + (f"x{self.max_segments}" if self.is_packed else ""))
        if self.score_mod is not None:
            parts.append("score_mod=" + getattr(self.score_mod, "__name__", "fn"))
        if self.deterministic:
            parts.append("deterministic")
        if self.unseen_rows != "zero":
            parts.append(f"unseen-rows-{self.unseen_rows}")
        if self.is_fp8:
            parts.append(f"fp8(do {self.fp8_do}, grads {self.fp8_grad}"
                         + (", fp8 out)" if self.fp8_out else ")"))
        return " ".join(parts)
