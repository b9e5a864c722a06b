// The decode GEMV over packed weights (csrc/quant_dot.h) on SmolLM2-135M's shapes, torch-free: 30 layers of
// random group-32 weights (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536) and the 49152x576 int8
// head, run in decode order (the step's 90-143 MB do not fit the caches, as in the model), each call timed.
// Reports per shape the median time per call and the GB/s of its packed bytes, the step's total, a plain
// streaming read of 256 MB for scale, the kernel's compute rate with its weights hot (one gate_up again
// and again), and the float32 GEMV (kernels.h) on the same shapes. Built and run by quant_gemv_profile.py.
#include <chrono>
#include <cstdio>
#include <random>

#include "kernels.h"
#include "quant_dot.h"

using namespace servescope_quant;
using clk = std::chrono::steady_clock;

namespace {

struct Fmt {
  const char* name;
  bool i4, asym;
};

struct Mat {
  std::vector<uint8_t> w;
  std::vector<uint16_t> s;
  QMatrix q;
};

Mat make(std::mt19937& g, const Fmt& f, int64_t n, int64_t k) {
  Mat m;
  m.w.resize(n * (f.i4 ? k / 2 : k));
  for (auto& b : m.w) b = g() & 0xFF;
  m.s.resize(n * (k / 32) * (f.asym ? 2 : 1));
  for (auto& h : m.s) h = 0x2000 + (g() & 0x3FF);  // float16 in [2^-7, 2^-6)
  m.q = QMatrix{m.w.data(), n, k, 32, f.i4, f.asym, m.s.data()};
  return m;
}

double bytes(const QMatrix& q) { return (double)q.n * q.row_bytes() + (double)q.n * (q.kp / 32) * (q.asym ? 4 : 2); }

template <typename F>
double seconds(const F& fn) {
  const auto t0 = clk::now();
  fn();
  return std::chrono::duration<double>(clk::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double read_bandwidth() {
  std::vector<float> big((size_t)64 << 20, 1.f);
  double best = 0;
  for (int r = 0; r < 5; ++r) {
    std::vector<float> part(num_threads() + 1, 0.f);
    const double dt = seconds([&] {
      parallel_for(0, (int64_t)big.size() / 4096, 1, [&](int64_t a, int64_t b) {
        vf s0 = zero(), s1 = zero();
        for (int64_t i = a * 4096; i < b * 4096; i += 2 * W) {
          s0 = add(s0, load(big.data() + i));
          s1 = add(s1, load(big.data() + i + W));
        }
        part[a * num_threads() / ((int64_t)big.size() / 4096)] += reduce_add(add(s0, s1));
      });
    });
    best = std::max(best, big.size() * 4.0 / dt / 1e9);
    if (part[0] < 0) printf("?");
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  const int steps = argc > 1 ? std::atoi(argv[1]) : 10, layers = 30;
  const int64_t shapes[5][2] = {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}, {49152, 576}};
  const char* names[5] = {"qkv 960x576", "o 576x576", "gate_up 3072x576", "down 576x1536", "head 49152x576 (int8)"};
  std::mt19937 g(1);
  std::vector<float> x(1536), y(49152);
  for (auto& v : x) v = (float)((int)(g() % 200) - 100) / 50.f;
  printf("%s, %lld threads: streaming read %.1f GB/s\n", kIsa, (long long)num_threads(), read_bandwidth());
  const Fmt fmts[3] = {{"int4 (Q4_0 form)", true, false}, {"int4-asym (Q4_1 form)", true, true}, {"int8 (Q8_0 form)", false, false}};
  for (const Fmt& f : fmts) {
    std::vector<Mat> mats;
    for (int l = 0; l < layers; ++l)
      for (int s = 0; s < 4; ++s) mats.push_back(make(g, f, shapes[s][0], shapes[s][1]));
    const Mat head = make(g, Fmt{"int8", false, false}, shapes[4][0], shapes[4][1]);
    std::vector<std::vector<double>> t(5);
    std::vector<double> total;
    for (int st = 0; st < steps + 2; ++st) {  // two warm-up steps
      double acc[5] = {0, 0, 0, 0, 0};
      for (int l = 0; l < layers; ++l)
        for (int s = 0; s < 4; ++s) acc[s] += seconds([&] { quant_matvec(mats[l * 4 + s].q, x.data(), 1, nullptr, y.data()); });
      acc[4] = seconds([&] { quant_matvec(head.q, x.data(), 1, nullptr, y.data()); });
      if (st < 2) continue;
      for (int s = 0; s < 5; ++s) t[s].push_back(acc[s] / (s < 4 ? layers : 1));
      total.push_back(acc[0] + acc[1] + acc[2] + acc[3] + acc[4]);
    }
    std::vector<double> hot;
    for (int r = 0; r < 200; ++r) hot.push_back(seconds([&] { quant_matvec(mats[2].q, x.data(), 1, nullptr, y.data()); }));
    double tb = bytes(head.q);
    for (int s = 0; s < 4; ++s) tb += layers * bytes(mats[s].q);
    printf("%s %s: step %.2f ms (median of %d; fastest %.2f), %.1f MB, %.1f GB/s; hot gate_up %.1f us (%.1f GB/s)\n", kIsa,
           f.name, median(total) * 1e3, steps, *std::min_element(total.begin(), total.end()) * 1e3, tb / 1e6,
           tb / median(total) / 1e9, median(hot) * 1e6, bytes(mats[2].q) / median(hot) / 1e9);
    for (int s = 0; s < 5; ++s) {
      const double med = median(t[s]), b = bytes(s < 4 ? mats[s].q : head.q);
      printf("  %-24s %8.1f us  %6.1f GB/s\n", names[s], med * 1e6, b / med / 1e9);
    }
  }
  std::vector<std::vector<float>> ws;
  for (int l = 0; l < 8; ++l)
    for (int s = 0; s < 4; ++s) ws.emplace_back(shapes[s][0] * shapes[s][1], 0.01f);
  printf("%s float32 GEMV (8 layers' weights in turn)\n", kIsa);
  for (int s = 0; s < 4; ++s) {
    std::vector<double> ts;
    for (int st = 0; st < 5; ++st)
      for (int l = 0; l < 8; ++l)
        ts.push_back(seconds([&] {
          servescope_kernels::gemv_rows<float>(x.data(), 1, shapes[s][1], ws[l * 4 + s].data(), shapes[s][0], nullptr,
                                                nullptr, y.data());
        }));
    const double med = median(ts);
    printf("  %-24s %8.1f us  %6.1f GB/s\n", names[s], med * 1e6, 4.0 * shapes[s][0] * shapes[s][1] / med / 1e9);
  }
  return 0;
}
