// One MoE layer's routed experts in one call, over packed group-32 weights (int4 / int8, symmetric or
// asymmetric: GGUF Q4_0 / Q4_1 / Q8_0 and the int4 / int8-g32 modes). model/moe.py's grouped_experts, the
// reference, runs about four torch ops per active expert and layer from Python, whose host time was a
// quarter of a batch-1 decode step of OLMoE-1B-7B at 2 threads while it moved no weights.
//
// The same order as the reference: the (token, slot) pairs are grouped by expert (token order within an
// expert), each active expert's gate|up matrix runs over its rows, then silu(gate) * up, then its down
// matrix, and every token sums its experts' outputs times their routing weights. The arithmetic is the
// reference's too: each expert's rows go through the kernel quant_rows would choose for that many rows
// (quant_rows_kernel: AMX-BF16 tiles for bfloat16 rows from QDOT_AMX_BF16_ROWS_*, AMX-INT8 tiles from
// QDOT_AMX_ROWS_* rows where they run, else quant_dot.h's VNNI orders), every
// intermediate is rounded to the activation dtype where the reference's tensors are in it, and a token's
// sum runs in expert order: the result equals the reference's bit for bit (tests/kernels/).
//
// What is fused: the grouping, the gathers and the weighted sum are loops here instead of torch ops; the
// rows of a projection are quantised to int8 once for all experts (each expert reads its slice), and one
// parallel loop covers every active expert's (expert, column block) items cut by cost (rows x columns),
// so two threads split 8 experts' GEMVs without a fork and join per expert. An expert with enough rows for
// the AMX kernel runs it alone over all threads (quant_amx_rows), before the shared loop.
//
// Expert parallelism: the layer's weights may be a subset of its experts, ids first .. first + E - 1;
// pairs routed elsewhere are skipped (their tokens get only the local experts' sum).
// Torch-free (tests/kernels/moe_experts_check.cpp runs it on every ISA path).
#pragma once

#include "kernels.h"
#include "quant_amx_bf16.h"

