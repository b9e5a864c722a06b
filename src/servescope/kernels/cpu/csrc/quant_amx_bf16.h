// Packed group-32 weights times many bfloat16 activation rows on AMX-BF16 tiles, and quant_rows, the entry that
// picks a packed kernel by rows.
//
// Why a second AMX kernel: quant_amx.h's integer products pay, per 16 x 16 tile and per 32-block, a C tile
// store and a float rescale (group-32 scales), ~3x the tile products themselves, and that work grows with every
// activation tile. Here a panel of 32 weight rows is dequantised once (the block's scale, and Q4_1's offset,
// folded in; rounded to bfloat16 as dequantize_rows rounds it) into a row-major bfloat16 buffer that stays in L2,
// and each pair of activation tiles meets it in TDPBF16PS products over the whole K with fp32 accumulators that
// never leave the tiles: no per-block store or rescale at all. The dequantisation (~6 vector operations per 32
// 4-bit weights: two blocks' tables in one register, amx_bf16_k) is paid once per panel whatever the rows, so
// the kernel wins from a few dozen rows on (QDOT_AMX_BF16_ROWS_*, measured).
//
// Result, for every (m, n): y = sum_k bf16(w[n, k]) bf16(x[m, k]) in float32 (the products exact, summed in
// float32 by the tiles), w[n, k] the dequantised weight (d u + m, or d (u - 8), or the MXFP4 value times its
// scale) rounded to bfloat16: what dequantise-to-bfloat16 + a bfloat16 GEMM computes, the same precision as the
// dense bfloat16 path. Auto runs it for bfloat16 activations only (float32 ones keep the integer kernels'
// arithmetic: a float32 model asked for more than bfloat16 weights). Each activation row is a column of its
// own in the C tiles, so a row's result does not depend on the other rows of the call.
//
// Layout: A = 16 weight rows x one slot (32 k) of the chunk buffer (block-major, amx_bf16_chunk), B = the same
// slot of 16 activation rows as 16 k-pairs x 16 rows x 2 (re-laid once per call; 4-bit weights' slots hold two
// blocks' halves, amx_bf16_k: the sum over K is the same, in another float32 order), C = weight row x
// activation row, transposed into y once per (panel, tile) at the end of K. Tiles: tmm0..3 C (2 weight halves
// x 2 activation tiles), tmm4 / tmm5 the two A halves, tmm6 / tmm7 the two B tiles.
//
// Compiled where the compiler targets AMX-BF16 and AVX512-BF16 as well as AMX-INT8 (extension.py adds the flags
// on a CPU that has them); used only when the kernel grants the tile state (amx_ready). SERVESCOPE_HAS_AMX_BF16
// says whether it is compiled in.
#pragma once

#include "quant_amx.h"
#include "quant_kept.h"

#if SERVESCOPE_HAS_AMX_INT8 && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define SERVESCOPE_HAS_AMX_BF16 1
#else
#define SERVESCOPE_HAS_AMX_BF16 0
#endif

