// The one place where CUDA and HIP differ, so that portable kernels in
// csrc/common compile unchanged with nvcc and hipcc: stream and error types,
// 16-bit float conversions, the warp (32) / wavefront (64) width, shuffles with
// an explicit width, block barriers and the launch syntax.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__HIPCC__) || defined(__HIP_PLATFORM_AMD__) || defined(__HIP_PLATFORM_HCC__)
#define FUSEDATTN_HIP 1
#include <hip/hip_fp16.h>
#include <hip/hip_runtime.h>
#else
#define FUSEDATTN_CUDA 1
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#endif

namespace fusedattn::vendor {

#if FUSEDATTN_HIP
using stream_t = hipStream_t;
using error_t = hipError_t;
constexpr error_t kSuccess = hipSuccess;
// gfx9 / CDNA run 64-lane wavefronts.
constexpr int kWarpSize = 64;
inline error_t last_error() { return hipGetLastError(); }
inline const char* error_string(error_t e) { return hipGetErrorString(e); }
#else
using stream_t = cudaStream_t;
using error_t = cudaError_t;
constexpr error_t kSuccess = cudaSuccess;
constexpr int kWarpSize = 32;
inline error_t last_error() { return cudaGetLastError(); }
inline const char* error_string(error_t e) { return cudaGetErrorString(e); }
#endif

// Sum-style butterfly step: the value of the lane `lane ^ mask` within groups of
// `width` lanes. Every lane of the warp / wavefront must execute it.
__device__ __forceinline__ float shfl_xor(float value, int mask, int width) {
#if FUSEDATTN_HIP
  return __shfl_xor(value, mask, width);
#else
  return __shfl_xor_sync(0xffffffffu, value, mask, width);
#endif
}

// Whether `stream` is being captured into a graph. A failed query counts as
// "no" and is cleared, so that it does not surface as a later launch error.
inline bool stream_is_capturing(stream_t stream) {
#if FUSEDATTN_HIP
  hipStreamCaptureStatus status = hipStreamCaptureStatusNone;
  if (hipStreamIsCapturing(stream, &status) != hipSuccess) {
    (void)hipGetLastError();
    return false;
  }
  return status == hipStreamCaptureStatusActive;
#else
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return status == cudaStreamCaptureStatusActive;
#endif
}

__device__ __forceinline__ void block_sync() { __syncthreads(); }

// 16-bit floats travel as their bits (uint16_t) so that no vendor bf16 type is
// needed (older HIP has none). bf16 is the top half of an fp32.
__device__ __forceinline__ float bf16_bits_to_float(uint16_t bits) {
  return __uint_as_float(static_cast<uint32_t>(bits) << 16);
}

__device__ __forceinline__ uint16_t float_to_bf16_bits(float value) {
  uint32_t u = __float_as_uint(value);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

__device__ __forceinline__ float fp16_bits_to_float(uint16_t bits) {
  return __half2float(__ushort_as_half(bits));
}

__device__ __forceinline__ uint16_t float_to_fp16_bits(float value) {
  return __half_as_ushort(__float2half_rn(value));
}

}  // namespace fusedattn::vendor

// kernel<<<grid, block, shared_bytes, stream>>>(args...) on both vendors.
#define FUSEDATTN_LAUNCH(kernel, grid, block, shared_bytes, stream, ...) \
  kernel<<<(grid), (block), (shared_bytes), (stream)>>>(__VA_ARGS__)