namespace servescope_moe {

using namespace servescope_simd;
using namespace servescope_quant;

// One layer's local experts: gate_up[e] [2I, H] (gate rows, then up rows) and down[e] [H, I], each
// projection in one packed format (group 32); local expert e is the router's expert first + e
// (MXFP4 too); gpt-oss's experts add biases (per local expert, float32 [2I] and [H]; empty: none) and
// the clamped SwiGLU (MOE_ACT_CLAMPED_SWIGLU: gate = min(gate, limit), up = clamp(up, -limit, limit),
// (up + 1) * gate * sigmoid(alpha * gate))
constexpr int64_t MOE_ACT_SILU = 0, MOE_ACT_CLAMPED_SWIGLU = 1;
struct MoeWeights {
  std::vector<QMatrix> gate_up, down;
  std::vector<const float*> gate_up_bias, down_bias;
  int64_t first = 0, act = MOE_ACT_SILU;
  float alpha = 0.f, limit = 0.f;
};

// The pairs grouped by local expert: start [E + 1] (expert e's pairs are start[e] .. start[e + 1]),
// token [P] of each pair, pair [T * k]: the position of (t, j), -1 where ids[t, j] is not local
struct MoeRoute {
  std::vector<int64_t> start, token, pair;
};

inline void moe_route(const int64_t* ids, int64_t t, int64_t k, int64_t first, int64_t e, MoeRoute& r) {
  r.start.assign(e + 1, 0);
  r.pair.assign(t * k, -1);
  for (int64_t i = 0; i < t * k; ++i)
    if (ids[i] >= first && ids[i] < first + e) ++r.start[ids[i] - first + 1];
  for (int64_t x = 0; x < e; ++x) r.start[x + 1] += r.start[x];
  r.token.resize(r.start[e]);
  std::vector<int64_t> next(r.start.begin(), r.start.end() - 1);
  for (int64_t i = 0; i < t * k; ++i) {
    if (ids[i] < first || ids[i] >= first + e) continue;
    const int64_t p = next[ids[i] - first]++;
    r.pair[i] = p;
    r.token[p] = i / k;
  }
}

// y[mb .. me) rows, columns n0 .. n1, of one expert's matrix over quantised rows mb .. me of a: the
// streaming order for one row, the weight-stationary one from QDOT_TILED_ROWS (quant_dot_rows' choice)
inline void moe_dot(const QMatrix& q, const QActs& a, int64_t mb, int64_t me, int64_t n0, int64_t n1, float* y) {
  const bool tiled = me - mb >= QDOT_TILED_ROWS;
  if (q.mx())
    qdot_any_range<true, FMT_MX>(q, a, mb, me, n0, n1, y, tiled);
  else if (q.int4 && q.asym)
    qdot_any_range<true, FMT_ASYM>(q, a, mb, me, n0, n1, y, tiled);
  else if (q.int4)
    qdot_any_range<true, FMT_SYM>(q, a, mb, me, n0, n1, y, tiled);
  else if (q.asym)
    qdot_any_range<false, FMT_ASYM>(q, a, mb, me, n0, n1, y, tiled);
  else
    qdot_any_range<false, FMT_SYM>(q, a, mb, me, n0, n1, y, tiled);
}

constexpr int64_t MOE_COLS = 64;  // output columns per work item of the shared loop

template <typename T>
void moe_products(const std::vector<QMatrix>& w, const MoeRoute& r, const T* xs, float* y);

// y [P, N] = each active expert's matrix w[e] over its rows of xs [P, kp] (float32 | bfloat16, the pairs'
// rows in expert order), plus its bias where `bias` has them (added in float32 after the products, as
// quant_gemv adds a linear's bias)
template <typename T>
void moe_projection(const std::vector<QMatrix>& w, const MoeRoute& r, const T* xs, float* y,
                    const std::vector<const float*>& bias) {
  moe_products(w, r, xs, y);
  if (bias.empty()) return;
  const int64_t e = (int64_t)w.size(), n = w[0].n;
  parallel_for(0, r.start[e], grain_for(n), [&](int64_t p0, int64_t p1) {
    int64_t x = 0;
    for (int64_t i = p0; i < p1; ++i) {
      while (r.start[x + 1] <= i) ++x;
      const float* b = bias[x];
      float* row = y + i * n;
      int64_t c = 0;
      for (; c + W <= n; c += W) store(row + c, add(load(row + c), load(b + c)));
      if (c < n) storen(row + c, add(loadn(row + c, n - c), loadn(b + c, n - c)), n - c);
    }
  });
}

// moe_products over experts kept in panels (quant_kept.h; their QuantLinears run that kernel at every row count):
// the rows rounded to int8 once for all experts (row by row, as each expert's own call would), then one shared
// loop over every active expert's panels, cut by cost (rows x columns)
template <typename T>
void moe_kept_products(const std::vector<QMatrix>& w, const MoeRoute& r, const T* xs, float* y) {
#if SERVESCOPE_VECTOR_PANELS
  const int64_t e = (int64_t)w.size(), n = w[0].n, panels = n / GEMM_NP;
  std::vector<int64_t> item_e, item_p, cum{0};
  for (int64_t x = 0; x < e; ++x) {
    const int64_t m = r.start[x + 1] - r.start[x];
    for (int64_t p = 0; m && p < panels; ++p) {
      item_e.push_back(x);
      item_p.push_back(p);
      cum.push_back(cum.back() + m * GEMM_NP);
    }
  }
  if (item_e.empty()) return;
  static thread_local GemmActs tls;  // the calling thread's; the workers read it through `a`
  GemmActs& a = tls;
  quantize_gemm_acts(xs, r.start[e], w[0].kp, gemm_offset(w[0]), a);
  parallel_by_cost(cum, num_threads(), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t x = item_e[i], p = item_p[i];
      kept_rows(a, w[x], p, r.start[x], r.start[x + 1], y + p * GEMM_NP);
    }
  });
#else
  (void)w, (void)r, (void)xs, (void)y;
#endif
}