namespace servescope_quant {

#if SERVESCOPE_HAS_AMX_BF16

constexpr int64_t AMX_BF16_PANEL = 2 * AMX_T;  // weight rows dequantised together (the two A halves)
constexpr int64_t AMX_BF16_KC = 16;            // blocks per dequantised chunk (32 KiB of bfloat16: L1)
static_assert(AMX_BF16_KC % 2 == 0, "a chunk holds whole pairs of blocks (amx_bf16_k)");

// The K order of the tiles (slot b: 32 positions, a block's worth): 4-bit weights' blocks go in pairs (2i,
// 2i + 1; a last odd block alone), slot 2i holding block 2i's elements 0..15 then block 2i + 1's 0..15 and
// slot 2i + 1 both blocks' 16..31, the order of the nibbles in the bytes, so that one table permute makes 32
// weights of two blocks; int8 blocks keep theirs. The element of a row that slot b position p holds:
inline int64_t amx_bf16_k(int64_t b, int64_t p, int64_t nb, bool paired) {
  if (!paired || (b % 2 == 0 && b + 1 >= nb)) return b * 32 + p;
  const int64_t first = b - b % 2;  // the pair's first block
  if (b == first) return p < 16 ? first * 32 + p : (first + 1) * 32 + p - 16;
  return p < 16 ? first * 32 + 16 + p : (first + 1) * 32 + p;
}

// The activations as B tiles: bf16 bits [tiles][nb][16 k-pairs][16 rows][2] in the weights' K order
// (amx_bf16_k); rows past M are zeros
struct AmxBf16Acts {
  int64_t tiles = 0, nb = 0;
  std::vector<uint32_t> v;  // one k-pair per element
};

inline uint16_t bf16_bits(servescope_simd::bf16 h) { return h.bits; }
inline uint16_t bf16_bits(float f) { return servescope_simd::float_to_bf16(f).bits; }

template <typename T>
inline void relay_bf16_acts(const T* x, int64_t M, int64_t kp, bool paired, AmxBf16Acts& a) {
  a.nb = kp / 32;
  a.tiles = (M + AMX_T - 1) / AMX_T;
  a.v.resize(a.tiles * a.nb * 16 * AMX_T);
  parallel_for(0, a.tiles * AMX_T, grain_for(kp), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const int64_t t = m / AMX_T, r = m % AMX_T;
      for (int64_t b = 0; b < a.nb; ++b) {
        uint32_t* dst = a.v.data() + ((t * a.nb + b) * 16) * AMX_T + r;
        // positions 0..15 and 16..31 of the slot: two runs of 16 neighbours in x
        const T *lo = x + m * kp + amx_bf16_k(b, 0, a.nb, paired), *hi = x + m * kp + amx_bf16_k(b, 16, a.nb, paired);
        for (int j = 0; j < 16; ++j) {
          const T* src = j < 8 ? lo + 2 * j : hi + 2 * j - 16;
          dst[j * AMX_T] = m < M ? bf16_bits(src[0]) | (uint32_t)bf16_bits(src[1]) << 16 : 0u;
        }
      }
    }
  });
}

// Blocks b0 .. b0 + n (n <= 16) of weight row n: their scales d and offsets m as floats (m = -8 d for
// symmetric int4, 0 for int8 and MXFP4), so that the block loop broadcasts them from memory
inline void amx_bf16_scales(const QMatrix& q, int64_t row, int64_t b0, int64_t n, float* d, float* m) {
  const int64_t nb = q.kp / 32;
  const __mmask16 k = (__mmask16)(n >= 16 ? 0xFFFF : (1u << n) - 1);
  __m512 dv, mv = _mm512_setzero_ps();
  if (q.mx()) {
    for (int64_t j = 0; j < n; ++j) d[j] = e8m0_half(q.e8m0[row * nb + b0 + j]), m[j] = 0.f;
    return;
  }
  if (q.asym) {  // (d, m) pairs as one 32-bit lane each
    const __m512i v = _mm512_maskz_loadu_epi32(k, q.scales + (row * nb + b0) * 2);
    dv = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v));
    mv = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(v, 16)));
  } else {
    dv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, q.scales + row * nb + b0));
    if (q.int4) mv = _mm512_mul_ps(dv, _mm512_set1_ps(-8.f));
  }
  _mm512_storeu_ps(d, dv);
  _mm512_storeu_ps(m, mv);
}

