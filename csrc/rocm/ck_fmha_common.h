// What the CK forward and backward FFI handlers share: reading the call's
// shapes, layout and sequence structure into CK's vocabulary (batch / group
// mode, element strides, mask type). CK's fmha_fwd.hpp and fmha_bwd.hpp cannot
// share a translation unit, so this header includes neither; the handlers
// (ck_fmha_fwd.cpp, ck_fmha_bwd.cpp) copy these fields into CK's argument structs.
//
// The Python side (src/fusedattn/backends/ck.py) is the other half of this
// contract: it decides the layouts and builds the `seq` array described below.
#pragma once

#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace fusedattn::ck {

namespace ffi = xla::ffi;

// Attribute values; ck.py uses the same numbers.
enum Layout : int64_t { kBshd = 0, kSbhd = 1 };
enum Sequence : int64_t { kDense = 0, kPadding = 1, kPacked = 2 };
enum Mask : int64_t { kNoMask = 0, kTopLeft = 1, kBottomRight = 2 };

// Element strides of one [batch, seq, head, dim] tensor in its physical layout.
struct Strides {
  int64_t batch = 0, seq = 0, head = 0;
};

// A 4-d q/k/v-like tensor: logical sizes plus strides.
struct Tensor4 {
  int64_t batch = 0, seq = 0, heads = 0, dim = 0;
  Strides stride;
};

template <typename Buffer>  // ffi::AnyBuffer or a typed ffi::Buffer
Tensor4 describe(const Buffer& x, int64_t layout) {
  auto d = x.dimensions();
  Tensor4 t;
  if (d.size() != 4) return t;  // checked by the caller through `valid`
  if (layout == kSbhd) {
    t = {d[1], d[0], d[2], d[3], {d[2] * d[3], d[1] * d[2] * d[3], d[3]}};
  } else {
    t = {d[0], d[1], d[2], d[3], {d[1] * d[2] * d[3], d[2] * d[3], d[3]}};
  }
  return t;
}

inline bool valid(const Tensor4& t) { return t.dim > 0; }

// CK's name for the element type, or "" when CK has no kernels for it here.
inline std::string ck_dtype(ffi::DataType t) {
  if (t == ffi::DataType::F16) return "fp16";
  if (t == ffi::DataType::BF16) return "bf16";
  return "";
}

// The int32 `seq` operand, shape [4, G + 1] (G = number of sequences CK sees):
//   padding (batch mode): row 0 / 1 = cumulative true q / kv lengths [b + 1];
//   packed (group mode):  row 0 / 1 = start token of each segment in the
//     flattened [b * s] token axis (entry G unused), row 2 / 3 = true lengths.
// Dense calls pass a [4, 1] array that is never read.
struct SeqPointers {
  const void* seqstart_q = nullptr;
  const void* seqstart_k = nullptr;
  const void* seqlen_q = nullptr;
  const void* seqlen_k = nullptr;
  const void* cu_seqlen_q = nullptr;
  const void* cu_seqlen_k = nullptr;
  int64_t groups = 0;  // G: CK's batch in group mode
};

inline SeqPointers seq_pointers(const ffi::Buffer<ffi::S32>& seq, int64_t sequence) {
  SeqPointers p;
  auto d = seq.dimensions();
  if (d.size() != 2 || d[0] != 4) return p;
  const int64_t width = d[1];
  const int32_t* base = seq.typed_data();
  if (sequence == kPadding) {
    p.cu_seqlen_q = base;
    p.cu_seqlen_k = base + width;
  } else if (sequence == kPacked) {
    p.seqstart_q = base;
    p.seqstart_k = base + width;
    p.seqlen_q = base + 2 * width;
    p.seqlen_k = base + 3 * width;
    p.groups = width - 1;
  }
  return p;
}

// Dropout seed and offset: two uint64 words in a uint32[4] device array (JAX
// runs without x64 by default), passed to CK by pointer so that the values
// never travel through the host.
struct DropoutPointers {
  const void* seed = nullptr;
  const void* offset = nullptr;
};

inline DropoutPointers dropout_pointers(const ffi::Buffer<ffi::U32>& words) {
  if (words.element_count() < 4) return {};
  const uint32_t* base = words.typed_data();
  return {base, base + 2};
}

// The attributes of every CK call (forward and backward alike), decoded by
// XLA from the call's attribute dictionary; ck.py sets each of them.
struct CallAttrs {
  int64_t layout;          // Layout
  int64_t sequence;        // Sequence
  int64_t max_seqlen_q;    // longest true q length (the row length when unknown)
  int64_t max_seqlen_k;
  int64_t mask;            // Mask; a window alone is kTopLeft with right >= 0 or -1
  int64_t window_left;     // -1 = unbounded
  int64_t window_right;
  float scale;
  float dropout;
  // Bias strides in elements, 0 on broadcast dimensions: the bias is
  // [b | 1, h | 1, s_q, s_kv] with s_kv contiguous.
  int64_t bias_batch_stride;
  int64_t bias_head_stride;
  int64_t bias_row_stride;
};

// An FFI error for a call CK could not serve, naming what was asked for.
inline ffi::Error unsupported(const std::string& what) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, "fusedattn ck: " + what);
}

}  // namespace fusedattn::ck

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    ::fusedattn::ck::CallAttrs,
    ::xla::ffi::StructMember<int64_t>("layout"),
    ::xla::ffi::StructMember<int64_t>("sequence"),
    ::xla::ffi::StructMember<int64_t>("max_seqlen_q"),
    ::xla::ffi::StructMember<int64_t>("max_seqlen_k"),
    ::xla::ffi::StructMember<int64_t>("mask"),
    ::xla::ffi::StructMember<int64_t>("window_left"),
    ::xla::ffi::StructMember<int64_t>("window_right"),
    ::xla::ffi::StructMember<float>("scale"),
    ::xla::ffi::StructMember<float>("dropout"),
    ::xla::ffi::StructMember<int64_t>("bias_batch_stride"),
    ::xla::ffi::StructMember<int64_t>("bias_head_stride"),
    ::xla::ffi::StructMember<int64_t>("bias_row_stride"));