// moe_projection's products (no bias)
template <typename T>
void moe_products(const std::vector<QMatrix>& w, const MoeRoute& r, const T* xs, float* y) {
  if (w[0].panel) return moe_kept_products(w, r, xs, y);
  const int64_t e = (int64_t)w.size(), kp = w[0].kp, n = w[0].n;
  std::vector<int64_t> item_e, item_n, cum{0};  // the shared loop's items: expert, first column; costs
  for (int64_t x = 0; x < e; ++x) {
    const int64_t m = r.start[x + 1] - r.start[x];
    if (m == 0) continue;
    const QRowsKernel kernel = quant_rows_kernel<T>(w[x], m);  // quant_rows' rule
#if SERVESCOPE_HAS_AMX_BF16
    if (kernel == QRowsKernel::AmxBf16) {
      quant_amx_bf16_rows(w[x], xs + r.start[x] * kp, m, nullptr, y + r.start[x] * n);
      continue;
    }
#endif
    if (kernel == QRowsKernel::Gemm) {
      quant_gemm_rows(w[x], xs + r.start[x] * kp, m, nullptr, y + r.start[x] * n);
      continue;
    }
#if SERVESCOPE_HAS_AMX_INT8
    if (kernel == QRowsKernel::Amx) {
      quant_amx_rows(w[x], xs + r.start[x] * kp, m, nullptr, y + r.start[x] * n);
      continue;
    }
#endif
    for (int64_t c = 0; c < n; c += MOE_COLS) {
      item_e.push_back(x);
      item_n.push_back(c);
      cum.push_back(cum.back() + m * std::min(MOE_COLS, n - c));
    }
  }
  if (item_e.empty()) return;
  static thread_local QActs tls;  // the calling thread's; the workers read it through `a`
  QActs& a = tls;
  if (w[0].int4)
    quantize_acts<true>(xs, r.start[e], kp, a, w[0].mx() ? MXFP4_OFFSET : 8);
  else
    quantize_acts<false>(xs, r.start[e], kp, a);
  const int64_t items = (int64_t)item_e.size();
  parallel_by_cost(cum, num_threads(), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1;) {  // a run of one expert's items: one call over its columns
      const int64_t x = item_e[i];
      int64_t j = i + 1;
      while (j < i1 && j < items && item_e[j] == x) ++j;
      moe_dot(w[x], a, r.start[x], r.start[x + 1], item_n[i], std::min(item_n[j - 1] + MOE_COLS, n), y);
      i = j;
    }
  });
}

// h [P, I] = silu(gate) * up of g [P, 2I] float32, rounded to T first where the reference's gate|up
// output is in T (kernels.h's silu_mul, the reference's own kernel)
template <typename T>
void moe_activation(const float* g, int64_t p, int64_t inner, T* h, std::vector<T>& scratch) {
  if constexpr (std::is_same_v<T, float>) {
    servescope_kernels::silu_mul_rows<float>(g, 2 * inner, h, p, inner);
  } else {
    const int64_t total = p * 2 * inner;
    scratch.resize(total);
    parallel_for(0, total, 1 << 16, [&](int64_t i0, int64_t i1) {
      int64_t i = i0;
      for (; i + W <= i1; i += W) store(scratch.data() + i, load(g + i));
      if (i < i1) storen(scratch.data() + i, loadn(g + i, i1 - i), i1 - i);
    });
    servescope_kernels::silu_mul_rows<T>(scratch.data(), 2 * inner, h, p, inner);
  }
}

// h [P, I] = gpt-oss's clamped SwiGLU of g [P, 2I] (gate | up halves; float32, or T: moe_dense's and the
// modules' clamped_swiglu), in float32 with each input rounded to T first and the result rounded to T (the
// reference's tensors are in T). Every element takes the same vector code wherever it lies in its row (the tail
// through masked loads), so rows give the same bits alone or in any batch.
template <typename T, typename S = float>
void moe_clamped_swiglu(const S* g, int64_t p, int64_t inner, float alpha, float limit, T* h) {
  parallel_for(0, p, grain_for(inner), [&](int64_t r0, int64_t r1) {
    const vf one = set1(1.0f), lim = set1(limit), nlim = set1(-limit), na = set1(-alpha);
    for (int64_t i = r0; i < r1; ++i) {
      const S* gr = g + i * 2 * inner;
      for (int64_t j = 0; j < inner; j += W) {
        const int64_t m = std::min<int64_t>(W, inner - j);
        const vf gate = min(rnd<T>(loadn(gr + j, m)), lim);
        const vf up = min(max(rnd<T>(loadn(gr + inner + j, m)), nlim), lim);
        const vf glu = div(gate, add(one, vexp(mul(gate, na))));  // gate * sigmoid(alpha * gate)
        storen(h + i * inner + j, mul(add(up, one), glu), m);
      }
    }
  });
}

