// A stand-in for ATen's parallel_for (its OpenMP backend's split: one contiguous range per thread), so
// that benchmarks/quant_gemv_profile.cpp runs the torch-free kernels threaded exactly as the extension
// splits them, without linking libtorch.
#pragma once
#include <omp.h>

#include <algorithm>
#include <cstdint>

namespace at {
inline int get_num_threads() { return omp_get_max_threads(); }
template <typename F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (begin >= end) return;
  if (end - begin <= grain || omp_in_parallel() || omp_get_max_threads() == 1) return f(begin, end);
  const int64_t nt = std::min<int64_t>(omp_get_max_threads(), (end - begin + grain - 1) / grain);
#pragma omp parallel num_threads(nt)
  {
    const int64_t n = omp_get_num_threads(), tid = omp_get_thread_num(), chunk = (end - begin + n - 1) / n;
    const int64_t b = begin + tid * chunk;
    if (b < end) f(b, std::min(end, b + chunk));
  }
}
}  // namespace at
