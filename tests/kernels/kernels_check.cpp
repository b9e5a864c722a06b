// Every CPU kernel of src/servescope/kernels/cpu/csrc/kernels.h (and prefill_f32.h) against a float64 reference, with no
// torch: compiled once per ISA by tests/kernels/test_isa_paths.py (natively where the CPU runs it,
// and for aarch64 with a cross compiler, run under qemu-aarch64). Prints one line per failure and
// "<isa> ok: <n> checks" at the end; the exit status is the number of failures (capped).
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "kernels.h"
#include "prefill_f32.h"

using namespace servescope_kernels;

static int g_checks = 0, g_fail = 0;

static uint64_t g_rng = 0x9E3779B97F4A7C15ull;
static float urand() {  // uniform in [-1, 1)
  g_rng = g_rng * 6364136223846793005ull + 1442695040888963407ull;
  return (float)((g_rng >> 40) & 0xFFFFFF) / (float)(1 << 23) - 1.0f;
}

template <typename T>
static T from_float(float f) {
  if constexpr (std::is_same_v<T, float>) return f; else return float_to_bf16(f);
}
template <typename T>
static double to_double(T v) {
  if constexpr (std::is_same_v<T, float>) return v; else return bf16_to_float(v);
}
template <typename T>
static std::vector<T> randv(size_t n, float scale = 1.f) {
  std::vector<T> v(n);
  for (auto& x : v) x = from_float<T>(urand() * scale);
  return v;
}
template <typename T>
static double tol() { return std::is_same_v<T, float> ? 2e-5 : 2e-2; }

// |got - want| <= tol * (1 + |want|) for every element
template <typename G>
static void expect(const char* what, const G* got, const std::vector<double>& want, double tl, const std::string& ctx) {
  ++g_checks;
  for (size_t i = 0; i < want.size(); ++i) {
    const double g = to_double(got[i]);
    if (!(std::fabs(g - want[i]) <= tl * (1.0 + std::fabs(want[i])))) {
      ++g_fail;
      std::printf("FAIL %s %s: [%zu] got %.8g want %.8g\n", what, ctx.c_str(), i, g, want[i]);
      return;
    }
  }
}

template <typename T>
static void check_norm(int64_t rows, int64_t n, bool with_residual) {
  auto x = randv<T>(rows * n), r = randv<T>(rows * n), w = randv<T>(n);
  std::vector<T> y(rows * n), h(rows * n);
  norm_rows<T>(x.data(), n, with_residual ? r.data() : nullptr, n, h.data(), y.data(), w.data(), rows, n, 1e-5f);
  std::vector<double> want(rows * n), want_h(rows * n);
  for (int64_t i = 0; i < rows; ++i) {
    double ss = 0;
    for (int64_t k = 0; k < n; ++k) {
      double v = to_double(x[i * n + k]) + (with_residual ? to_double(r[i * n + k]) : 0.0);
      v = to_double(from_float<T>((float)v));  // the residual sum is rounded to the dtype
      want_h[i * n + k] = v;
      ss += v * v;
    }
    const double inv = 1.0 / std::sqrt(ss / n + 1e-5);
    for (int64_t k = 0; k < n; ++k) want[i * n + k] = to_double(w[k]) * want_h[i * n + k] * inv;
  }
  const std::string ctx = "rows=" + std::to_string(rows) + " n=" + std::to_string(n);
  expect("norm", y.data(), want, tol<T>(), ctx);
  if (with_residual) expect("norm residual", h.data(), want_h, 0.0, ctx);
}

