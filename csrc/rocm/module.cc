// The ROCm extension `fusedattn._rocm`: CK attention and the small-seq kernels.
#define FUSEDATTN_MODULE_NAME _rocm
#include "module_main.inc"

// The gfx architectures the kernels were built for (";"-separated, from CMake), so that
// dispatch can refuse a device outside them with a reason instead of a launch failure.
#ifndef FUSEDATTN_HIP_ARCHS
#define FUSEDATTN_HIP_ARCHS ""
#endif

FUSEDATTN_MODULE_INIT(hip_architectures) { m.attr("hip_architectures") = FUSEDATTN_HIP_ARCHS; }
