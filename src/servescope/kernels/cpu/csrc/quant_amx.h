// Packed group-32 weights times many activation rows on AMX-INT8 tiles (Sapphire Rapids and later Xeons):
// the same arithmetic as quant_dot.h (activations rounded to int8 per 32-block with one float scale each,
// int8 x int8 -> int32 per block, only the block's int32 scaled in float), with one TDPBSSD doing a
// 16 x 16 x 32 block product (8192 multiply-adds) where VNNI does 64 per instruction. On a CPU whose
// bfloat16 GEMM also runs on tiles, this is what keeps packed weights ahead of bfloat16 dense once a
// decode batch has a dozen rows (docs/BENCHMARKS.md, issue 35 section).
//
// Result, for every (m, n): y = sum over blocks b of dw[n,b] dx[m,b] sum_k w[n,k] q[m,k] (+ mw[n,b] dx[m,b]
// sum_k q[m,k] when asymmetric), w the stored integers as signed bytes (symmetric int4 as u - 8, asymmetric
// int4 as u): the dequantised weight times the dequantised activations, as quant_dot.h computes it, up to
// float32 summation order. Each activation row is a lane of its own, so a row's result does not depend on
// the other rows of the call.
//
// Layout: A = 16 weight rows x one 32-block (a panel: int4 rows unpacked to int8 once per block of
// activation tiles into a 16 x kp buffer; int8 rows read where they lie), B = the block's 8 k-quads x 16
// activation rows (the activations re-laid when they are quantised), C = 16 x 16 int32, stored per block and
// scaled into 16 float vectors (lane = activation row) that stay in registers over the blocks.
// Where the time goes (docs/BENCHMARKS.md, "packed decode on AMX" section): at 16 rows the panel's weight
// reads, so the next panel is prefetched while this one computes and the float scaling of 4 blocks runs while
// the next 4 blocks' tile products are in flight; per extra activation tile, the per-block C store and
// float scaling (3 vector operations per C row), which group-32 scales leave no way to skip.
//
// Compiled where the compiler targets AMX (-mamx-tile -mamx-int8, extension.py adds them on a CPU with
// amx_int8); used only when the kernel grants the tile state (amx_ready); quant_dot.h's VNNI kernels
// otherwise. SERVESCOPE_HAS_AMX_INT8 says whether it is compiled in.
#pragma once

#include "quant_dot.h"

#if defined(SERVESCOPE_ISA_AVX512) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define SERVESCOPE_HAS_AMX_INT8 1
#include <sys/syscall.h>
#include <unistd.h>
#else
#define SERVESCOPE_HAS_AMX_INT8 0
#endif