template <typename T>
static void check_rotary(int64_t t, int64_t hq, int64_t hk, int64_t d) {
  auto q = randv<T>(t * hq * d), k = randv<T>(t * hk * d);
  auto cs = randv<float>(t * d / 2), sn = randv<float>(t * d / 2);
  std::vector<T> qo(q.size()), ko(k.size());
  rotary_rows<T>(q.data(), hq * d, d, k.data(), hk * d, d, qo.data(), ko.data(), t, hq, hk, d, cs.data(), sn.data(), d / 2);
  auto ref = [&](const std::vector<T>& x, int64_t heads) {
    std::vector<double> out(x.size());
    for (int64_t i = 0; i < t; ++i)
      for (int64_t hh = 0; hh < heads; ++hh)
        for (int64_t j = 0; j < d / 2; ++j) {
          const T* row = x.data() + (i * heads + hh) * d;
          double x1 = to_double(row[j]), x2 = to_double(row[j + d / 2]), c = cs[i * d / 2 + j], s = sn[i * d / 2 + j];
          out[(i * heads + hh) * d + j] = x1 * c - x2 * s;
          out[(i * heads + hh) * d + j + d / 2] = x2 * c + x1 * s;
        }
    return out;
  };
  expect("rotary q", qo.data(), ref(q, hq), tol<T>(), "d=" + std::to_string(d));
  expect("rotary k", ko.data(), ref(k, hk), tol<T>(), "d=" + std::to_string(d));
}

template <typename T>
static void check_silu(int64_t rows, int64_t inner) {
  auto x = randv<T>(rows * 2 * inner, 6.f);
  std::vector<T> y(rows * inner);
  silu_mul_rows<T>(x.data(), 2 * inner, y.data(), rows, inner);
  std::vector<double> want(y.size());
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < inner; ++j) {
      const double g = to_double(x[i * 2 * inner + j]), u = to_double(x[i * 2 * inner + inner + j]);
      want[i * inner + j] = g / (1.0 + std::exp(-g)) * u;
    }
  expect("silu_mul", y.data(), want, tol<T>(), "inner=" + std::to_string(inner));
}

static void check_store_kv() {
  const int64_t t = 3, hkv = 2, d = 20, slots_n = 8;
  auto src = randv<float>(t * hkv * d);
  std::vector<int64_t> slots = {5, 0, 7};
  std::vector<bf16> cache(slots_n * hkv * d, bf16{0});
  copy_rows<float, bf16>(src.data(), hkv * d, d, cache.data(), slots.data(), t, hkv, d);
  std::vector<double> want(cache.size(), 0.0);
  for (int64_t i = 0; i < t; ++i)
    for (int64_t e = 0; e < hkv * d; ++e) want[slots[i] * hkv * d + e] = bf16_to_float(float_to_bf16(src[i * hkv * d + e]));
  expect("store_kv", cache.data(), want, 0.0, "float32 -> bfloat16");
}

template <typename WT>
static void check_gemv(int64_t M, int64_t K, int64_t N, bool scaled) {
  auto x = randv<float>(M * K);
  std::vector<WT> w(N * K);
  for (auto& v : w) {
    if constexpr (std::is_same_v<WT, int8_t>) v = (int8_t)(urand() * 127); else v = from_float<WT>(urand());
  }
  auto scale = randv<float>(N), bias = randv<float>(N);
  std::vector<float> y(M * N);
  gemv_rows<WT>(x.data(), M, K, w.data(), N, scaled ? scale.data() : nullptr, bias.data(), y.data());
  std::vector<double> want(M * N);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double s = 0;
      for (int64_t k = 0; k < K; ++k) {
        double wv;
        if constexpr (std::is_same_v<WT, int8_t>) wv = w[n * K + k]; else wv = to_double(w[n * K + k]);
        s += x[m * K + k] * wv;
      }
      want[m * N + n] = s * (scaled ? scale[n] : 1.0) + bias[n];
    }
  expect("gemv", y.data(), want, std::is_same_v<WT, int8_t> ? 1e-4 : 2e-5,
         "M=" + std::to_string(M) + " K=" + std::to_string(K) + " N=" + std::to_string(N));
}

// the float32 panel GEMM (panel_gemm.h) on float32 or bfloat16 weights packed by pack_panels, with and without bias
template <typename WT>
static void check_panel_gemm(int64_t M, int64_t K, int64_t N, bool with_bias) {
  auto x = randv<float>(M * K);
  auto w = randv<WT>(N * K);
  auto bias = randv<float>(N);
  std::vector<float> panels(panel_count(N) * K * PANEL_NB, -1.f), y(M * N, -7.f);
  pack_panels<WT>(w.data(), N, K, panels.data());
  panel_gemm(x.data(), M, K, panels.data(), N, with_bias ? bias.data() : nullptr, y.data());
  std::vector<double> want(M * N);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double s = with_bias ? bias[n] : 0.0;
      for (int64_t k = 0; k < K; ++k) s += x[m * K + k] * to_double(w[n * K + k]);
      want[m * N + n] = s;
    }
  expect("panel_gemm", y.data(), want, 2e-5 * std::sqrt((double)K / 64 + 1),
         "M=" + std::to_string(M) + " K=" + std::to_string(K) + " N=" + std::to_string(N));
}