// Blocks b0 .. b0 + nbk (nbk <= 16, b0 even) of weight row `row` as bfloat16, slot b0 + j's 32 at dst + j *
// stride (4-bit blocks in the paired K order, amx_bf16_k): dequantize_rows's arithmetic (u d + m in one fused
// multiply-add, q d, MXFP4's table value times its scale), rounded to nearest even as it rounds. 4-bit blocks
// go through a 16-entry bfloat16 table per block (its 16 values computed once; a pair's two tables in one
// register, then one word permute per 32 weights); int8 blocks widen to float.
inline void amx_bf16_row(const QMatrix& q, int64_t row, int64_t b0, int64_t nbk, uint16_t* dst, int64_t stride) {
  const uint8_t* w = q.w + row * q.row_bytes();
  alignas(64) float ds[16], ms[16];
  // a 4-bit code's value before scaling: u, or MXFP4's table value
  const __m512 vv = q.mx() ? _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_load_si128((const __m128i*)MXFP4_VALUES)))
                           : _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m256i m4 = _mm256_set1_epi16(15);
  amx_bf16_scales(q, row, b0, nbk, ds, ms);
  // a pair's indices: words 16..31 (the second block's nibbles) look up the table's second half
  const __m512i second = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(16), 1);
  const __m512i m15 = _mm512_set1_epi16(15);
  for (int64_t j = 0; j < nbk; ++j) {
    const int64_t b = b0 + j;
    const __m512 d = _mm512_set1_ps(ds[j]), mo = _mm512_set1_ps(ms[j]);
    if (q.int4 && j + 1 < nbk) {  // blocks b, b + 1 into slots j, j + 1
      const __m512 d1 = _mm512_set1_ps(ds[j + 1]), mo1 = _mm512_set1_ps(ms[j + 1]);
      const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(_mm512_fmadd_ps(vv, d1, mo1), _mm512_fmadd_ps(vv, d, mo));
      const __m512i u = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(w + b * 16)));
      const __m512i lo = _mm512_ternarylogic_epi32(u, m15, second, 0xEA);  // (u & 15) | second
      const __m512i hi = _mm512_or_si512(_mm512_srli_epi16(u, 4), second);
      _mm512_storeu_si512(dst + j * stride, _mm512_permutexvar_epi16(lo, table));
      _mm512_storeu_si512(dst + (j + 1) * stride, _mm512_permutexvar_epi16(hi, table));
      ++j;
      continue;
    }
    if (q.int4) {  // a last odd block alone, in its own order
      const __m512i table = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(_mm512_fmadd_ps(vv, d, mo)));
      const __m256i u = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(w + b * 16)));
      const __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(u, m4)),
                                             _mm256_srli_epi16(u, 4), 1);
      _mm512_storeu_si512(dst + j * stride, _mm512_permutexvar_epi16(idx, table));
      continue;
    }
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(w + b * 32))));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(w + b * 32 + 16))));
    _mm512_storeu_si512(dst + j * stride, (__m512i)_mm512_cvtne2ps_pbh(_mm512_fmadd_ps(hi, d, mo),
                                                                      _mm512_fmadd_ps(lo, d, mo)));
  }
}

// Blocks b0 .. b0 + nbk of rows n0 .. n0 + 32 into pw, block-major: [nbk][32 rows][32 k] bfloat16 (zeros past
// N), so that an A tile is 1 KiB in one piece (row-major rows put a tile's 16 rows in one L1 set) and a chunk
// (AMX_BF16_KC blocks, 32 KiB) stays in L1 while the activation tiles pass
inline void amx_bf16_chunk(const QMatrix& q, int64_t n0, int64_t b0, int64_t nbk, uint16_t* pw) {
  constexpr int64_t stride = AMX_BF16_PANEL * 32;
  for (int64_t r = 0; r < AMX_BF16_PANEL; ++r) {
    if (n0 + r < q.n) {
      amx_bf16_row(q, n0 + r, b0, nbk, pw + r * 32, stride);
      continue;
    }
    for (int64_t b = 0; b < nbk; ++b) std::memset(pw + b * stride + r * 32, 0, 64);
  }
}

inline void amx_bf16_configure() {
  TileConfig c;
  for (int i = 0; i < 8; ++i) c.rows[i] = AMX_T, c.colsb[i] = 64;
  _tile_loadconfig(&c);
}

// The chunk pw (nbk blocks) times activation tiles t, t + 1 (NT of them; acts at tile t's first block of the
// chunk, `tstride` elements from a tile to the next): the C tiles of (tile t + j, half h) are loaded from
// c[2 (t + j) + h] (zeros for the first chunk), accumulated, stored back (float32 both ways: exact, so a row's
// sums do not depend on the chunks or on which tiles share the pass). Meanwhile the `pf` lines listed by
// `pf_line` are prefetched, spread over the blocks (a burst of misses stalls on the line fill buffers).
struct AmxPrefetch {
  const uint8_t* base = nullptr;  // row 0 of the rows to fetch, at the chunk's first byte; null for none
  int64_t rb = 0, lines = 0;      // row stride, lines per row
  const uint8_t* scales = nullptr;  // row 0's scales of the chunk (one line a row), row stride srb
  int64_t srb = 0;
};