namespace servescope_quant {

#if SERVESCOPE_HAS_AMX_INT8

constexpr int64_t AMX_T = 16;  // weight rows per panel and activation rows per tile
constexpr int64_t AMX_ACT_BYTES = 1 << 20;

// Linux hands out the tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA),
// once per process; a kernel that refuses leaves the VNNI kernels
inline bool amx_ready() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tmm0..3: C of 4 consecutive blocks (their products in flight together: one block's load, product and
// store back to back is a chain of latencies), tmm4 / tmm5: A, tmm6 / tmm7: B, alternating. The
// configuration is thread state that oneDNN's own tile kernels replace in the same threads, so every task
// loads it and releases the tiles when done.
inline void amx_configure() {
  TileConfig c;
  for (int i = 0; i < 4; ++i) c.rows[i] = AMX_T, c.colsb[i] = AMX_T * 4;
  for (int i = 4; i < 6; ++i) c.rows[i] = AMX_T, c.colsb[i] = 32;
  for (int i = 6; i < 8; ++i) c.rows[i] = 8, c.colsb[i] = AMX_T * 4;
  _tile_loadconfig(&c);
}

// C tile c = the block product of the A rows at pa (stride lda) in tile a and the B quads at pb in tile b
// (stored later: a tile store right after its product waits out the product's latency, and the
// instructions behind it with it). Macros: GCC's tile intrinsics take the tile numbers as literal tokens.
#define SERVESCOPE_AMX_DOT(c, a, b, pa, lda, pb) \
  do {                                           \
    _tile_loadd(a, pa, lda);                     \
    _tile_loadd(b, pb, AMX_T * 4);               \
    _tile_zero(c);                               \
    _tile_dpbssd(c, a, b);                       \
  } while (0)

// The activations for the tiles: int8 [tiles][nb][8 quads][16 rows][4] and per (tile, block) the 16 rows'
// scales dx and dx * sum(q) (the asymmetric offset's factor); rows past M are zeros
struct AmxActs {
  int64_t tiles = 0, nb = 0;
  std::vector<int8_t> q;
  std::vector<float> dx, sx;
};

template <typename T>
inline void quantize_amx_acts(const T* x, int64_t M, int64_t kp, AmxActs& a) {
  a.nb = kp / 32;
  a.tiles = (M + AMX_T - 1) / AMX_T;
  a.q.assign(a.tiles * a.nb * 32 * AMX_T, 0);
  a.dx.assign(a.tiles * a.nb * AMX_T, 0.f);
  a.sx.assign(a.tiles * a.nb * AMX_T, 0.f);
  parallel_for(0, M, grain_for(kp), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t b = 0; b < a.nb; ++b) {
        int8_t qb[32];
        float d;
        const int32_t sum = quantize_block(x + m * kp + b * 32, qb, &d);
        const int64_t tb = (m / AMX_T) * a.nb + b, r = m % AMX_T;
        for (int j = 0; j < 8; ++j) std::memcpy(a.q.data() + ((tb * 8 + j) * AMX_T + r) * 4, qb + 4 * j, 4);
        a.dx[tb * AMX_T + r] = d;
        a.sx[tb * AMX_T + r] = d * (float)sum;
      }
  });
}

// A panel: weight rows n0 .. n0 + 16 as the A operand (signed bytes, `a` with row stride `lda`) and their
// scales as floats, row r's at d[r * ld ..] (ld = nb, or 2 nb interleaved d, m when asymmetric); rows past
// N are zeros. int8 rows are read where they lie (no copy) unless the panel is partial.
struct AmxPanel {
  const int8_t* a = nullptr;
  int64_t lda = 0, ld = 0;
  float* d = nullptr;
};

// 64 packed int4 bytes (4 blocks of one row) -> 128 signed bytes in element order (block b: its 16 low
// nibbles, elements 0..15, then its 16 high ones)
inline void amx_unpack4(const uint8_t* w, int8_t* dst, __m512i off) {
  const __m512i mask = _mm512_set1_epi8(15);
  const __m512i v = _mm512_loadu_si512(w);
  const __m512i lo = _mm512_sub_epi8(_mm512_and_si512(v, mask), off);
  const __m512i hi = _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(v, 4), mask), off);
  const __m512i first = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
  const __m512i second = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
  _mm512_storeu_si512(dst, _mm512_permutex2var_epi64(lo, first, hi));
  _mm512_storeu_si512(dst + 64, _mm512_permutex2var_epi64(lo, second, hi));
}

// amx_unpack4 for MXFP4's nibbles: their table values (MXFP4_VALUES) instead of u - 8
inline void amx_unpack4_mx(const uint8_t* w, int8_t* dst) {
  const __m512i mask = _mm512_set1_epi8(15);
  const __m512i table = _mm512_broadcast_i32x4(_mm_load_si128((const __m128i*)MXFP4_VALUES));
  const __m512i v = _mm512_loadu_si512(w);
  const __m512i lo = _mm512_shuffle_epi8(table, _mm512_and_si512(v, mask));
  const __m512i hi = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(v, 4), mask));
  const __m512i first = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
  const __m512i second = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
  _mm512_storeu_si512(dst, _mm512_permutex2var_epi64(lo, first, hi));
  _mm512_storeu_si512(dst + 64, _mm512_permutex2var_epi64(lo, second, hi));
}