// e4m3 in float64 from its fields (independent of the kernels' bit trick): 2^(e-7) (1 + m/8), or 2^-6 m/8
static double fp8_value(uint8_t b) {
  const int e = (b >> 3) & 15, m = b & 7;
  const double v = e ? std::ldexp(1.0 + m / 8.0, e - 7) : std::ldexp(m / 8.0, -6);
  return (b & 0x80) ? -v : v;
}

// a cache of `rows` rows of D values; a quantised one (int8 / fp8) has each row's float32 scale after
// its values (kv_quant.h), random bytes (no NaN) and scales of either sign's magnitude around 0.01-0.02
template <typename C>
static std::vector<C> rand_cache(int64_t rows, int64_t d) {
  if constexpr (!kQuantKV<C>) {
    return randv<C>(rows * d);
  } else {
    std::vector<C> c(rows * (d + 4));
    for (int64_t r = 0; r < rows; ++r) {
      C* row = c.data() + r * (d + 4);
      for (int64_t j = 0; j < d; ++j) {
        uint8_t byte = (uint8_t)((g_rng = g_rng * 6364136223846793005ull + 1442695040888963407ull) >> 56);
        if constexpr (std::is_same_v<C, int8_t>) row[j] = (int8_t)std::max<int>(-127, (int8_t)byte);
        else row[j].bits = (byte & 0x7F) == 0x7F ? 0 : byte;
      }
      const float s = (std::is_same_v<C, int8_t> ? 1.0f / 127 : 1.0f / 448) * (1.5f + 0.5f * urand());
      std::memcpy(row + d, &s, 4);
    }
    return c;
  }
}

// value j of the cache row at `row` (dequantised: q * scale)
template <typename C>
static double kv_at(const C* row, int64_t j, int64_t d) {
  if constexpr (std::is_same_v<C, int8_t>) return row[j] * (double)row_scale(row, d);
  else if constexpr (std::is_same_v<C, fp8e4m3>) return fp8_value(row[j].bits) * (double)row_scale(row, d);
  else return to_double(row[j]);
}

// every row of block `blk` made NaN (a float cache) or given a NaN scale (a quantised one): a kernel that
// reads it returns NaN
template <typename C>
static void poison_block(std::vector<C>& cache, int64_t blk, int64_t S, int64_t hkv, int64_t d) {
  const int64_t dp = d + kScalePad<C>;
  for (int64_t r = blk * S * hkv; r < (blk + 1) * S * hkv; ++r) {
    C* row = cache.data() + r * dp;
    if constexpr (kQuantKV<C>) {
      const float nan = std::numeric_limits<float>::quiet_NaN();
      std::memcpy(row + d, &nan, 4);
    } else if constexpr (std::is_same_v<C, bf16>) {
      for (int64_t j = 0; j < d; ++j) row[j].bits = 0x7FC0;
    } else {
      for (int64_t j = 0; j < d; ++j) row[j] = std::numeric_limits<float>::quiet_NaN();
    }
  }
}

