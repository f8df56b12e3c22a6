// Standalone timing of the small-seq kernels, for tuning their compile-time
// knobs without rebuilding the extension (see tune_small_seq.sh, which builds
// this once per knob setting). Times the forward and backward kernels with CUDA
// events on the benchmark's shapes (30720 tokens, bf16, MHA) and prints GB/s
// counted as bench_small_seq.py counts them (valid keys only; padded dK/dV in
// full), beside a device-to-device copy of 1 GiB. Correctness is the GPU
// tests' job; this only times.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "small_seq_launch.cuh"

namespace ss = fusedattn::small_seq;

#define CHECK(x)                                                                          \
  do {                                                                                    \
    cudaError_t e_ = (x);                                                                 \
    if (e_ != cudaSuccess) {                                                              \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                       \
    }                                                                                     \
  } while (0)

__global__ void fill_bf16(uint16_t* x, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 13; h *= 0x5bd1e995u; h ^= h >> 15;
    float f = (float(h & 0xffff) / 65536.f - 0.5f) * 2.f;
    x[i] = fusedattn::vendor::float_to_bf16_bits(f);
  }
}

template <class F>
float median_ms(F&& launch, int reps = 30, int rounds = 5) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) launch();
  std::vector<float> ms;
  for (int r = 0; r < rounds; ++r) {
    CHECK(cudaEventRecord(a));
    for (int i = 0; i < reps; ++i) launch();
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float t = 0;
    CHECK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t / reps);
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

uint16_t* alloc_bf16(size_t n, uint32_t seed) {
  uint16_t* p = nullptr;
  CHECK(cudaMalloc(&p, n * 2));
  fill_bf16<<<1024, 256>>>(p, n, seed);
  return p;
}

int main(int argc, char** argv) {
  const int64_t n = 30720;
  const char* label = argc > 1 ? argv[1] : "default";
  // Copy ceiling: 1 GiB device-to-device (read + write counted).
  const size_t copy_bytes = size_t(1) << 30;
  void *src, *dst;
  CHECK(cudaMalloc(&src, copy_bytes));
  CHECK(cudaMalloc(&dst, copy_bytes));
  const float copy_ms = median_ms([&] { CHECK(cudaMemcpyAsync(dst, src, copy_bytes, cudaMemcpyDeviceToDevice)); }, 10);
  const double copy_gbps = 2.0 * copy_bytes / (copy_ms * 1e-3) / 1e9;
  CHECK(cudaFree(src));
  CHECK(cudaFree(dst));
  std::printf("variant %s  copy %.0f GB/s\n", label, copy_gbps);
  std::printf("%-8s %3s %4s %-13s %8s %8s %7s %8s %8s %7s\n", "variant", "h", "d", "kv", "fwd_ms", "fwd_GBps",
              "fwd_fr", "bwd_ms", "bwd_GBps", "bwd_fr");

  std::mt19937 rng(0);
  for (int h : {8, 16}) {
    for (int d : {128, 256, 512}) {
      for (std::string kv : {"4", "16", "ragged", "ragged_packed"}) {
        const bool ragged = kv.rfind("ragged", 0) == 0, packed = kv == "ragged_packed";
        const int s = kv == "4" ? 4 : 16;
        std::vector<int32_t> lengths(n, s);
        if (ragged) {
          std::uniform_int_distribution<int> u(1, 15);
          for (auto& l : lengths) l = u(rng);
        }
        int64_t valid = 0;
        for (int l : lengths) valid += l;
        std::vector<int32_t> index;
        if (packed) {
          index.push_back(0);
          for (int l : lengths) index.push_back(index.back() + l);
        } else {
          index = lengths;
        }
        const int64_t kv_rows = packed ? valid : n * s;
        const size_t row = size_t(h) * d;
        uint16_t *q = alloc_bf16(n * row, 1), *k = alloc_bf16(kv_rows * row, 2), *v = alloc_bf16(kv_rows * row, 3);
        uint16_t *o = alloc_bf16(n * row, 4), *d_o = alloc_bf16(n * row, 5), *dq = alloc_bf16(n * row, 6);
        uint16_t *dk = alloc_bf16(kv_rows * row, 7), *dv = alloc_bf16(kv_rows * row, 8);
        float* lse = nullptr;
        int32_t* idx = nullptr;
        CHECK(cudaMalloc(&lse, n * h * sizeof(float)));
        CHECK(cudaMalloc(&idx, index.size() * sizeof(int32_t)));
        CHECK(cudaMemcpy(idx, index.data(), index.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
        ss::Params p{};
        p.q = q; p.k = k; p.v = v; p.o = o; p.d_o = d_o; p.lse_in = lse; p.kv_index = idx;
        p.lse_out = lse; p.dk = dk; p.dv = dv; p.n = n; p.h_q = h; p.h_kv = h; p.s_kv = s;
        p.kv_rows = kv_rows; p.packed = packed; p.scale = 1.0f / std::sqrt(float(d));
        ss::Params fwd = p;
        fwd.out = o;
        ss::Params bwd = p;
        bwd.out = dq;
        auto run = [&](const ss::Params& pp, bool backward) {
          std::string err = ss::launch(0, ss::Dtype::kBf16, d, s, pp, backward);
          if (!err.empty()) { std::fprintf(stderr, "%s\n", err.c_str()); std::exit(1); }
        };
        run(fwd, false);  // a real LSE for the backward
        CHECK(cudaDeviceSynchronize());
        const float f_ms = median_ms([&] { run(fwd, false); });
        const float b_ms = median_ms([&] { run(bwd, true); });
        CHECK(cudaGetLastError());
        const double row_bytes = double(row) * 2, kv_read = 2.0 * valid * row_bytes;
        const double f_bytes = 2.0 * n * row_bytes + kv_read;
        const double b_bytes = 4.0 * n * row_bytes + kv_read + 2.0 * kv_rows * row_bytes + n * h * 4.0;
        const double f_gbps = f_bytes / (f_ms * 1e-3) / 1e9, b_gbps = b_bytes / (b_ms * 1e-3) / 1e9;
        std::printf("%-8s %3d %4d %-13s %8.3f %8.0f %7.3f %8.3f %8.0f %7.3f\n", label, h, d, kv.c_str(), f_ms, f_gbps,
                    f_gbps / copy_gbps, b_ms, b_gbps, b_gbps / copy_gbps);
        for (void* ptr : {(void*)q, (void*)k, (void*)v, (void*)o, (void*)d_o, (void*)dq, (void*)dk, (void*)dv,
                          (void*)lse, (void*)idx})
          CHECK(cudaFree(ptr));
      }
    }
  }
  return 0;
}