// The panel's rows (row n0 on, up to N) unpacked into pw (row stride kp), row by row (one sequential
// stream: reading the 16 rows' blocks side by side measured slower)
inline void amx_unpack(const QMatrix& q, int64_t n0, int8_t* pw) {
  const int64_t rb = q.row_bytes(), rows = std::min<int64_t>(AMX_T, q.n - n0), nb = q.kp / 32;
  const uint8_t* w = q.w + n0 * rb;
  if (!q.int4) {
    for (int64_t r = 0; r < rows; ++r) std::memcpy(pw + r * q.kp, w + r * rb, q.kp);
    return;
  }
  const __m512i off = _mm512_set1_epi8(q.asym ? 0 : 8);
  if (q.mx()) {  // MXFP4: the table's signed values (MXFP4_VALUES), bytes in the same order
    for (int64_t r = 0; r < rows; ++r) {
      alignas(64) uint8_t tail[64] = {};
      for (int64_t b = 0; b < nb; b += 4) {
        const int64_t n = std::min<int64_t>(4, nb - b);
        const uint8_t* src = w + r * rb + b * 16;
        if (n < 4) std::memcpy(tail, src, n * 16), src = tail;
        alignas(64) int8_t out[128];
        amx_unpack4_mx(src, out);
        std::memcpy(pw + r * q.kp + b * 32, out, n * 32);
      }
    }
    return;
  }
  for (int64_t r = 0; r < rows; ++r) {  // byte j of a block: element j (low nibble) and j + 16 (high)
    int64_t b = 0;
    for (; b + 4 <= nb; b += 4) amx_unpack4(w + r * rb + b * 16, pw + r * q.kp + b * 32, off);
    if (b < nb) {  // the last 1-3 blocks through a zero-padded copy
      alignas(64) uint8_t tail[64] = {};
      alignas(64) int8_t out[128];
      std::memcpy(tail, w + r * rb + b * 16, (nb - b) * 16);
      amx_unpack4(tail, out, off);
      std::memcpy(pw + r * q.kp + b * 32, out, (nb - b) * 32);
    }
  }
}

inline AmxPanel amx_panel(const QMatrix& q, int64_t n0, int8_t* pw, float* pd) {
  const int64_t nb = q.kp / 32, rb = q.row_bytes(), sc = q.asym ? 2 : 1, ld = nb * sc;
  const bool whole = n0 + AMX_T <= q.n, direct = whole && !q.int4;
  AmxPanel p{direct ? (const int8_t*)q.w + n0 * rb : pw, direct ? rb : q.kp, ld, pd};
  if (!direct) amx_unpack(q, n0, pw);
  for (int64_t r = 0; r < AMX_T; ++r) {
    float* d = pd + r * ld;
    if (n0 + r >= q.n) {
      std::memset(pw + r * q.kp, 0, q.kp);
      std::fill(d, d + ld, 0.f);
      continue;
    }
    if (q.mx()) {
      for (int64_t b = 0; b < nb; ++b) d[b] = e8m0_half(q.e8m0[(n0 + r) * nb + b]);
      continue;
    }
    const uint16_t* s = q.scales + (n0 + r) * ld;
    for (int64_t i = 0; i < ld; i += 16) {
      const __mmask16 k = (__mmask16)(ld - i >= 16 ? 0xFFFF : (1u << (ld - i)) - 1);
      _mm512_mask_storeu_ps(d + i, k, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, s + i)));
    }
  }
  return p;
}

// Bring the next panel's packed rows towards L1 while this one computes: bytes from .. from + bytes of each
// of its 16 rows per call (the kernel's block loop spreads the rows over its first activation tile)
inline void amx_prefetch_rows(const uint8_t* w, int64_t rb, int64_t from, int64_t bytes) {
  for (int64_t r = 0; r < AMX_T; ++r)
    for (int64_t o = from; o < std::min(from + bytes, rb); o += 64)
      _mm_prefetch((const char*)w + r * rb + o, _MM_HINT_T0);
}

