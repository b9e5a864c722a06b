// Torch-free check of the fused MoE experts (csrc/moe_experts.h) on one ISA path, the other part of
// packed_check.cpp (built for every path quant_gemv_check.cpp covers). For each packed format
// (int4 / int8, symmetric / asymmetric), float32 and bfloat16 activations, token counts 1..17 and k = 1..8,
// with a local range of experts (first = 2: pairs routed to experts 0, 1, 8, 9 are skipped) and one local
// expert that no token chooses, moe_packed must equal bit for bit the reference's order of operations
// (model/moe.py's grouped_experts over PackedExperts: per expert quant_rows over its gathered rows, gate|up
// rounded to the dtype, silu_mul, down, then per token rnd(rnd(y) * w) summed in expert order in float32,
// rounded once), and stay within the activations' int8 rounding of a float64 sum over the dequantised weights.
// MXFP4 experts run as gpt-oss's: biases on both projections and the clamped SwiGLU.
#include "moe_experts.h"
#include <cstdio>
#include <random>
namespace moe_experts_check {
using namespace servescope_moe;

constexpr int64_t H = 96, I = 64, E = 6, FIRST = 2, TOTAL = 10, UNUSED = 3;  // global expert 3: no token

constexpr float ALPHA = 1.702f, LIMIT = 7.0f;

struct Packed {
  std::vector<uint8_t> w, e;
  std::vector<uint16_t> s;
  std::vector<float> bias;
  QMatrix q;
};

static Packed make(std::mt19937& g, bool i4, bool asym, int64_t n, int64_t kp, bool mx = false) {
  Packed p;
  p.w.resize(n * (i4 ? kp / 2 : kp));
  for (auto& b : p.w) b = g() & 0xFF;
  p.s.resize(n * (kp / 32) * (asym ? 2 : 1));
  for (auto& h : p.s) h = 0x2400 + (g() & 0x3FF);
  p.q = QMatrix{p.w.data(), n, kp, 32, i4, asym, p.s.data()};
  if (mx) {
    p.e.resize(n * (kp / 32));
    for (auto& e : p.e) e = 119 + g() % 6;  // 2^-8 .. 2^-3
    p.q.e8m0 = p.e.data();
    p.q.scales = nullptr;
    p.bias.resize(n);
    for (auto& v : p.bias) v = (float)((int)(g() % 200) - 100) / 100.f;
  }
  return p;
}

static double weight(const QMatrix& q, int64_t n, int64_t k) {
  const int64_t b = k / 32, j = k % 32, sc = q.asym ? 2 : 1;
  if (q.mx())
    return (double)e8m0_half(q.e8m0[n * (q.kp / 32) + b]) *
           MXFP4_VALUES[(q.w[n * q.kp / 2 + b * 16 + (j % 16)] >> (j < 16 ? 0 : 4)) & 15];
  const uint16_t* sp = q.scales + (n * (q.kp / 32) + b) * sc;
  const double d = half_to_float(sp[0]);
  const double u = q.int4 ? (double)((q.w[n * q.kp / 2 + b * 16 + (j % 16)] >> (j < 16 ? 0 : 4)) & 15)
                          : (double)(int8_t)q.w[n * q.kp + k];
  return q.asym ? d * u + half_to_float(sp[1]) : (q.int4 ? d * (u - 8) : d * u);
}

// every expert's weights decoded once (weight() per element), [n * kp + k]
struct Decoded {
  std::vector<std::vector<double>> gate_up, down;
};

static std::vector<double> decode(const QMatrix& q) {
  std::vector<double> out(q.n * q.kp);
  for (int64_t n = 0; n < q.n; ++n)
    for (int64_t k = 0; k < q.kp; ++k) out[n * q.kp + k] = weight(q, n, k);
  return out;
}

template <typename T>
static float val(T v) {
  if constexpr (std::is_same_v<T, float>) return v; else return bf16_to_float(v);
}

// The reference's order of operations, expert by expert, through the kernels it calls
template <typename T>
static std::vector<float> reference(const MoeWeights& ex, const std::vector<T>& x, const std::vector<int64_t>& ids,
                                    const std::vector<float>& wts, int64_t t, int64_t k) {
  std::vector<float> out(t * H, 0.f);  // (bfloat16 outputs: summed in float32, rounded at the end)
  for (int64_t e = 0; e < E; ++e) {
    std::vector<int64_t> tok;
    std::vector<float> tw;
    for (int64_t i = 0; i < t * k; ++i)
      if (ids[i] == FIRST + e) tok.push_back(i / k), tw.push_back(wts[i]);
    const int64_t m = tok.size();
    if (!m) continue;
    std::vector<T> xs(m * H), gt(m * 2 * I), h(m * I);
    for (int64_t r = 0; r < m; ++r) std::memcpy(xs.data() + r * H, x.data() + tok[r] * H, H * sizeof(T));
    std::vector<float> g(m * 2 * I), y(m * H);
    const bool gpt_oss = ex.act == MOE_ACT_CLAMPED_SWIGLU;
    quant_rows(ex.gate_up[e], xs.data(), m, gpt_oss ? ex.gate_up_bias[e] : nullptr, g.data(), QOrder::Auto);
    for (int64_t i = 0; i < m * 2 * I; ++i)
      if constexpr (std::is_same_v<T, float>) gt[i] = g[i]; else gt[i] = float_to_bf16(g[i]);
    if (gpt_oss)
      moe_clamped_swiglu<T>(g.data(), m, I, ALPHA, LIMIT, h.data());
    else
      servescope_kernels::silu_mul_rows<T>(gt.data(), 2 * I, h.data(), m, I);
    quant_rows(ex.down[e], h.data(), m, gpt_oss ? ex.down_bias[e] : nullptr, y.data(), QOrder::Auto);
    for (int64_t r = 0; r < m; ++r)
      for (int64_t c = 0; c < H; ++c) {
        float& o = out[tok[r] * H + c];
        if constexpr (std::is_same_v<T, float>) {
          o = o + y[r * H + c] * tw[r];
        } else {
          const float v = bf16_to_float(float_to_bf16(bf16_to_float(float_to_bf16(y[r * H + c])) * tw[r]));
          o = o + v;
        }
      }
  }
  if constexpr (!std::is_same_v<T, float>)
    for (auto& o : out) o = bf16_to_float(float_to_bf16(o));
  return out;
}

// float64 over the dequantised weights; returns the largest |error| / the largest |value|
template <typename T>
static double exact_error(const MoeWeights& ex, const Decoded& dw, const std::vector<T>& x, const std::vector<int64_t>& ids,
                          const std::vector<float>& wts, const std::vector<T>& got, int64_t t, int64_t k) {
  double err = 0, big = 1e-30;
  for (int64_t i = 0; i < t; ++i) {
    std::vector<double> o(H, 0.0);
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = ids[i * k + j] - FIRST;
      if (e < 0 || e >= E) continue;
      std::vector<double> h(I);
      const bool gpt_oss = ex.act == MOE_ACT_CLAMPED_SWIGLU;
      for (int64_t n = 0; n < I; ++n) {
        double gs = gpt_oss ? ex.gate_up_bias[e][n] : 0, us = gpt_oss ? ex.gate_up_bias[e][n + I] : 0;
        for (int64_t c = 0; c < H; ++c) {
          gs += dw.gate_up[e][n * H + c] * val(x[i * H + c]);
          us += dw.gate_up[e][(n + I) * H + c] * val(x[i * H + c]);
        }
        if (gpt_oss) {
          gs = std::min(gs, (double)LIMIT);
          us = std::min(std::max(us, -(double)LIMIT), (double)LIMIT);
          h[n] = (us + 1) * gs / (1 + std::exp(-ALPHA * gs));
        } else {
          h[n] = gs / (1 + std::exp(-gs)) * us;
        }
      }
      for (int64_t c = 0; c < H; ++c) {
        double s = gpt_oss ? ex.down_bias[e][c] : 0;
        for (int64_t n = 0; n < I; ++n) s += dw.down[e][c * I + n] * h[n];
        o[c] += wts[i * k + j] * s;
      }
    }
    for (int64_t c = 0; c < H; ++c) {
      err = std::max(err, std::abs(o[c] - val(got[i * H + c])));
      big = std::max(big, std::abs(o[c]));
    }
  }
  return err / big;
}

