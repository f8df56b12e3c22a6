# The CUDA extension `fusedattn._cuda`: cuDNN attention (through cudnn-frontend's
# graph API) plus whatever CUDA kernels csrc/cuda and csrc/common hold.
#
# Needs nvcc, the cuDNN headers/library of the `nvidia-cudnn-cu13` wheel (the
# cuDNN that jaxlib loads, so the process holds one libcudnn), the cudnn-frontend
# headers (`nvidia-cudnn-frontend` wheel, or CUDNN_FRONTEND_INCLUDE) and XLA's FFI
# headers. FUSEDATTN_GPU=auto skips with a message when one is missing;
# FUSEDATTN_GPU=cuda makes that an error.
#
# Overridable: CMAKE_CUDA_ARCHITECTURES (default "90;80"), CUDNN_INCLUDE_DIR,
# CUDNN_LIBRARY, CUDNN_FRONTEND_INCLUDE (CMake variable or environment).

function(_fusedattn_cuda_skip why)
  if(FUSEDATTN_GPU STREQUAL "cuda")
    message(FATAL_ERROR "fusedattn: FUSEDATTN_GPU=cuda but ${why}")
  endif()
  message(STATUS "fusedattn: CUDA extension skipped: ${why}")
endfunction()

macro(_fusedattn_python_path out code)
  execute_process(COMMAND "${Python_EXECUTABLE}" -c "${code}"
                  OUTPUT_VARIABLE ${out} OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
endmacro()

# A headers directory: the CMake variable `var`, else the environment's, else what
# the Python `code` prints (a wheel's include directory).
macro(_fusedattn_headers var code)
  if(NOT ${var} AND DEFINED ENV{${var}})
    set(${var} "$ENV{${var}}")
  endif()
  if(NOT ${var})
    _fusedattn_python_path(${var} "${code}")
  endif()
endmacro()

# File scope, not a function: enable_language() must run at directory scope.
include(CheckLanguage)
check_language(CUDA)
if(NOT CMAKE_CUDA_COMPILER)
  _fusedattn_cuda_skip("no CUDA compiler (nvcc) found")
  return()
endif()
if(NOT _ffi_rc EQUAL 0 OR NOT EXISTS "${FUSEDATTN_XLA_FFI_INCLUDE}/xla/ffi/api/ffi.h")
  _fusedattn_cuda_skip("XLA FFI headers not found (is jax installed for ${Python_EXECUTABLE}?)")
  return()
endif()

# cuDNN: the wheel jaxlib loads (site-packages/nvidia/cudnn), unless given.
if(NOT CUDNN_INCLUDE_DIR OR NOT CUDNN_LIBRARY)
  _fusedattn_python_path(_cudnn_root
    "import nvidia.cudnn as m; print(list(m.__path__)[0])")
  if(_cudnn_root)
    set(CUDNN_INCLUDE_DIR "${_cudnn_root}/include")
    set(CUDNN_LIBRARY "${_cudnn_root}/lib/libcudnn.so.9")
  endif()
endif()
if(NOT EXISTS "${CUDNN_INCLUDE_DIR}/cudnn.h" OR NOT EXISTS "${CUDNN_LIBRARY}")
  _fusedattn_cuda_skip("cuDNN not found (pip install nvidia-cudnn-cu13, or set CUDNN_INCLUDE_DIR and CUDNN_LIBRARY)")
  return()
endif()

# cudnn-frontend: explicit path, else the wheel's include/ beside its `cudnn` package.
_fusedattn_headers(CUDNN_FRONTEND_INCLUDE [=[
import importlib.util, os, sysconfig
spec = importlib.util.find_spec("cudnn")
roots = [os.path.dirname(os.path.dirname(spec.origin))] if spec and spec.origin else []
roots += [sysconfig.get_paths()[k] for k in ("purelib", "platlib", "data")]
roots += [os.path.join(sysconfig.get_paths()["data"], "include")]
print(next((os.path.join(r, "include") for r in roots
          if os.path.exists(os.path.join(r, "include", "cudnn_frontend.h"))), ""))
]=])
if(NOT EXISTS "${CUDNN_FRONTEND_INCLUDE}/cudnn_frontend.h")
  _fusedattn_cuda_skip("cudnn-frontend headers not found (pip install nvidia-cudnn-frontend, or set CUDNN_FRONTEND_INCLUDE)")
  return()
endif()

# cudnn-frontend formats messages with iostreams, which crash when libstdc++ is
# linked statically into this shared object: say so (ci/cuda.sh picks another g++).
if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
  execute_process(COMMAND "${CMAKE_CXX_COMPILER}" -print-file-name=libstdc++.so
                  OUTPUT_VARIABLE _libstdcxx OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(_libstdcxx STREQUAL "libstdc++.so")
    message(WARNING "fusedattn: ${CMAKE_CXX_COMPILER} has no shared libstdc++; the extension "
                    "would carry a static copy, which crashes in cudnn-frontend. Use a compiler "
                    "with a shared libstdc++ (CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++).")
  endif()
endif()

if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES OR CMAKE_CUDA_ARCHITECTURES STREQUAL "")
  set(CMAKE_CUDA_ARCHITECTURES "90;80")
endif()
enable_language(CUDA)
find_package(CUDAToolkit REQUIRED)

# cudnn-frontend's headers include nvrtc.h (for engines we never use); the header
# alone is enough because we load cuDNN / CUDA through the frontend's dynamic
# loader (below). Look in the toolkit, then in the pip CUDA wheels jax uses.
_fusedattn_python_path(_pip_cuda_includes [=[
import importlib.util, os
dirs = []
for name in ("nvidia.cu13", "nvidia.cuda_nvrtc", "nvidia.cuda_runtime"):
    try:
        spec = importlib.util.find_spec(name)
    except Exception:
        spec = None
    for d in (spec.submodule_search_locations or []) if spec else []:
        dirs.append(os.path.join(d, "include"))
print(";".join(dirs))
]=])
find_path(FUSEDATTN_NVRTC_INCLUDE nvrtc.h HINTS ${CUDAToolkit_INCLUDE_DIRS} ${_pip_cuda_includes})
if(NOT FUSEDATTN_NVRTC_INCLUDE)
  _fusedattn_cuda_skip("nvrtc.h (needed by the cudnn-frontend headers) not found in the CUDA toolkit or the nvidia-cuda-nvrtc wheel")
  return()
endif()

file(GLOB _sources CONFIGURE_DEPENDS
     "${CMAKE_CURRENT_SOURCE_DIR}/csrc/cuda/*.cc"
     "${CMAKE_CURRENT_SOURCE_DIR}/csrc/cuda/*.cu")
pybind11_add_module(_cuda MODULE ${_sources})
target_compile_features(_cuda PRIVATE cxx_std_17)
set_target_properties(_cuda PROPERTIES CUDA_STANDARD 17 CUDA_SEPARABLE_COMPILATION OFF)
target_include_directories(_cuda PRIVATE
  "${FUSEDATTN_COMMON_DIR}" "${CMAKE_CURRENT_SOURCE_DIR}/csrc/cuda"
  "${FUSEDATTN_XLA_FFI_INCLUDE}")
# Third-party headers as SYSTEM: their warnings are not ours.
target_include_directories(_cuda SYSTEM PRIVATE
  "${CUDNN_FRONTEND_INCLUDE}" "${CUDNN_INCLUDE_DIR}" "${FUSEDATTN_NVRTC_INCLUDE}")
# NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING: the frontend resolves cuDNN / CUDA runtime
# symbols with dlopen by soname (it then checks the runtime cuDNN version itself),
# so it finds the libraries jaxlib already loaded.
target_compile_definitions(_cuda PRIVATE FUSEDATTN_CUDA=1 NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING)
target_compile_options(_cuda PRIVATE
  $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr -lineinfo>)
# Link the very libcudnn.so.9 jaxlib loads and find it again at run time through
# RPATH, so the process never holds two cuDNNs.
get_filename_component(_cudnn_lib_dir "${CUDNN_LIBRARY}" DIRECTORY)
target_link_libraries(_cuda PRIVATE "${CUDNN_LIBRARY}" CUDA::cudart_static)
set_target_properties(_cuda PROPERTIES
  BUILD_RPATH "${_cudnn_lib_dir}"
  INSTALL_RPATH "${_cudnn_lib_dir};$ORIGIN/../nvidia/cudnn/lib"
  BUILD_WITH_INSTALL_RPATH ON)
install(TARGETS _cuda LIBRARY DESTINATION fusedattn)

# The block-sparse backward of one kernel (csrc/cuda/block_sparse_bwd: CuTe, wgmma and
# TMA, so sm_90a only), where the CUTLASS headers are found (the nvidia-cutlass wheel,
# or CUTLASS_INCLUDE); without them the extension lacks its FFI target and the
# block-sparse backward runs the Mosaic GPU kernels.
_fusedattn_headers(CUTLASS_INCLUDE [=[
import importlib.util, os
spec = importlib.util.find_spec("cutlass_library")
print(os.path.join(list(spec.submodule_search_locations)[0], "source", "include") if spec else "")
]=])
# (its FFI handler finds cuTensorMapEncodeTiled through the runtime, CUDA 12.5 on)
if(CMAKE_CUDA_COMPILER_VERSION VERSION_LESS 12.5)
  message(STATUS "fusedattn: the block-sparse backward kernel skipped: it needs CUDA 12.5 "
                 "or later, nvcc is ${CMAKE_CUDA_COMPILER_VERSION}")
elseif(EXISTS "${CUTLASS_INCLUDE}/cute/tensor.hpp")
  add_library(_block_sparse_bwd OBJECT
              "${CMAKE_CURRENT_SOURCE_DIR}/csrc/cuda/block_sparse_bwd/ffi.cu")
  # (arch flags of its own: the extension's list holds architectures without wgmma)
  set_target_properties(_block_sparse_bwd PROPERTIES CUDA_ARCHITECTURES OFF
                        POSITION_INDEPENDENT_CODE ON CUDA_STANDARD 17)
  target_compile_options(_block_sparse_bwd PRIVATE
    --expt-relaxed-constexpr -lineinfo "SHELL:-gencode arch=compute_90a,code=sm_90a")
  target_include_directories(_block_sparse_bwd PRIVATE
    "${FUSEDATTN_COMMON_DIR}" "${FUSEDATTN_XLA_FFI_INCLUDE}")
  target_include_directories(_block_sparse_bwd SYSTEM PRIVATE "${CUTLASS_INCLUDE}")
  target_link_libraries(_block_sparse_bwd PRIVATE pybind11::module)
  target_link_libraries(_cuda PRIVATE _block_sparse_bwd)
  message(STATUS "fusedattn: the block-sparse backward kernel built for sm_90a (CUTLASS ${CUTLASS_INCLUDE})")
else()
  message(STATUS "fusedattn: the block-sparse backward kernel skipped: CUTLASS headers not found "
                 "(pip install nvidia-cutlass, or set CUTLASS_INCLUDE)")
endif()

message(STATUS "fusedattn: building fusedattn._cuda for sm ${CMAKE_CUDA_ARCHITECTURES}; "
               "cuDNN ${CUDNN_LIBRARY}; cudnn-frontend ${CUDNN_FRONTEND_INCLUDE}")