// out[t] = sum over t's local pairs, in expert order, of rnd(rnd(y[pair]) * w[t, j]), the sum in float32
// and rounded to T once (the reference: y to T, times the weight in T, then index_add_, which sums a
// bfloat16 destination in float32); 0 for a token without a local expert
template <typename T>
void moe_combine(const MoeRoute& r, const float* y, const float* wts, int64_t t, int64_t k, int64_t hdim, T* out) {
  parallel_for(0, t, grain_for(hdim * k), [&](int64_t t0, int64_t t1) {
    std::vector<std::pair<int64_t, float>> pw;
    for (int64_t i = t0; i < t1; ++i) {
      pw.clear();
      for (int64_t j = 0; j < k; ++j)
        if (r.pair[i * k + j] >= 0) pw.emplace_back(r.pair[i * k + j], wts[i * k + j]);
      std::sort(pw.begin(), pw.end());  // the pairs lie in expert order
      for (int64_t c = 0; c < hdim; c += W) {
        const int64_t m = std::min<int64_t>(W, hdim - c);
        vf acc = zero();
        for (const auto& [p, wt] : pw)
          acc = add(acc, rnd<T>(mul(rnd<T>(loadn(y + p * hdim + c, m)), set1(wt))));
        storen(out + i * hdim + c, acc, m);
      }
    }
  });
}

// Scratch of the calling thread, kept between calls (a decode step calls once per layer)
template <typename T>
struct MoeScratch {
  MoeRoute route;
  std::vector<T> xs, h, cast;
  std::vector<float> gate_up, down;
};

// x [T, H] (H = the gate|up matrices' kp), ids / wts [T, k] -> out [T, H] and counts [E] (the pairs per
// local expert)
template <typename T>
void moe_packed(const MoeWeights& ex, const T* x, int64_t t, const int64_t* ids, const float* wts, int64_t k, T* out,
                int64_t* counts) {
  static thread_local MoeScratch<T> tls;  // the calling thread's; the workers read it through `s`
  MoeScratch<T>& s = tls;
  const int64_t e = (int64_t)ex.gate_up.size(), hdim = ex.gate_up[0].kp, inner = ex.gate_up[0].n / 2;
  moe_route(ids, t, k, ex.first, e, s.route);
  const int64_t p = s.route.start[e];
  for (int64_t x = 0; x < e; ++x) counts[x] = s.route.start[x + 1] - s.route.start[x];
  s.xs.resize(p * hdim);
  parallel_for(0, p, grain_for(hdim, 1 << 16), [&](int64_t p0, int64_t p1) {
    for (int64_t i = p0; i < p1; ++i)
      std::memcpy(s.xs.data() + i * hdim, x + s.route.token[i] * hdim, hdim * sizeof(T));
  });
  s.gate_up.resize(p * 2 * inner);
  moe_projection(ex.gate_up, s.route, s.xs.data(), s.gate_up.data(), ex.gate_up_bias);
  s.h.resize(p * inner);
  if (ex.act == MOE_ACT_CLAMPED_SWIGLU)
    moe_clamped_swiglu(s.gate_up.data(), p, inner, ex.alpha, ex.limit, s.h.data());
  else
    moe_activation(s.gate_up.data(), p, inner, s.h.data(), s.cast);
  s.down.resize(p * hdim);
  moe_projection(ex.down, s.route, s.h.data(), s.down.data(), ex.down_bias);
  moe_combine(s.route, s.down.data(), wts, t, k, hdim, out);
}

}  // namespace servescope_moe