// window > 0: a sliding layer's decode, each sequence over its last `window` positions; the blocks wholly
// before the window point at a poisoned block (as if freed and reused), which must never be read
template <typename Q, typename C>
static void check_decode(int64_t b, int64_t h, int64_t hkv, int64_t d, int64_t ctx_max, int64_t window = 0) {
  const int64_t S = 16, per_seq = (ctx_max + S - 1) / S, nblk = b * per_seq + 2, dp = d + kScalePad<C>;
  auto q = randv<Q>(b * h * d, 2.f);
  auto kc = rand_cache<C>(nblk * S * hkv, d), vc = rand_cache<C>(nblk * S * hkv, d);
  poison_block(kc, nblk - 1, S, hkv, d);
  poison_block(vc, nblk - 1, S, hkv, d);
  std::vector<int32_t> bt(b * per_seq), cl(b);
  std::vector<int64_t> lo(b, 0);  // each sequence's first visible position
  for (int64_t i = 0; i < b; ++i) {
    cl[i] = (int32_t)std::max<int64_t>(1, ctx_max - 7 * i);
    if (window > 0) lo[i] = std::max<int64_t>(0, cl[i] - window);
    for (int64_t j = 0; j < per_seq; ++j)  // scattered; the slid-out blocks at the poisoned one
      bt[i * per_seq + j] = (j + 1) * S <= lo[i] ? (int32_t)(nblk - 1) : (int32_t)(nblk - 2 - (i * per_seq + j));
  }
  std::vector<Q> out(b * h * d);
  const float scale = 1.0f / std::sqrt((float)d);
  paged_decode_rows<Q, C>(q.data(), h * d, d, kc.data(), vc.data(), S, hkv, d, bt.data(), per_seq, cl.data(), b, h, scale,
                          out.data(), h * d, d, window);
  std::vector<double> want(out.size());
  for (int64_t i = 0; i < b; ++i)
    for (int64_t hh = 0; hh < h; ++hh) {
      const int64_t kh = hh / (h / hkv);
      std::vector<double> sc(cl[i] - lo[i]);  // scores of the visible positions lo .. ctx - 1
      double mx = -1e300, den = 0;
      auto at = [&](const std::vector<C>& cache, int64_t p, int64_t j) {
        return kv_at(cache.data() + ((bt[i * per_seq + p / S] * S + p % S) * hkv + kh) * dp, j, d);
      };
      for (int64_t p = lo[i]; p < cl[i]; ++p) {
        double s = 0;
        for (int64_t j = 0; j < d; ++j) s += to_double(q[(i * h + hh) * d + j]) * at(kc, p, j);
        sc[p - lo[i]] = s * scale;
        mx = std::max(mx, sc[p - lo[i]]);
      }
      for (auto& s : sc) den += (s = std::exp(s - mx));
      for (int64_t j = 0; j < d; ++j) {
        double a = 0;
        for (int64_t p = lo[i]; p < cl[i]; ++p) a += sc[p - lo[i]] * at(vc, p, j);
        want[(i * h + hh) * d + j] = a / den;
      }
    }
  // float32 queries over a quantised cache: the values are exact in float32 once dequantised, so only
  // float32 rounding is left
  const bool all_f32 = std::is_same_v<Q, float> && (std::is_same_v<C, float> || kQuantKV<C>);
  expect(kQuantKV<C> ? "paged_decode (quantised cache)" : "paged_decode", out.data(), want, all_f32 ? 2e-5 : 2e-2,
         "b=" + std::to_string(b) + " h=" + std::to_string(h) + " hkv=" + std::to_string(hkv) + " d=" + std::to_string(d) +
             " ctx=" + std::to_string(ctx_max) + " window=" + std::to_string(window));
}