// acc[r] += the scaled products of blocks b0 .. b0 + nbk whose int32 C tiles are at c[0..nbk)
template <bool ASYM>
inline void amx_scale(const AmxActs& a, int64_t t, const AmxPanel& p, int64_t b0, int64_t nbk,
                      const int32_t (*c)[AMX_T * AMX_T], __m512* acc) {
  for (int64_t j = 0; j < nbk; ++j) {
    const int64_t b = b0 + j, tb = t * a.nb + b;
    const __m512 dx = _mm512_loadu_ps(a.dx.data() + tb * AMX_T);
    for (int r = 0; r < AMX_T; ++r) {
      const __m512 s = _mm512_mul_ps(_mm512_set1_ps(p.d[r * p.ld + b * (ASYM ? 2 : 1)]), dx);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c[j] + r * AMX_T)), s, acc[r]);
    }
    if constexpr (ASYM) {
      const __m512 sx = _mm512_loadu_ps(a.sx.data() + tb * AMX_T);
      for (int r = 0; r < AMX_T; ++r)
        acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(p.d[r * p.ld + b * 2 + 1]), sx, acc[r]);
    }
  }
}

// acc[r] lane i = y[tile row i][panel row r] for one activation tile t against the panel; while it runs,
// the rows at `next` (the following panel, row stride rb; null for none) are prefetched. Software-pipelined:
// the tile products of 4 blocks are issued before the float scaling of the 4 before them, so that the
// scaling's loads never wait on the products' latency (two sets of C buffers).
template <bool ASYM>
inline void amx_tile(const AmxActs& a, int64_t t, const AmxPanel& p, const uint8_t* next, int64_t rb,
                     float* out) {
  alignas(64) int32_t c[2][4][AMX_T * AMX_T];
  __m512 acc[AMX_T];
  for (auto& v : acc) v = _mm512_setzero_ps();
  const int8_t* qt = a.q.data() + t * a.nb * 8 * AMX_T * 4;
  const int64_t lda = p.lda, pf = next ? (rb * 4 + a.nb - 1) / a.nb : 0;  // prefetch bytes per 4 blocks
  int64_t prev = -1;
  for (int64_t b0 = 0; b0 < a.nb; b0 += 4) {
    const int64_t nbk = std::min<int64_t>(4, a.nb - b0);
    const int8_t *pa = p.a + b0 * 32, *pb = qt + b0 * 8 * AMX_T * 4;
    constexpr int64_t QB = 8 * AMX_T * 4;  // B bytes per block
    int32_t(*cg)[AMX_T * AMX_T] = c[(b0 / 4) & 1];
    SERVESCOPE_AMX_DOT(0, 4, 6, pa, lda, pb);
    if (nbk > 1) SERVESCOPE_AMX_DOT(1, 5, 7, pa + 32, lda, pb + QB);
    if (nbk > 2) SERVESCOPE_AMX_DOT(2, 4, 6, pa + 64, lda, pb + 2 * QB);
    if (nbk > 3) SERVESCOPE_AMX_DOT(3, 5, 7, pa + 96, lda, pb + 3 * QB);
    if (next) amx_prefetch_rows(next, rb, (b0 / 4) * pf, pf);
    if (prev >= 0) amx_scale<ASYM>(a, t, p, prev, 4, c[(prev / 4) & 1], acc);
    _tile_stored(0, cg[0], AMX_T * 4);
    if (nbk > 1) _tile_stored(1, cg[1], AMX_T * 4);
    if (nbk > 2) _tile_stored(2, cg[2], AMX_T * 4);
    if (nbk > 3) _tile_stored(3, cg[3], AMX_T * 4);
    prev = b0;
  }
  if (prev >= 0) amx_scale<ASYM>(a, t, p, prev, a.nb - prev, c[(prev / 4) & 1], acc);
  for (int r = 0; r < AMX_T; ++r) _mm512_storeu_ps(out + r * AMX_T, acc[r]);
}

