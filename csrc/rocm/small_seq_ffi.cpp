// The small-seq kernels in the ROCm extension. The FFI handlers
// (csrc/common/small_seq_ffi.h) and their registration are vendor-neutral, so
// this compiles, as HIP, the very source the CUDA extension builds and the
// NVIDIA GPU tests exercise; only the compiler differs.
#include "../cuda/small_seq_ffi.cu"