// MLA's absorbed decode: one KV head of latent rows [c | k_pe] (d = r + R), the values their first dv features;
// against the float64 reference, and equal bit for bit to the full-width decode's first dv outputs
template <typename Q, typename C>
static void check_latent_decode(int64_t b, int64_t h, int64_t d, int64_t dv, int64_t ctx_max) {
  const int64_t S = 16, per_seq = (ctx_max + S - 1) / S, nblk = b * per_seq + 1, dp = d + kScalePad<C>;
  auto q = randv<Q>(b * h * d, 2.f);
  auto cache = rand_cache<C>(nblk * S, d);
  std::vector<int32_t> bt(b * per_seq), cl(b);
  for (int64_t i = 0; i < b; ++i) {
    cl[i] = (int32_t)std::max<int64_t>(1, ctx_max - 7 * i);
    for (int64_t j = 0; j < per_seq; ++j) bt[i * per_seq + j] = (int32_t)(nblk - 1 - (i * per_seq + j));
  }
  std::vector<Q> out(b * h * dv), full(b * h * d);
  const float scale = 1.0f / std::sqrt((float)d);
  latent_decode_rows<Q, C>(q.data(), h * d, d, cache.data(), S, d, dv, bt.data(), per_seq, cl.data(), b, h, scale,
                           out.data(), h * dv, dv);
  paged_decode_rows<Q, C>(q.data(), h * d, d, cache.data(), cache.data(), S, 1, d, bt.data(), per_seq, cl.data(), b, h,
                          scale, full.data(), h * d, d);
  std::vector<double> want(out.size());
  bool same = true;
  for (int64_t i = 0; i < b; ++i)
    for (int64_t hh = 0; hh < h; ++hh) {
      auto at = [&](int64_t p, int64_t j) { return kv_at(cache.data() + (bt[i * per_seq + p / S] * S + p % S) * dp, j, d); };
      std::vector<double> sc(cl[i]);
      double mx = -1e300, den = 0;
      for (int64_t p = 0; p < cl[i]; ++p) {
        double s = 0;
        for (int64_t j = 0; j < d; ++j) s += to_double(q[(i * h + hh) * d + j]) * at(p, j);
        mx = std::max(mx, sc[p] = s * scale);
      }
      for (auto& s : sc) den += (s = std::exp(s - mx));
      for (int64_t j = 0; j < dv; ++j) {
        double a = 0;
        for (int64_t p = 0; p < cl[i]; ++p) a += sc[p] * at(p, j);
        want[(i * h + hh) * dv + j] = a / den;
        same = same && std::memcmp(&out[(i * h + hh) * dv + j], &full[(i * h + hh) * d + j], sizeof(Q)) == 0;
      }
    }
  const bool all_f32 = std::is_same_v<Q, float> && (std::is_same_v<C, float> || kQuantKV<C>);
  const std::string ctx = "b=" + std::to_string(b) + " h=" + std::to_string(h) + " d=" + std::to_string(d) +
                          " dv=" + std::to_string(dv) + " ctx=" + std::to_string(ctx_max);
  expect("latent_decode", out.data(), want, all_f32 ? 2e-5 : 2e-2, ctx);
  ++g_checks;
  if (!same) {
    ++g_fail;
    std::printf("FAIL latent_decode %s: not the full-width decode's first dv outputs\n", ctx.c_str());
  }
}

static void check_layer() {  // the vector layer's own pieces: exp, bfloat16 rounding, the transposed lane sum
  std::vector<float> xs;
  for (float x = -100.f; x < 88.f; x += 0.37f) xs.push_back(x);
  while (xs.size() % W) xs.push_back(0.f);
  std::vector<float> e(xs.size());
  for (size_t i = 0; i < xs.size(); i += W) store(e.data() + i, vexp(load(xs.data() + i)));
  std::vector<double> want(xs.size());
  for (size_t i = 0; i < xs.size(); ++i) want[i] = xs[i] < -87.3f ? 0.0 : std::exp((double)xs[i]);
  // relative 1e-6; below exp(-87.3) the lanes may be 0 or the true denormal (both ~1e-38)
  ++g_checks;
  for (size_t i = 0; i < xs.size(); ++i)
    if (!(std::fabs(e[i] - want[i]) <= 1e-6 * want[i] + 2e-38)) {
      ++g_fail;
      std::printf("FAIL exp(%g) = %.9g want %.9g\n", xs[i], e[i], want[i]);
      break;
    }
  alignas(64) float inf[W];
  for (int i = 0; i < W; ++i) inf[i] = -std::numeric_limits<float>::infinity();
  alignas(64) float z[W];
  store(z, vexp(load(inf)));
  expect("exp(-inf)", z, std::vector<double>(W, 0.0), 0.0, "");
  // bfloat16 rounding of the vector store equals c10's scalar rounding, ties and NaN included
  std::vector<float> vals = {1.0f, 1.00390625f, 1.01171875f, -3.3e38f, 1e-40f, std::nanf(""), 65504.f, 0.1f};
  while (vals.size() % W) vals.push_back(urand() * 1e3f);
  for (int i = 0; i < 64 * W; ++i) vals.push_back(urand() * 10.f);
  std::vector<bf16> got(vals.size());
  for (size_t i = 0; i < vals.size(); i += W) store(got.data() + i, load(vals.data() + i));
  ++g_checks;
  for (size_t i = 0; i < vals.size(); ++i) {
    // AVX512-BF16's VCVTNEPS2BF16 treats denormal inputs as zero (c10 rounds them): the one allowed difference
    const bool denormal = vals[i] != 0.f && std::fabs(vals[i]) < std::numeric_limits<float>::min();
    if (SERVESCOPE_HAS_BF16_DOT && denormal && (got[i].bits & 0x7FFF) == 0) continue;
    if (got[i].bits != float_to_bf16(vals[i]).bits) {
      ++g_fail;
      std::printf("FAIL bf16(%g): 0x%04x want 0x%04x\n", vals[i], got[i].bits, float_to_bf16(vals[i]).bits);
      break;
    }
  }
  vf rows[W];
  std::vector<double> sums(W, 0.0);
  for (int t = 0; t < W; ++t) {
    alignas(64) float r[W];
    for (int j = 0; j < W; ++j) sums[t] += (r[j] = urand());
    rows[t] = load(r);
  }
  alignas(64) float ts[W];
  store(ts, transpose_sum(rows));
  expect("transpose_sum", ts, sums, 1e-6, "");
}