template <int NT>
inline void amx_bf16_tiles(const uint16_t* pw, const uint32_t* acts, int64_t tstride, int64_t nbk, bool first,
                           float (*c)[AMX_T * AMX_T], const AmxPrefetch& pf) {
  constexpr int64_t QB = 16 * AMX_T, PB = AMX_BF16_PANEL * 32;  // elements per (tile, block) and panel block
  const uint32_t* acts1 = acts + tstride;
  const int64_t wl = AMX_BF16_PANEL * pf.lines, total = pf.base ? wl + AMX_BF16_PANEL : 0;
  const int64_t per = (total + nbk - 1) / nbk;
  if (first) {
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (NT == 2) {
      _tile_zero(2);
      _tile_zero(3);
    }
  } else {
    _tile_loadd(0, c[0], 64);
    _tile_loadd(1, c[1], 64);
    if constexpr (NT == 2) {
      _tile_loadd(2, c[2], 64);
      _tile_loadd(3, c[3], 64);
    }
  }
  for (int64_t b = 0; b < nbk; ++b) {
    _tile_loadd(4, pw + b * PB, 64);
    _tile_loadd(6, acts + b * QB, 64);
    _tile_loadd(5, pw + b * PB + AMX_T * 32, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 5, 6);
    if constexpr (NT == 2) {
      _tile_loadd(7, acts1 + b * QB, 64);
      _tile_dpbf16ps(2, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
    for (int64_t i = b * per; i < std::min((b + 1) * per, total); ++i)
      _mm_prefetch(i < wl ? (const char*)pf.base + (i / pf.lines) * pf.rb + (i % pf.lines) * 64
                          : (const char*)pf.scales + (i - wl) * pf.srb,
                   _MM_HINT_T0);
  }
  _tile_stored(0, c[0], 64);
  _tile_stored(1, c[1], 64);
  if constexpr (NT == 2) {
    _tile_stored(2, c[2], 64);
    _tile_stored(3, c[3], 64);
  }
}

// Where the chunk after (p, b0) starts, for the prefetch: the next chunk of panel p, or the next panel's first
// (whole panels only: the last may be short)
inline AmxPrefetch amx_bf16_next(const QMatrix& q, int64_t p, int64_t p1, int64_t b0) {
  const int64_t nb = q.kp / 32, rb = q.row_bytes(), bpb = rb / nb;
  int64_t n0 = p * AMX_BF16_PANEL, nxt = b0 + AMX_BF16_KC;
  if (nxt >= nb) n0 += AMX_BF16_PANEL, nxt = 0;
  if (n0 + AMX_BF16_PANEL > q.n || (nxt == 0 && p + 1 >= p1)) return {};
  const int64_t bytes = std::min(AMX_BF16_KC, nb - nxt) * bpb;
  const int64_t sb = q.mx() ? 1 : (q.asym ? 4 : 2);  // scale bytes per block
  const uint8_t* sc = q.mx() ? (const uint8_t*)q.e8m0 : (const uint8_t*)q.scales;
  return {q.w + n0 * rb + nxt * bpb, rb, (bytes + 63) / 64, sc + (n0 * nb + nxt) * sb, nb * sb};
}

// x [M, kp] float32 | bfloat16 (zeros past K), group-32 packed q, bias [N] or null -> y [M, N]. Panels of 32
// weight rows are split over the threads; each dequantises its panel once, a chunk of K at a time, and every
// activation tile meets the chunk.
template <typename T>
inline void quant_amx_bf16_rows(const QMatrix& q, const T* x, int64_t M, const float* bias, float* y) {
  static thread_local AmxBf16Acts tls;  // the calling thread's; the workers read it through `a`
  AmxBf16Acts& a = tls;
  relay_bf16_acts(x, M, q.kp, q.int4, a);
  const int64_t panels = (q.n + AMX_BF16_PANEL - 1) / AMX_BF16_PANEL, nb = a.nb, tstride = nb * 16 * AMX_T;
  parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    amx_bf16_configure();
    static thread_local std::vector<uint16_t> pw;
    static thread_local std::vector<float> cbuf;
    pw.resize(AMX_BF16_PANEL * 32 * AMX_BF16_KC);
    cbuf.resize((a.tiles + 1) * 2 * AMX_T * AMX_T);
    auto c = (float(*)[AMX_T * AMX_T])cbuf.data();
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * AMX_BF16_PANEL;
      for (int64_t b0 = 0; b0 < nb; b0 += AMX_BF16_KC) {
        const int64_t nbk = std::min(AMX_BF16_KC, nb - b0);
        amx_bf16_chunk(q, n0, b0, nbk, pw.data());
        const AmxPrefetch pf = amx_bf16_next(q, p, p1, b0);
        for (int64_t t = 0; t < a.tiles; t += 2) {
          const uint32_t* at = a.v.data() + t * tstride + b0 * 16 * AMX_T;
          if (t + 1 < a.tiles)
            amx_bf16_tiles<2>(pw.data(), at, tstride, nbk, b0 == 0, c + 2 * t, t == 0 ? pf : AmxPrefetch{});
          else
            amx_bf16_tiles<1>(pw.data(), at, tstride, nbk, b0 == 0, c + 2 * t, t == 0 ? pf : AmxPrefetch{});
        }
      }
      for (int64_t t = 0; t < a.tiles; ++t)  // c[2 t + h] [weight row][activation row] -> y
        for (int64_t h = 0; h < 2; ++h) {
          const int64_t nh = n0 + h * AMX_T;
          const int64_t rows = std::min<int64_t>(AMX_T, M - t * AMX_T), cols = std::min<int64_t>(AMX_T, q.n - nh);
          amx_store_transposed(c[2 * t + h], rows, cols, bias, nh, y + t * AMX_T * q.n, q.n);
        }
    }
    _tile_release();
  });
}

