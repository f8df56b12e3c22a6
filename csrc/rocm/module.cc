// The ROCm extension `fusedattn._rocm`: CK attention and the small-seq kernels.
#define FUSEDATTN_MODULE_NAME _rocm
#include "module_main.inc"