static void check_fp8_widening() {  // every e4m3 byte but the NaNs, through the vector load and the scalar one
  std::vector<fp8e4m3> all;
  std::vector<double> want;
  for (int b = 0; b < 256; ++b)
    if ((b & 0x7F) != 0x7F) {
      all.push_back(fp8e4m3{(uint8_t)b});
      want.push_back(fp8_value((uint8_t)b));
    }
  while (all.size() % W) {
    all.push_back(fp8e4m3{0});
    want.push_back(0.0);
  }
  std::vector<float> got(all.size()), one(all.size());
  for (size_t i = 0; i < all.size(); i += W) store(got.data() + i, load(all.data() + i));
  for (size_t i = 0; i < all.size(); ++i) one[i] = fp8_to_float(all[i]);
  expect("fp8 load", got.data(), want, 0.0, "");
  expect("fp8_to_float", one.data(), want, 0.0, "");
  std::vector<float> tailv(W, -1.f);
  store(tailv.data(), loadn(all.data() + 8, 3));  // a masked tail: lanes past n are 0
  std::vector<double> tw(W, 0.0);
  for (int i = 0; i < 3; ++i) tw[i] = want[8 + i];
  expect("fp8 loadn", tailv.data(), tw, 0.0, "");
}

static void check_fp8_rounding() {  // float_to_fp8 is e4m3's round-to-nearest-even, every value and midpoint
  ++g_checks;
  for (int b = 0; b < 256; ++b) {
    if ((b & 0x7F) == 0x7F) continue;
    const float v = (float)fp8_value((uint8_t)b);
    if (float_to_fp8(v).bits != b) {
      ++g_fail;
      std::printf("FAIL float_to_fp8(%g) = 0x%02x want 0x%02x\n", v, float_to_fp8(v).bits, b);
      return;
    }
    if ((b & 0x7F) == 0x7E) continue;  // 448: no larger neighbour
    const float mid = (float)((fp8_value((uint8_t)b) + fp8_value((uint8_t)(b + 1))) / 2);  // exact in float32
    const int even = (b & 1) ? b + 1 : b;
    if (float_to_fp8(mid).bits != even) {
      ++g_fail;
      std::printf("FAIL float_to_fp8(midpoint %g) = 0x%02x want 0x%02x\n", mid, float_to_fp8(mid).bits, even);
      return;
    }
  }
}