template <typename T>
static int check(std::mt19937& g, const MoeWeights& ex, const Decoded& dw, int64_t t, int64_t k, double* worst) {
  std::vector<T> x(t * H);
  for (auto& v : x) {
    const float f = (float)((int)(g() % 200) - 100) / 50.f;
    if constexpr (std::is_same_v<T, float>) v = f; else v = float_to_bf16(f);
  }
  std::vector<int64_t> ids(t * k), counts(E);
  std::vector<float> wts(t * k);
  for (int64_t i = 0; i < t; ++i) {
    std::vector<int64_t> pool;
    for (int64_t e = 0; e < TOTAL; ++e)
      if (e != UNUSED) pool.push_back(e);
    std::shuffle(pool.begin(), pool.end(), g);
    for (int64_t j = 0; j < k; ++j) ids[i * k + j] = pool[j], wts[i * k + j] = (float)(g() % 1000 + 1) / 1000.f;
  }
  std::vector<T> out(t * H);
  moe_packed(ex, x.data(), t, ids.data(), wts.data(), k, out.data(), counts.data());
  int bad = 0;
  const auto ref = reference(ex, x, ids, wts, t, k);
  for (int64_t i = 0; i < t * H; ++i) bad += val(out[i]) != ref[i];
  for (int64_t e = 0; e < E; ++e) bad += counts[e] != std::count(ids.begin(), ids.end(), FIRST + e);
  bad += counts[UNUSED - FIRST] != 0;
  const double err = exact_error(ex, dw, x, ids, wts, out, t, k);
  *worst = std::max(*worst, err);
  bad += !(err < (std::is_same_v<T, float> ? 0.05 : 0.1));  // (relative to the largest output)
  return bad;
}

