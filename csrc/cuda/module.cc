// The CUDA extension `fusedattn._cuda`: cuDNN attention and the small-seq kernels.
#define FUSEDATTN_MODULE_NAME _cuda
#include "module_main.inc"