template <typename C, typename X>
static void check_quantize_row(int64_t d) {  // each value within its quantisation error of the float64 input
  const double qmax = std::is_same_v<C, int8_t> ? 127.0 : 448.0;
  for (int rep = 0; rep < 20; ++rep) {
    auto x = randv<X>(d, rep == 0 ? 0.f : 3.f * (1 + rep));  // rep 0: an all-zero row
    std::vector<C> row(d + 4);
    quantize_row<C>(x.data(), d, row.data());
    double amax = 0;
    for (auto& v : x) amax = std::max(amax, std::fabs(to_double(v)));
    const double s = row_scale(row.data(), d);
    ++g_checks;
    bool ok = std::fabs(s - amax / qmax) <= 1e-6 * amax / qmax;
    for (int64_t j = 0; j < d && ok; ++j) {
      const double xv = to_double(x[j]), err = std::fabs(kv_at(row.data(), j, d) - xv);
      const double bound = std::is_same_v<C, int8_t> ? s / 2 : std::fabs(xv) / 16 + s / 1024;
      ok = err <= bound * (1 + 1e-5) + 1e-30;
    }
    if (!ok) {
      ++g_fail;
      std::printf("FAIL quantize_row d=%lld rep=%d\n", (long long)d, rep);
      return;
    }
  }
}

// float32 causal prefill (prefill_f32.h): T tokens at positions ctx - T .. ctx - 1 over scattered blocks, against
// the float64 reference; then the same prompt in two chunks, which must give the same bits token for token
template <int G, int D>
static void check_prefill_f32(int64_t T, int64_t ctx, int64_t hkv) {
  const int64_t S = 16, h = hkv * G, nb = (ctx + S - 1) / S + 1;
  auto q = randv<float>(T * h * D, 2.f), kc = randv<float>(nb * S * hkv * D, 2.f), vc = randv<float>(nb * S * hkv * D);
  std::vector<int32_t> bt(nb);
  for (int64_t i = 0; i < nb; ++i) bt[i] = (int32_t)(nb - 1 - i);
  const float scale = 1.0f / std::sqrt((float)D);
  std::vector<float> out(T * h * D), parts(T * h * D);
  servescope_prefill::prefill_f32_run<G, D>(q.data(), h * D, D, kc.data(), vc.data(), S, hkv, bt.data(), T, ctx, scale,
                                            out.data(), h * D, D);
  std::vector<double> want(out.size());
  auto at = [&](const std::vector<float>& c, int64_t p, int64_t kh, int64_t j) {
    return (double)c[((bt[p / S] * S + p % S) * hkv + kh) * D + j];
  };
  for (int64_t t = 0; t < T; ++t)
    for (int64_t hh = 0; hh < h; ++hh) {
      const int64_t pos = ctx - T + t, kh = hh / G;
      std::vector<double> sc(pos + 1);
      double mx = -1e300, den = 0;
      for (int64_t p = 0; p <= pos; ++p) {
        double s = 0;
        for (int64_t j = 0; j < D; ++j) s += (double)q[(t * h + hh) * D + j] * at(kc, p, kh, j);
        mx = std::max(mx, sc[p] = s * scale);
      }
      for (auto& s : sc) den += (s = std::exp(s - mx));
      for (int64_t j = 0; j < D; ++j) {
        double a = 0;
        for (int64_t p = 0; p <= pos; ++p) a += sc[p] * at(vc, p, kh, j);
        want[(t * h + hh) * D + j] = a / den;
      }
    }
  const std::string ctxs = "G=" + std::to_string(G) + " D=" + std::to_string(D) + " T=" + std::to_string(T) +
                           " ctx=" + std::to_string(ctx);
  expect("prefill_f32", out.data(), want, 2e-5, ctxs);
  const int64_t first = T / 3 + 1;  // chunks [0, first) and [first, T), each over the keys up to its last token
  servescope_prefill::prefill_f32_run<G, D>(q.data(), h * D, D, kc.data(), vc.data(), S, hkv, bt.data(), first,
                                            ctx - T + first, scale, parts.data(), h * D, D);
  servescope_prefill::prefill_f32_run<G, D>(q.data() + first * h * D, h * D, D, kc.data(), vc.data(), S, hkv, bt.data(),
                                            T - first, ctx, scale, parts.data() + first * h * D, h * D, D);
  ++g_checks;
  if (std::memcmp(out.data(), parts.data(), out.size() * sizeof(float)) != 0) {
    ++g_fail;
    std::printf("FAIL prefill_f32 in chunks differs from one call (%s)\n", ctxs.c_str());
  }
}

