// The small-seq kernels in the CUDA extension: instantiates the portable FFI
// handlers (csrc/common/small_seq_ffi.h) and adds them to `ffi_targets`.
#include "module_registry.h"
#include "small_seq_ffi.h"

FUSEDATTN_MODULE_INIT(small_seq) {
  pybind11::dict targets = m.attr("ffi_targets");
  targets["fusedattn_small_seq_fwd"] = ::fusedattn::ffi_capsule(FusedattnSmallSeqFwd);
  targets["fusedattn_small_seq_bwd"] = ::fusedattn::ffi_capsule(FusedattnSmallSeqBwd);
}