#endif  // SERVESCOPE_HAS_AMX_BF16

// Whether the AMX-BF16 kernel runs here: compiled in and granted the tiles
inline bool amx_bf16_available() {
#if SERVESCOPE_HAS_AMX_BF16
  return amx_ready();
#else
  return false;
#endif
}

// From this many bfloat16 rows of x on, the AMX-BF16 kernel where it runs (benchmarks/quant_rows.py at the 1B
// shape, one thread's CPU time: its fixed cost, the dequantisation, ~1.2x quant_amx.h's at 1-16 rows for
// symmetric int4; its growth per 16 rows about half quant_amx.h's, no per-block store and rescale). With two
// 4-bit blocks per table permute, symmetric int4 (Q4_0, MXFP4) is ~1.2x ahead from 17 rows (20.2-20.8 against
// 24.4-25.4 ms at 17-28 rows), where quant_amx.h takes a second activation tile; Q4_1, whose offsets cost
// quant_amx.h a second rescale per block, is 1.05-1.1x ahead already at 16 (18.2-19.6 against 19.2-21.9).
// int8 blocks (twice the bytes to widen; quant_amx.h reads them in place) were not ahead up to 128 rows in
// every run (level to 10% behind at 64-128), so they stay on quant_amx.h: no crossover.
constexpr int64_t QDOT_AMX_BF16_ROWS_INT4 = 17, QDOT_AMX_BF16_ROWS_INT4_ASYM = 16;  // 17: 16 (one tile) + 1
constexpr int64_t QDOT_AMX_BF16_ROWS_INT8 = INT64_MAX;

inline int64_t amx_bf16_rows(const QMatrix& q) {
  return !q.int4 ? QDOT_AMX_BF16_ROWS_INT8 : q.asym ? QDOT_AMX_BF16_ROWS_INT4_ASYM : QDOT_AMX_BF16_ROWS_INT4;
}

// The kernel that M rows of T activations (float32 | bfloat16) take against the group-32 matrix q by rows:
// AMX-BF16 tiles for bfloat16 rows from QDOT_AMX_BF16_ROWS_*, else AMX-INT8 tiles from QDOT_AMX_ROWS_*, where
// they run; else quant_dot.h's VNNI orders (which pick theirs by rows, QDOT_TILED_ROWS). The one rule that
// quant_rows' Auto order and the fused MoE op's experts (moe_experts.h) both follow.
enum class QRowsKernel { Dot, Amx, AmxBf16, Gemm };