int main() {
  check_layer();
  for (int64_t n : {64, 100, 576}) {
    check_norm<float>(3, n, false);
    check_norm<float>(3, n, true);
    check_norm<bf16>(3, n, true);
  }
  for (int64_t d : {64, 20}) {
    check_rotary<float>(3, 4, 2, d);
    check_rotary<bf16>(3, 4, 2, d);
  }
  for (int64_t inner : {100, 1536}) {
    check_silu<float>(2, inner);
    check_silu<bf16>(2, inner);
  }
  check_store_kv();
  for (int64_t M : {1, 2, 3, 5, 8, 13})  // rows4_block's blocks of W / 4 rows and every remainder
    for (int64_t K : {64, 100, 576}) {
      check_gemv<float>(M, K, 130, false);
      check_gemv<bf16>(M, K, 7, false);
      check_gemv<int8_t>(M, K, 33, true);
    }
  // every tile height up to two tiles, two row blocks (PANEL_MC + 3); K: one, several chunks; N: a
  // partial panel, whole panels, a tail
  for (int64_t M : std::initializer_list<int64_t>{1, 2, 3, 5, 7, 8, 9, 13, 17, PANEL_MC + 3})
    for (int64_t K : {5, 200, 576})
      for (int64_t N : std::initializer_list<int64_t>{3, 2 * PANEL_NB, 2 * PANEL_NB + 5}) {
        check_panel_gemm<float>(M, K, N, M % 2 == 1);
        if (M < 20) check_panel_gemm<bf16>(M, K, N, true);
      }
  for (int64_t d : {64, 128, 48})
    for (int64_t b : {1, 3})
      for (int64_t ctx : {1, 17, 40}) {
        check_decode<float, float>(b, 6, 2, d, ctx);
        check_decode<float, bf16>(b, 6, 2, d, ctx);
        check_decode<bf16, bf16>(b, 4, 4, d, ctx);
        check_decode<float, int8_t>(b, 6, 2, d, ctx);
        check_decode<float, fp8e4m3>(b, 6, 2, d, ctx);
        check_decode<bf16, int8_t>(b, 4, 4, d, ctx);
      }
  // sliding windows: shorter than a block, a block, across block edges, longer than the context
  for (int64_t d : {64, 128, 48})
    for (int64_t b : {1, 3})
      for (int64_t window : {5, 16, 23, 100}) {
        check_decode<float, float>(b, 6, 2, d, 70, window);
        check_decode<bf16, bf16>(b, 4, 4, d, 70, window);
        check_decode<float, int8_t>(b, 6, 2, d, 70, window);
      }
  // MLA: DeepSeek-V2/V3's 512 + 64, a tiny model's 32 + 16, head dims of the register-tiled kernel, odd widths
  for (auto [d, dv] : std::initializer_list<std::pair<int64_t, int64_t>>{{576, 512}, {48, 32}, {64, 48}, {128, 96}, {40, 33}})
    for (int64_t b : {1, 3}) {
      check_latent_decode<float, float>(b, 5, d, dv, 40);
      check_latent_decode<bf16, bf16>(b, 5, d, dv, 40);
      check_latent_decode<float, int8_t>(b, 5, d, dv, 40);
      check_latent_decode<bf16, int8_t>(b, 5, d, dv, 40);
    }
  for (auto [T, ctx] : std::initializer_list<std::pair<int64_t, int64_t>>{{1, 1}, {37, 37}, {40, 90}, {20, 300}}) {
    check_prefill_f32<3, 64>(T, ctx, 2);
    check_prefill_f32<4, 128>(T, ctx, 1);
    check_prefill_f32<8, 64>(T, ctx, 1);
    check_prefill_f32<1, 64>(T, ctx, 2);
  }
  check_fp8_widening();
  check_fp8_rounding();
  for (int64_t d : {64, 20}) {
    check_quantize_row<int8_t, float>(d);
    check_quantize_row<int8_t, bf16>(d);
    check_quantize_row<fp8e4m3, float>(d);
  }
  std::printf("%s %s: %d checks, %d failed\n", kIsa, g_fail ? "FAILED" : "ok", g_checks, g_fail);
  return std::min(g_fail, 100);
}