// A C tile's float results, c[r * 16 + i] = y[row i][column n0 + r] (weight rows down, activation rows
// across), into y (row stride ldy; rows < `rows`, columns n0 .. n0 + cols) plus bias[n0 + r] where there is
// one: the AMX kernels' last step per (panel, activation tile)
inline void amx_store_transposed(const float* c, int64_t rows, int64_t cols, const float* bias, int64_t n0,
                                 float* y, int64_t ldy) {
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t r = 0; r < cols; ++r) y[i * ldy + n0 + r] = c[r * AMX_T + i] + (bias ? bias[n0 + r] : 0.f);
}

// x [M, kp] float32 | bfloat16 (zeros past K), group-32 packed q, bias [N] or null -> y [M, N]. Panels of
// 16 weight rows are split over the threads; each unpacks its panel, then every activation tile meets it.
template <typename T>
inline void quant_amx_rows(const QMatrix& q, const T* x, int64_t M, const float* bias, float* y) {
  static thread_local AmxActs tls;  // the calling thread's; the workers read it through `a`
  AmxActs& a = tls;
  quantize_amx_acts(x, M, q.kp, a);
  const int64_t panels = (q.n + AMX_T - 1) / AMX_T, nb = a.nb, rb = q.row_bytes();
  parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    amx_configure();
    static thread_local std::vector<int8_t> pw;
    static thread_local std::vector<float> pd;
    pw.resize(AMX_T * q.kp);
    pd.resize(nb * 2 * AMX_T);
    alignas(64) float out[AMX_T * AMX_T];
    // activation tiles in blocks whose bytes stay in L2 while the thread's panels pass (a panel is
    // unpacked once per block of tiles)
    const int64_t block = std::max<int64_t>(1, AMX_ACT_BYTES / (AMX_T * q.kp));
    for (int64_t t0 = 0; t0 < a.tiles; t0 += block)
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t n0 = p * AMX_T, cols = std::min<int64_t>(AMX_T, q.n - n0);
        const AmxPanel pan = amx_panel(q, n0, pw.data(), pd.data());
        // the next panel's rows, while the first tile computes (whole panels only: the last may be short)
        const uint8_t* next = p + 1 < p1 && n0 + 2 * AMX_T <= q.n ? q.w + (n0 + AMX_T) * rb : nullptr;
        for (int64_t t = t0; t < std::min(a.tiles, t0 + block); ++t) {
          const uint8_t* pf = t == t0 ? next : nullptr;
          if (q.asym)
            amx_tile<true>(a, t, pan, pf, rb, out);
          else
            amx_tile<false>(a, t, pan, pf, rb, out);
          amx_store_transposed(out, std::min<int64_t>(AMX_T, M - t * AMX_T), cols, bias, n0, y + t * AMX_T * q.n, q.n);
        }
      }
    _tile_release();
  });
}

#endif  // SERVESCOPE_HAS_AMX_INT8

// Whether the AMX kernel runs here: compiled in and granted the tiles
inline bool amx_available() {
#if SERVESCOPE_HAS_AMX_INT8
  return amx_ready();
#else
  return false;
#endif
}

// From this many rows of x on, the AMX kernel where it runs (docs/BENCHMARKS.md, "The AMX-INT8 kernel's
// per-panel costs" section: below, its fixed cost per weight panel and block exceeds the VNNI orders' work;
// int8 weights cost the VNNI orders twice the bytes and instructions of int4, and AMX reads int8 panels in
// place, so they cross over sooner)
constexpr int64_t QDOT_AMX_ROWS_INT4 = 8, QDOT_AMX_ROWS_INT8 = 4;

}  // namespace servescope_quant
