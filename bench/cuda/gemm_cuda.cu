// bench gemm's CUDA twin (gemm_cuda.hpp for the method): cuBLAS strided-batched bf16
// GEMMs, every call checked, timed with CUDA events. Runs only where a GPU exists.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "cuda/gemm_cuda.hpp"
#include "device/cuda/cuda_check.hpp"
#include "spillway/core/error.hpp"
#include "spillway/device/device_math.hpp"

namespace spillway::cuda_bench {

namespace {

void cublas_check(cublasStatus_t s, const char* expr, const char* file, int line) {
  if (s == CUBLAS_STATUS_SUCCESS) return;
  detail::throw_check_failure(
      expr, file, line,
      fmt::format("cuBLAS error {} ({})", cublasGetStatusName(s), static_cast<int>(s)));
}
#define SPILLWAY_CUBLAS_CHECK(expr) cublas_check((expr), #expr, __FILE__, __LINE__)

// One shape's device buffers and the host copies of its inputs.
struct Buffers {
  GemmShape s;
  uint16_t* a = nullptr;
  uint16_t* b = nullptr;
  uint16_t* c = nullptr;
  std::vector<uint16_t> ha, hb;
  size_t na() const { return static_cast<size_t>(s.batch * s.m * s.k); }
  size_t nb() const { return static_cast<size_t>(s.batch * s.k * s.n); }
  size_t nc() const { return static_cast<size_t>(s.batch * s.m * s.n); }
};

void release(Buffers& b) {
  for (uint16_t* p : {b.a, b.b, b.c})
    if (p != nullptr) SPILLWAY_CUDA_CHECK_WARN(cudaFree(p));
  b.a = b.b = b.c = nullptr;
}

// Row-major C (m x n) = A (m x k) B (k x n), per batch entry: in cuBLAS's column-major
// terms C^T (n x m) = B^T (n x k) A^T (k x m).
void run(cublasHandle_t h, const Buffers& b) {
  const float alpha = 1.0f;
  const float beta = 0.0f;
  const GemmShape& s = b.s;
  SPILLWAY_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
      h, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(s.n), static_cast<int>(s.m),
      static_cast<int>(s.k), &alpha, b.b, CUDA_R_16BF, static_cast<int>(s.n), s.k * s.n, b.a,
      CUDA_R_16BF, static_cast<int>(s.k), s.m * s.k, &beta, b.c, CUDA_R_16BF, static_cast<int>(s.n),
      s.m * s.n, static_cast<int>(s.batch), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

int64_t check(const Buffers& b, int points, std::mt19937_64& rng, const std::string& label) {
  std::vector<uint16_t> hc(b.nc());
  SPILLWAY_CUDA_CHECK(
      cudaMemcpy(hc.data(), b.c, hc.size() * sizeof(uint16_t), cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < hc.size(); ++i) {
    if (!std::isfinite(bf16_to_float(hc[i]))) {
      SPILLWAY_INPUT_ERROR(
          "bench gemm --backend cuda: {}: output element {} is {} (not written "
          "or not finite)",
          label, i, bf16_to_float(hc[i]));
    }
  }
  const GemmShape& s = b.s;
  std::uniform_int_distribution<int64_t> row(0, s.m - 1);
  std::uniform_int_distribution<int64_t> col(0, s.n - 1);
  int64_t checked = 0;
  for (int64_t g = 0; g < s.batch; ++g) {
    for (int p = 0; p < points; ++p) {
      const int64_t i = row(rng);
      const int64_t j = col(rng);
      double want = 0.0;
      double scale = 0.0;
      for (int64_t l = 0; l < s.k; ++l) {
        const double x = bf16_to_float(b.ha[static_cast<size_t>((g * s.m + i) * s.k + l)]);
        const double y = bf16_to_float(b.hb[static_cast<size_t>((g * s.k + l) * s.n + j)]);
        want += x * y;
        scale += std::abs(x * y);
      }
      const double got = bf16_to_float(hc[static_cast<size_t>((g * s.m + i) * s.n + j)]);
      if (std::abs(got - want) > 4e-3 * scale + 1e-6) {
        SPILLWAY_INPUT_ERROR(
            "bench gemm --backend cuda: {}: GEMM {} element ({}, {}) is {} but "
            "a double dot product gives {} (tolerance 4e-3 x {})",
            label, g, i, j, got, want, scale);
      }
      ++checked;
    }
  }
  return checked;
}

}  // namespace

bool compiled() {
  return true;
}

GemmTiming time_bf16_gemms(const std::vector<GemmShape>& shapes, int64_t square, int repeats,
                           int check_points, uint64_t seed) {
  int count = 0;
  const cudaError_t found = cudaGetDeviceCount(&count);
  if (found != cudaSuccess || count == 0) {
    (void)cudaGetLastError();
    SPILLWAY_INPUT_ERROR(
        "bench gemm --backend cuda: no CUDA device on this machine ({}); the "
        "host backend is --backend host",
        found != cudaSuccess ? detail::cuda_error_text(found)
                             : std::string("cudaGetDeviceCount found none"));
  }
  GemmTiming t;
  cudaDeviceProp prop{};
  SPILLWAY_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  t.device = fmt::format("{} (sm_{}{})", prop.name, prop.major, prop.minor);
  std::vector<Buffers> bufs;
  {
    Buffers sq;
    sq.s = GemmShape{square, square, square, 1};
    bufs.push_back(sq);
  }
  for (const GemmShape& s : shapes) {
    Buffers b;
    b.s = s;
    bufs.push_back(b);
  }
  cublasHandle_t handle = nullptr;
  cudaEvent_t e0 = nullptr;
  cudaEvent_t e1 = nullptr;
  try {
    SPILLWAY_CUBLAS_CHECK(cublasCreate(&handle));
    SPILLWAY_CUDA_CHECK(cudaEventCreate(&e0));
    SPILLWAY_CUDA_CHECK(cudaEventCreate(&e1));
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (Buffers& b : bufs) {
      b.ha.resize(b.na());
      b.hb.resize(b.nb());
      for (uint16_t& x : b.ha) x = float_to_bf16(u(rng));
      for (uint16_t& x : b.hb) x = float_to_bf16(u(rng));
      SPILLWAY_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&b.a), b.na() * sizeof(uint16_t)));
      SPILLWAY_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&b.b), b.nb() * sizeof(uint16_t)));
      SPILLWAY_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&b.c), b.nc() * sizeof(uint16_t)));
      SPILLWAY_CUDA_CHECK(
          cudaMemcpy(b.a, b.ha.data(), b.na() * sizeof(uint16_t), cudaMemcpyHostToDevice));
      SPILLWAY_CUDA_CHECK(
          cudaMemcpy(b.b, b.hb.data(), b.nb() * sizeof(uint16_t), cudaMemcpyHostToDevice));
      SPILLWAY_CUDA_CHECK(cudaMemset(b.c, 0xFF, b.nc() * sizeof(uint16_t)));  // bf16 NaN
    }
    // Checked before anything is timed.
    for (size_t i = 0; i < bufs.size(); ++i) {
      run(handle, bufs[i]);
      SPILLWAY_CUDA_CHECK(cudaDeviceSynchronize());
      const GemmShape& s = bufs[i].s;
      t.elements_checked +=
          check(bufs[i], check_points, rng,
                i == 0 ? std::string("baseline")
                       : fmt::format("{} x ({} x {}) by ({} x {})", s.batch, s.m, s.k, s.k, s.n));
    }
    auto timed = [&](const Buffers& b) {
      SPILLWAY_CUDA_CHECK(cudaEventRecord(e0));
      run(handle, b);
      SPILLWAY_CUDA_CHECK(cudaEventRecord(e1));
      SPILLWAY_CUDA_CHECK(cudaEventSynchronize(e1));
      float ms = 0.0f;
      SPILLWAY_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
      return static_cast<double>(ms);
    };
    for (const Buffers& b : bufs) (void)timed(b);  // untimed round
    t.shape_ms.assign(shapes.size(), {});
    for (int r = 0; r < repeats; ++r) {
      t.square_ms.push_back(timed(bufs[0]));
      for (size_t i = 1; i < bufs.size(); ++i) t.shape_ms[i - 1].push_back(timed(bufs[i]));
    }
  } catch (...) {
    for (Buffers& b : bufs) release(b);
    if (e0 != nullptr) SPILLWAY_CUDA_CHECK_WARN(cudaEventDestroy(e0));
    if (e1 != nullptr) SPILLWAY_CUDA_CHECK_WARN(cudaEventDestroy(e1));
    if (handle != nullptr) cublasDestroy(handle);
    throw;
  }
  for (Buffers& b : bufs) release(b);
  SPILLWAY_CUDA_CHECK_WARN(cudaEventDestroy(e0));
  SPILLWAY_CUDA_CHECK_WARN(cudaEventDestroy(e1));
  cublasDestroy(handle);
  return t;
}

}  // namespace spillway::cuda_bench