// From this many rows on, where no AMX tiles run, quant_gemm.h's panel GEMM (its weights re-laid per call so that
// a vector holds 16 columns' bytes: per 32-block one float rescale per 16 columns and row, where the VNNI orders
// of quant_dot.h rescale every block of every (row, column) pair; compute-bound past a few rows, the GEMM's
// inner loop is nearly all vpdpbusd). The crossovers, measured on a Zen 4 (benchmarks/quant_rows.py; docs/BENCHMARKS.md,
// "packed rows on a CPU without AMX"): AVX-512 (VNNI) from 4 rows for int4 (at 3 the VNNI orders take 9.0 ms
// against 10.6) and 2 for int8 (whose VNNI orders do twice the work per byte); the AVX2 build (no VNNI: maddubs
// + madd) from 8 (level with the streaming order there, 1.2x ahead at 16) and 4. Other paths re-lay their panels
// a scalar 4 bytes at a time, which the VNNI orders beat at decode sizes: they keep them.
#if defined(SERVESCOPE_ISA_AVX512)
constexpr int64_t QGEMM_ROWS_INT4 = 4, QGEMM_ROWS_INT8 = 2;
#elif defined(SERVESCOPE_ISA_AVX2)
constexpr int64_t QGEMM_ROWS_INT4 = 8, QGEMM_ROWS_INT8 = 4;
#else
constexpr int64_t QGEMM_ROWS_INT4 = INT64_MAX, QGEMM_ROWS_INT8 = INT64_MAX;
#endif

template <typename T>
inline QRowsKernel quant_rows_kernel(const QMatrix& q, int64_t M) {
#if SERVESCOPE_HAS_AMX_BF16
  if constexpr (std::is_same_v<T, servescope_simd::bf16>)
    if (M >= amx_bf16_rows(q) && amx_ready()) return QRowsKernel::AmxBf16;
#endif
#if SERVESCOPE_HAS_AMX_INT8
  if (M >= (q.int4 ? QDOT_AMX_ROWS_INT4 : QDOT_AMX_ROWS_INT8) && amx_ready()) return QRowsKernel::Amx;
#endif
  return M >= (q.int4 ? QGEMM_ROWS_INT4 : QGEMM_ROWS_INT8) ? QRowsKernel::Gemm : QRowsKernel::Dot;
}

// The packed GEMV / GEMM entry: x [M, kp] float32 | bfloat16 (bfloat16 for group-32 weights only), bias [N]
// or null -> y [M, N]. order Auto picks the kernel by rows (quant_rows_kernel), the others force one (Amx /
// AmxBf16 only where amx_available() / amx_bf16_available()); groups other than 32 take quant_gemv.h's float
// kernel; weights in kept panels (q.panel) take quant_kept.h's kernel at every M.
template <typename T>
inline void quant_rows(const QMatrix& q, const T* x, int64_t M, const float* bias, float* y, QOrder order) {
  if (q.panel) return quant_gemm_kept(q, x, M, bias, y);
  if constexpr (std::is_same_v<T, float>)
    if (q.group != 32) return quant_gemv_rows(q, x, M, bias, y);
  const QRowsKernel k = order == QOrder::Auto     ? quant_rows_kernel<T>(q, M)
                        : order == QOrder::AmxBf16 ? QRowsKernel::AmxBf16
                        : order == QOrder::Amx     ? QRowsKernel::Amx
                        : order == QOrder::Gemm    ? QRowsKernel::Gemm
                                                   : QRowsKernel::Dot;
  if (k == QRowsKernel::Gemm) return quant_gemm_rows(q, x, M, bias, y);
#if SERVESCOPE_HAS_AMX_BF16
  if (k == QRowsKernel::AmxBf16) return quant_amx_bf16_rows(q, x, M, bias, y);
#endif
#if SERVESCOPE_HAS_AMX_INT8
  if (k == QRowsKernel::Amx) return quant_amx_rows(q, x, M, bias, y);
#endif
  quant_dot_rows(q, x, M, bias, y, order);
}

}  // namespace servescope_quant
