// CK fused attention backward as an XLA FFI handler (`fusedattn_ck_bwd`, ROCM).
//
// Operands: q, k, v, bias, out, lse (as the forward wrote it), dout, seq,
// dropout words. Results: dq; dk and dv per *query* head ([.., s_kv, h_q, d]:
// CK writes one gradient per query head and ck.py sums each GQA group); dbias as
// a full [b, h_q, s_q, s_kv] array (empty without bias; ck.py sums it over
// broadcast dimensions); and two scratch outputs XLA allocates for CK: `d`
// (rowsum(dO * O), shaped like lse) and the fp32 dq accumulator (shaped like q).
// The accumulator is cleared here on the stream because CK adds into it.
#include <hip/hip_runtime.h>

#include "ck_fmha_common.h"
#include "fmha_bwd.hpp"
#include "module_registry.h"

namespace fusedattn::ck {
namespace {

ffi::Error ck_bwd(hipStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                  ffi::AnyBuffer bias, ffi::AnyBuffer out, ffi::Buffer<ffi::F32> lse,
                  ffi::AnyBuffer dout, ffi::Buffer<ffi::S32> seq, ffi::Buffer<ffi::U32> drop_words,
                  ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                  ffi::Result<ffi::AnyBuffer> dv, ffi::Result<ffi::AnyBuffer> dbias,
                  ffi::Result<ffi::Buffer<ffi::F32>> d_scratch,
                  ffi::Result<ffi::Buffer<ffi::F32>> dq_acc, CallAttrs a) {
  const std::string dtype = ck_dtype(q.element_type());
  if (dtype.empty() || k.element_type() != q.element_type() ||
      v.element_type() != q.element_type() || dout.element_type() != q.element_type())
    return unsupported("q, k, v and dout must share one dtype, float16 or bfloat16");
  const Tensor4 tq = describe(q, a.layout), tk = describe(k, a.layout),
                tv = describe(v, a.layout), to = describe(out, a.layout),
                tdo = describe(dout, a.layout), tdq = describe(*dq, a.layout),
                tdk = describe(*dk, a.layout), tdv = describe(*dv, a.layout),
                tacc = describe(*dq_acc, a.layout);
  for (const Tensor4* t : {&tq, &tk, &tv, &to, &tdo, &tdq, &tdk, &tdv, &tacc})
    if (!valid(*t)) return unsupported("backward tensors must be 4-d [b, s, h, d] (or [s, b, h, d])");
  if (tdk.heads != tq.heads || tdv.heads != tq.heads)
    return unsupported("dk and dv must have one head per query head");

  const bool group = a.sequence == kPacked;
  const SeqPointers sp = seq_pointers(seq, a.sequence);
  if (group && sp.groups <= 0) return unsupported("packed call without a [4, G + 1] seq array");
  const bool has_bias = bias.element_count() > 0;
  const bool has_dbias = has_bias && dbias->element_count() > 0;
  const bool has_dropout = a.dropout > 0.f;
  const DropoutPointers dp = dropout_pointers(drop_words);
  if (has_dropout && dp.seed == nullptr) return unsupported("dropout without its uint32[4] seed");

  fmha_bwd_traits traits{};
  traits.hdim_q = static_cast<int>(tq.dim);
  traits.hdim_v = static_cast<int>(tv.dim);
  traits.data_type = dtype;
  traits.is_group_mode = group;
  traits.mask_type = static_cast<mask_enum>(a.mask);
  traits.bias_type = has_bias ? bias_enum::elementwise_bias : bias_enum::no_bias;
  traits.has_dbias = has_dbias;
  traits.has_dropout = has_dropout;
  traits.is_store_randval = false;
  traits.is_deterministic = false;  // the generated instances are the atomic-dq kind

  // lse and d: [b, h, s_q] in batch mode, [h, tokens] in group mode.
  const auto lse_head_stride = static_cast<ck_tile::index_t>(tq.seq);
  const auto lse_batch_stride = group ? 0 : static_cast<ck_tile::index_t>(tq.heads * tq.seq);
  // dbias is materialised in full: [b, h_q, s_q, s_kv] (group mode has no bias).
  const auto dbias_row = static_cast<ck_tile::index_t>(tk.seq);
  const auto dbias_head = static_cast<ck_tile::index_t>(tq.seq * tk.seq);

  fmha_bwd_args args{};
  args.q_ptr = q.untyped_data();
  args.k_ptr = k.untyped_data();
  args.v_ptr = v.untyped_data();
  args.bias_ptr = has_bias ? bias.untyped_data() : nullptr;
  args.o_ptr = out.untyped_data();
  args.lse_ptr = lse.untyped_data();
  args.do_ptr = dout.untyped_data();
  args.d_ptr = d_scratch->untyped_data();
  args.rand_val_ptr = nullptr;
  args.dq_ptr = dq->untyped_data();
  args.dk_ptr = dk->untyped_data();
  args.dv_ptr = dv->untyped_data();
  args.dbias_ptr = has_dbias ? dbias->untyped_data() : nullptr;
  args.dq_acc_ptr = dq_acc->untyped_data();
  args.seqstart_q_ptr = sp.seqstart_q;
  args.seqstart_k_ptr = sp.seqstart_k;
  args.seqlen_q_ptr = sp.seqlen_q;
  args.seqlen_k_ptr = sp.seqlen_k;
  args.cu_seqlen_q_ptr = sp.cu_seqlen_q;
  args.cu_seqlen_k_ptr = sp.cu_seqlen_k;
  args.seqlen_q = static_cast<ck_tile::index_t>(tq.seq);
  args.seqlen_k = static_cast<ck_tile::index_t>(tk.seq);
  args.batch = static_cast<ck_tile::index_t>(group ? sp.groups : tq.batch);
  args.max_seqlen_q = static_cast<ck_tile::index_t>(a.max_seqlen_q);
  args.max_seqlen_k = static_cast<ck_tile::index_t>(a.max_seqlen_k);
  args.hdim_q = traits.hdim_q;
  args.hdim_v = traits.hdim_v;
  args.nhead_q = static_cast<ck_tile::index_t>(tq.heads);
  args.nhead_k = static_cast<ck_tile::index_t>(tk.heads);
  args.scale = a.scale;
  args.stride_q = tq.stride.seq;
  args.stride_k = tk.stride.seq;
  args.stride_v = tv.stride.seq;
  args.stride_bias = a.bias_row_stride;
  args.stride_o = to.stride.seq;
  args.stride_randval = 0;
  args.stride_do = tdo.stride.seq;
  args.stride_dq_acc = tacc.stride.seq;
  args.stride_dq = tdq.stride.seq;
  args.stride_dk = tdk.stride.seq;
  args.stride_dv = tdv.stride.seq;
  args.stride_dbias = dbias_row;
  args.nhead_stride_q = tq.stride.head;
  args.nhead_stride_k = tk.stride.head;
  args.nhead_stride_v = tv.stride.head;
  args.nhead_stride_bias = a.bias_head_stride;
  args.nhead_stride_o = to.stride.head;
  args.nhead_stride_randval = 0;
  args.nhead_stride_do = tdo.stride.head;
  args.nhead_stride_lsed = lse_head_stride;
  args.nhead_stride_dq_acc = tacc.stride.head;
  args.nhead_stride_dq = tdq.stride.head;
  args.nhead_stride_dk = tdk.stride.head;
  args.nhead_stride_dv = tdv.stride.head;
  args.nhead_stride_dbias = dbias_head;
  args.batch_stride_q = tq.stride.batch;
  args.batch_stride_k = tk.stride.batch;
  args.batch_stride_v = tv.stride.batch;
  args.batch_stride_bias = a.bias_batch_stride;
  args.batch_stride_o = to.stride.batch;
  args.batch_stride_randval = 0;
  args.batch_stride_do = tdo.stride.batch;
  args.batch_stride_lsed = lse_batch_stride;
  args.batch_stride_dq_acc = tacc.stride.batch;
  args.batch_stride_dq = tdq.stride.batch;
  args.batch_stride_dk = tdk.stride.batch;
  args.batch_stride_dv = tdv.stride.batch;
  args.batch_stride_dbias = static_cast<ck_tile::index_t>(tq.heads) * dbias_head;
  args.split_stride_dq_acc = 0;  // one split: non-deterministic instances
  args.window_size_left = static_cast<ck_tile::index_t>(a.window_left);
  args.window_size_right = static_cast<ck_tile::index_t>(a.window_right);
  args.mask_type = static_cast<ck_tile::index_t>(a.mask);
  args.p_drop = a.dropout;
  args.p_undrop = 1.f - a.dropout;
  args.drop_seed_offset = std::make_pair(dp.seed, dp.offset);

  // CK accumulates dq atomically, and skips fully masked blocks entirely.
  hipError_t err = hipMemsetAsync(dq_acc->untyped_data(), 0, dq_acc->size_bytes(), stream);
  if (err == hipSuccess && has_dbias)
    err = hipMemsetAsync(dbias->untyped_data(), 0, dbias->size_bytes(), stream);
  if (err != hipSuccess)
    return ffi::Error(ffi::ErrorCode::kInternal,
                      std::string("fusedattn ck backward memset: ") + hipGetErrorString(err));

  const float status = fmha_bwd(traits, args, ck_tile::stream_config{stream, false});
  if (status < 0)
    return unsupported("no generated CK backward kernel for " + dtype + " d_qk=" +
                       std::to_string(tq.dim) + " d_v=" + std::to_string(tv.dim) +
                       (group ? " group mode" : " batch mode") +
                       " mask=" + std::to_string(a.mask) + (has_bias ? " bias" : "") +
                       (has_dropout ? " dropout" : "") + " (d must be a multiple of 8, <= 256)");
  err = hipGetLastError();
  if (err != hipSuccess)
    return ffi::Error(ffi::ErrorCode::kInternal,
                      std::string("fusedattn ck backward launch: ") + hipGetErrorString(err));
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(kCkBwd, ck_bwd,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<hipStream_t>>()
                                  .Arg<ffi::AnyBuffer>()           // q
                                  .Arg<ffi::AnyBuffer>()           // k
                                  .Arg<ffi::AnyBuffer>()           // v
                                  .Arg<ffi::AnyBuffer>()           // bias (empty if none)
                                  .Arg<ffi::AnyBuffer>()           // out
                                  .Arg<ffi::Buffer<ffi::F32>>()    // lse
                                  .Arg<ffi::AnyBuffer>()           // dout
                                  .Arg<ffi::Buffer<ffi::S32>>()    // seq
                                  .Arg<ffi::Buffer<ffi::U32>>()    // dropout seed/offset
                                  .Ret<ffi::AnyBuffer>()           // dq
                                  .Ret<ffi::AnyBuffer>()           // dk per query head
                                  .Ret<ffi::AnyBuffer>()           // dv per query head
                                  .Ret<ffi::AnyBuffer>()           // dbias (empty if none)
                                  .Ret<ffi::Buffer<ffi::F32>>()    // d scratch
                                  .Ret<ffi::Buffer<ffi::F32>>()    // dq accumulator scratch
                                  .Attrs<CallAttrs>());

}  // namespace
}  // namespace fusedattn::ck

FUSEDATTN_MODULE_INIT(ck_bwd) {
  m.attr("ffi_targets")["fusedattn_ck_bwd"] = ::fusedattn::ffi_capsule(fusedattn::ck::kCkBwd);
}