// the number of failed checks; *worst: the largest error against the float64 sum
int run(double* worst_out) {
  std::mt19937 g(7);
  int bad = 0;
  double worst = 0;
  for (int fmt = 0; fmt < 5; ++fmt) {  // int4 / int8, symmetric / asymmetric, then MXFP4 (gpt-oss's)
      const bool i4 = fmt < 2 || fmt == 4, asym = fmt % 2 == 1 && fmt < 4, mx = fmt == 4;
      std::vector<Packed> gu, dn;
      for (int64_t e = 0; e < E; ++e)
        gu.push_back(make(g, i4, asym, 2 * I, H, mx)), dn.push_back(make(g, i4, asym, H, I, mx));
      MoeWeights ex;
      ex.first = FIRST;
      for (int64_t e = 0; e < E; ++e) ex.gate_up.push_back(gu[e].q), ex.down.push_back(dn[e].q);
      if (mx) {
        for (int64_t e = 0; e < E; ++e) ex.gate_up_bias.push_back(gu[e].bias.data()), ex.down_bias.push_back(dn[e].bias.data());
        ex.act = MOE_ACT_CLAMPED_SWIGLU, ex.alpha = ALPHA, ex.limit = LIMIT;
      }
      Decoded dw;
      for (int64_t e = 0; e < E; ++e) dw.gate_up.push_back(decode(ex.gate_up[e])), dw.down.push_back(decode(ex.down[e]));
      for (int64_t t : {1, 2, 3, 5, 8, 17})
        for (int64_t k = 1; k <= 8; ++k)
          bad += check<float>(g, ex, dw, t, k, &worst) + check<bf16>(g, ex, dw, t, k, &worst);
    }
  *worst_out = worst;
  return bad;
}

}  // namespace moe_experts_check
