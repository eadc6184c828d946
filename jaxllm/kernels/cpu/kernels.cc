// Quantized matmuls for XLA:CPU, called through XLA's FFI (see build.py, which builds and
// registers this file). XLA:CPU has no dot that dequantizes its operand on the fly, so these
// read the packed codes themselves:
//
//   jaxllm_qmm      y[M,N] = x[M,K] . (code * scale + offset)^T   int4 or int8 codes
//   jaxllm_qmm_sym  the same without an offset
//   jaxllm_qmm_sym_bf16  int8 per-channel codes, activations rounded to bf16 (the bf16 policy)
//   jaxllm_fp8      e4m3 codes with per-channel scales; x quantized per row to e4m3 inside,
//                   both multiplied as bf16 (exact) with f32 sums
//   jaxllm_w8a8     int8 codes with per-channel scales; x quantized per row to int8 inside
//                   (optionally divided by a SmoothQuant vector first), int32 accumulation
//   jaxllm_bf16_in_out / jaxllm_bf16_out_in
//                   bf16 float weights, f32 activations and accumulation: XLA:CPU converts a
//                   bf16 operand to f32 in memory before its dot (measured 8x slower than the
//                   f32 dot at one row), so bf16 storage only pays through a kernel that
//                   widens in registers. in_out: [L, K, N] (the layers' stacks), out_in: [N, K]
//                   (a tied embedding table as the head).
//
// Weights are stacks [L, N, K'] (out-major, formats.py) and a layer index picks one, so no
// slice of the stack is ever copied; the index operand [layer, rows] also says how many
// leading rows of x are real (a step padded to its bucket: the rest come back as zeros). int4: uint8 [L, N, K/2], two codes per byte in
// blocks of 32 (byte j: code j low, code j + 16 high); int8: int8 [L, N, K]; scale and offset
// float16 or float32 [L, N, K/G]. Rows of N are split over XLA's intra-op thread pool.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AMX_BF16__) && \
    defined(__AVX512BF16__) && defined(__AVX512VNNI__) && defined(__linux__)
#define JAXLLM_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// EngineConfig.cpu_amx, set through JaxllmSetAmx: whether the packed kernels may use AMX
std::atomic<bool> g_amx_allowed{true};

#if !defined(JAXLLM_AMX)
bool amx_on() { return false; }
#endif

// Run fn(n0, n1) over [0, N) in chunks of `chunk` rows on the pool. The caller takes chunks
// too, so it never waits on a task that has not started: no deadlock when the pool is busy.
// align > 0: the chunk may shrink (to a multiple of align) so that the chunks are a multiple
// of the threads: 9 chunks of 64 on 2 threads would leave one thread a ninth of the work alone.
template <typename F>
void parallel_rows(ffi::ThreadPool& pool, int64_t N, int64_t chunk, F fn, int64_t align = 0) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  if (align > 0 && N > chunk) {
    const int64_t want = ((N + chunk - 1) / chunk + threads - 1) / threads * threads;
    chunk = std::max<int64_t>(align, ((N + want - 1) / want + align - 1) / align * align);
  }
  const int64_t chunks = (N + chunk - 1) / chunk;
  struct State {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto st = std::make_shared<State>();
  auto work = [st, chunks, chunk, N, fn]() {
    int64_t c;
    while ((c = st->next.fetch_add(1)) < chunks) {
      fn(c * chunk, std::min(N, (c + 1) * chunk));
      st->done.fetch_add(1);
    }
  };
  for (int64_t t = 1; t < threads && t < chunks; ++t) pool.Schedule(std::function<void()>(work));
  work();
  // the last chunks finish on other threads: spin briefly, then give the core away (on a
  // busy machine a spinning waiter would keep the thread it waits for off the CPU)
  for (int spins = 0; st->done.load() < chunks; ++spins) {
    if (spins > 4000) std::this_thread::yield();
  }
}

// float16 or float32 scales
inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal
      int e = -1;
      uint32_t m = man;
      do { ++e; m <<= 1; } while (!(m & 0x400u));
      bits = sign | ((127 - 15 - e) << 23) | ((m & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

// One-byte codes as f32 (int8, and fp8 e4m3fn in a type of its own so that overloads pick
// its widening): the KV cache's and fp8 weights'.
struct Fp8 {
  uint8_t bits;
};

// e4m3fn -> f16 bits: sign to bit 15, exponent and mantissa under f16's (exponent field e
// of 0..15, never f16's inf/NaN), so f16's value is 2^(e-15)(1+m/8) and subnormals map to
// subnormals; times 2^8 it is e4m3's 2^(e-7)(1+m/8), exactly. (e4m3fn's NaN, 0x7f, reads as
// 480: writers scale each row's largest magnitude to 448, so finite values never give it;
// only a NaN in the row would, which XLA's path reads as NaN.)
inline uint16_t fp8_to_half(uint8_t b) { return uint16_t(((b & 0x80) << 8) | ((b & 0x7f) << 7)); }

inline float load_kv(const int8_t* p) { return float(*p); }
inline float load_kv(const Fp8* p) { return half_to_float(fp8_to_half(p->bits)) * 256.0f; }

#if defined(__AVX512F__)
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 load16(const Fp8* p) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i h = _mm512_or_si512(_mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 8),
                                    _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x7f)), 7));
  return _mm512_mul_ps(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(h)), _mm512_set1_ps(256.0f));
}
#endif

struct Scales {
  const void* p = nullptr;
  bool f16 = false;
  inline float operator[](int64_t i) const {
    return f16 ? half_to_float(static_cast<const uint16_t*>(p)[i]) : static_cast<const float*>(p)[i];
  }
  explicit operator bool() const { return p != nullptr; }
};

struct QMat {
  const void* q;   // codes of the chosen layer
  Scales scale;    // [N, K/G]
  Scales offset;   // [N, K/G] or null
  int64_t N, K, G;
  bool int4;
};

#if defined(__AVX512F__)

inline void codes32(const QMat& w, int64_t row, int64_t k, __m512& a, __m512& b) {
  if (w.int4) {
    const uint8_t* p = static_cast<const uint8_t*>(w.q) + row * (w.K / 2) + k / 2;
    __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    a = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
    b = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
  } else {
    const int8_t* p = static_cast<const int8_t*>(w.q) + row * w.K + k;
    a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
  }
}

// NR weight rows x MR activation rows; K is a multiple of 32 (checked by the caller). ONE:
// groups of 32 or more, so a block of 32 codes has one scale and offset (one scalar load and
// broadcast each instead of two: at one activation row they cost as much as the FMAs)
template <int NR, int MR, bool ONE>
void tile(const QMat& w, const float* x, int64_t K, int64_t n, float* y, int64_t N) {
  __m512 acc[NR][MR];
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < MR; ++i) acc[r][i] = _mm512_setzero_ps();
  const int64_t ng = K / w.G;
  // up to 4 activation rows stay in registers across the NR weight rows; more take the
  // registers for accumulators and are read from the cache at each use (NR is then 1)
  constexpr bool HOLD = MR <= 4;
  static_assert(HOLD || NR == 1, "more than 4 activation rows: one weight row at a time");
  for (int64_t k = 0; k < K; k += 32) {
    __m512 xa[HOLD ? MR : 1], xb[HOLD ? MR : 1];
    if constexpr (HOLD) {
      for (int i = 0; i < MR; ++i) {
        xa[i] = _mm512_loadu_ps(x + i * K + k);
        xb[i] = _mm512_loadu_ps(x + i * K + k + 16);
      }
    }
    const int64_t ga = k / w.G, gb = (k + 16) / w.G;
    for (int r = 0; r < NR; ++r) {
      const int64_t row = n + r;
      __m512 a, b;
      codes32(w, row, k, a, b);
      const __m512 sa = _mm512_set1_ps(w.scale[row * ng + ga]);
      const __m512 sb = ONE ? sa : _mm512_set1_ps(w.scale[row * ng + gb]);
      if (w.offset) {
        const __m512 oa = _mm512_set1_ps(w.offset[row * ng + ga]);
        a = _mm512_fmadd_ps(a, sa, oa);
        b = _mm512_fmadd_ps(b, sb, ONE ? oa : _mm512_set1_ps(w.offset[row * ng + gb]));
      } else {
        a = _mm512_mul_ps(a, sa);
        b = _mm512_mul_ps(b, sb);
      }
      for (int i = 0; i < MR; ++i) {
        if constexpr (HOLD) {
          acc[r][i] = _mm512_fmadd_ps(a, xa[i], acc[r][i]);
          acc[r][i] = _mm512_fmadd_ps(b, xb[i], acc[r][i]);
        } else {
          acc[r][i] = _mm512_fmadd_ps(a, _mm512_loadu_ps(x + i * K + k), acc[r][i]);
          acc[r][i] = _mm512_fmadd_ps(b, _mm512_loadu_ps(x + i * K + k + 16), acc[r][i]);
        }
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < MR; ++i) y[i * N + n + r] = _mm512_reduce_add_ps(acc[r][i]);
}

template <int MR, bool ONE>
void rows_g(const QMat& w, const float* x, int64_t n0, int64_t n1, float* y) {
  int64_t n = n0;
  if constexpr (MR <= 4)
    for (; n + 4 <= n1; n += 4) tile<4, MR, ONE>(w, x, w.K, n, y, w.N);
  for (; n < n1; ++n) tile<1, MR, ONE>(w, x, w.K, n, y, w.N);
}

template <int MR>
void rows_m(const QMat& w, const float* x, int64_t n0, int64_t n1, float* y) {
  if (w.G % 32 == 0) rows_g<MR, true>(w, x, n0, n1, y);
  else rows_g<MR, false>(w, x, n0, n1, y);
}

// Activation rows in passes of up to 8: each pass decodes every weight code once, so 5 rows
// (a verification step of 4 proposals) cost one pass, not a pass of 4 and another of 1. A
// pass of more than 4 rows reads them from the cache for each weight row: only as many as
// fit in a core's L1 (measured: 8 rows of 1536 ran at 0.7x two passes of 4)
void qmm_rows(const QMat& w, const float* x, int64_t M, int64_t n0, int64_t n1, float* y) {
  const int64_t pass = 8 * w.K * 4 <= 24576 ? 8 : 5 * w.K * 4 <= 32768 ? 5 : 4;
  for (int64_t m = 0; m < M; m += pass) {
    const float* xm = x + m * w.K;
    float* ym = y + m * w.N;
    switch (std::min<int64_t>(M - m, pass)) {
      case 8: rows_m<8>(w, xm, n0, n1, ym); break;
      case 7: rows_m<7>(w, xm, n0, n1, ym); break;
      case 6: rows_m<6>(w, xm, n0, n1, ym); break;
      case 5: rows_m<5>(w, xm, n0, n1, ym); break;
      case 4: rows_m<4>(w, xm, n0, n1, ym); break;
      case 3: rows_m<3>(w, xm, n0, n1, ym); break;
      case 2: rows_m<2>(w, xm, n0, n1, ym); break;
      case 1: rows_m<1>(w, xm, n0, n1, ym); break;
    }
  }
}

#else  // portable fallback

void qmm_rows(const QMat& w, const float* x, int64_t M, int64_t n0, int64_t n1, float* y) {
  const int64_t ng = w.K / w.G;
  std::vector<float> row(w.K);
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t k = 0; k < w.K; ++k) {
      float c;
      if (w.int4) {
        const uint8_t* p = static_cast<const uint8_t*>(w.q) + n * (w.K / 2) + (k / 32) * 16;
        int64_t j = k % 32;
        c = j < 16 ? (p[j] & 15) : (p[j - 16] >> 4);
      } else {
        c = static_cast<const int8_t*>(w.q)[n * w.K + k];
      }
      const int64_t g = n * ng + k / w.G;
      row[k] = c * w.scale[g] + (w.offset ? w.offset[g] : 0.0f);
    }
    for (int64_t m = 0; m < M; ++m) {
      float s = 0;
      for (int64_t k = 0; k < w.K; ++k) s += x[m * w.K + k] * row[k];
      y[m * w.N + n] = s;
    }
  }
}

#endif

// int4 codes x int8 activations (llama.cpp's Q4 x Q8 form): each block of 32 activations is
// quantized to int8 with a scale of its own, so a VNNI instruction multiplies 64 codes by 64
// activations, where the float path widens, scales and offsets every code first. The result
// is the float product of the dequantized weights with the quantize-dequantized activations
// (quantization.qweight.fake_quant_blocks does the same in XLA).
struct Q8Act {
  int64_t K = 0, pairs = 0, ng = 0;
  std::vector<int8_t> q;    // [M, K]: per pair of blocks, in the order the codes unpack
  std::vector<float> d;     // [M, pairs, 16]: each dot-product lane's block scale
  std::vector<float> gsum;  // [M, ng]: the dequantized activations' sum per weight group
};

// 32 activations -> int8, round half to even, scale max|x| / 127 (1 for a zero block)
void quantize_q8(const float* x, int64_t M, int64_t K, int64_t G, Q8Act& a) {
  a.K = K;
  a.pairs = K / 64;
  a.ng = K / G;
  a.q.resize(M * K);
  a.d.resize(M * a.pairs * 16);
  a.gsum.assign(M * a.ng, 0.0f);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < K / 32; ++b) {
      const float* xb = x + m * K + b * 32;
      float amax = 0.0f;
      for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(xb[j]));
      const float d = amax > 0.0f ? amax / 127.0f : 1.0f;
      const int64_t p = b / 2, h = b % 2;
      // a byte's low nibbles come first (codes 0-15 of each block), then its high ones
      int8_t* qp = a.q.data() + m * K + p * 64 + h * 16;
      int32_t sum = 0;
#if defined(__AVX512F__)
      const __m512 dv = _mm512_set1_ps(d);  // |x / d| <= 127: the conversion rounds to even
      const __m512i lo = _mm512_cvtps_epi32(_mm512_div_ps(_mm512_loadu_ps(xb), dv));
      const __m512i hi = _mm512_cvtps_epi32(_mm512_div_ps(_mm512_loadu_ps(xb + 16), dv));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qp), _mm512_cvtsepi32_epi8(lo));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qp + 32), _mm512_cvtsepi32_epi8(hi));
      sum = _mm512_reduce_add_epi32(_mm512_add_epi32(lo, hi));
#else
      for (int j = 0; j < 32; ++j) {
        const int32_t v = static_cast<int32_t>(
            std::min(127.0f, std::max(-127.0f, std::nearbyint(xb[j] / d))));
        sum += v;
        qp[(j < 16 ? 0 : 32) + (j % 16)] = static_cast<int8_t>(v);
      }
#endif
      float* dp = a.d.data() + (m * a.pairs + p) * 16;
      for (int l = 0; l < 4; ++l) dp[h * 4 + l] = dp[8 + h * 4 + l] = d;
      a.gsum[m * a.ng + b * 32 / G] += d * static_cast<float>(sum);
    }
  }
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)

// the scales of blocks g and g + 1 (groups of 32), laid out as a pair's dot products are:
// lanes 0-3 and 8-11 the first block, 4-7 and 12-15 the second
inline __m512 pair_scales32(const Scales& s, int64_t g) {
  __m128 two;
  if (s.f16) {
    int32_t bits;
    std::memcpy(&bits, static_cast<const uint16_t*>(s.p) + g, 4);
    two = _mm_cvtph_ps(_mm_cvtsi32_si128(bits));
  } else {
    double bits;
    std::memcpy(&bits, static_cast<const float*>(s.p) + g, 8);
    two = _mm_castpd_ps(_mm_set_sd(bits));
  }
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1),
                               _mm512_castps128_ps512(two));
}

// Which scale each pair of blocks takes. G32: groups of 32, two per pair (GGUF's Q4_0/Q4_1);
// G64: groups of a multiple of 64, one per pair, the same for G / 64 pairs running; ANY: the
// rest (two divisions per pair: the four matmuls of the default model at one row took
// 4.4 ms over 30 layers that way, 3.2 ms as G32)
enum GroupMode { G32, G64, ANY };

// one weight row by MR activation rows
template <int MR, GroupMode GM>
void q8_row(const QMat& w, const Q8Act& a, int64_t m0, int64_t n, float* y) {
  __m512 acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
  const uint8_t* codes = static_cast<const uint8_t*>(w.q) + n * (w.K / 2);
  const int64_t ng = a.ng, K = a.K, per_group = w.G / 64;
  const __m256i m15 = _mm256_set1_epi8(15);
  __m512 sw = _mm512_setzero_ps();
  for (int64_t p = 0, g = 0, left = 0; p < a.pairs; ++p) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + p * 32));
    const __m512i u = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_and_si256(v, m15)),
        _mm256_and_si256(_mm256_srli_epi16(v, 4), m15), 1);
    // lanes 0-3 and 8-11 hold the first block's products, 4-7 and 12-15 the second's
    if constexpr (GM == G32) {
      sw = pair_scales32(w.scale, n * ng + 2 * p);
    } else if constexpr (GM == G64) {
      if (left == 0) {
        sw = _mm512_set1_ps(w.scale[n * ng + g++]);
        left = per_group;
      }
      --left;
    } else {
      const int64_t g0 = (p * 64) / w.G, g1 = (p * 64 + 32) / w.G;
      const __m512 s0 = _mm512_set1_ps(w.scale[n * ng + g0]);
      sw = g0 == g1 ? s0 : _mm512_mask_blend_ps(0xF0F0, s0, _mm512_set1_ps(w.scale[n * ng + g1]));
    }
    for (int i = 0; i < MR; ++i) {
      const int64_t m = m0 + i;
      const __m512i xq = _mm512_loadu_si512(a.q.data() + m * K + p * 64);
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u, xq));
      const __m512 dv = _mm512_loadu_ps(a.d.data() + (m * a.pairs + p) * 16);
      acc[i] = _mm512_fmadd_ps(dot, _mm512_mul_ps(sw, dv), acc[i]);
    }
  }
  if (w.offset) {  // sum_k offset(k) x(k), by groups
    for (int64_t g = 0; g < ng; g += 16) {
      const __mmask16 mask = ng - g >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (ng - g)) - 1);
      const void* op = w.offset.f16 ? static_cast<const void*>(static_cast<const uint16_t*>(w.offset.p) + n * ng + g)
                                    : static_cast<const void*>(static_cast<const float*>(w.offset.p) + n * ng + g);
      const __m512 o = w.offset.f16 ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, op))
                                    : _mm512_maskz_loadu_ps(mask, op);
      for (int i = 0; i < MR; ++i)
        acc[i] = _mm512_fmadd_ps(o, _mm512_maskz_loadu_ps(mask, a.gsum.data() + (m0 + i) * ng + g), acc[i]);
    }
  }
  for (int i = 0; i < MR; ++i) y[(m0 + i) * w.N + n] = _mm512_reduce_add_ps(acc[i]);
}

template <int MR>
void q8_rows_m(const QMat& w, const Q8Act& a, int64_t m0, int64_t n0, int64_t n1, float* y) {
  if (w.G == 32)
    for (int64_t n = n0; n < n1; ++n) q8_row<MR, G32>(w, a, m0, n, y);
  else if (w.G % 64 == 0)
    for (int64_t n = n0; n < n1; ++n) q8_row<MR, G64>(w, a, m0, n, y);
  else
    for (int64_t n = n0; n < n1; ++n) q8_row<MR, ANY>(w, a, m0, n, y);
}

void q8_rows(const QMat& w, const Q8Act& a, int64_t M, int64_t n0, int64_t n1, float* y) {
  for (int64_t m = 0; m < M; m += 8) {
    switch (std::min<int64_t>(M - m, 8)) {
      case 8: q8_rows_m<8>(w, a, m, n0, n1, y); break;
      case 7: q8_rows_m<7>(w, a, m, n0, n1, y); break;
      case 6: q8_rows_m<6>(w, a, m, n0, n1, y); break;
      case 5: q8_rows_m<5>(w, a, m, n0, n1, y); break;
      case 4: q8_rows_m<4>(w, a, m, n0, n1, y); break;
      case 3: q8_rows_m<3>(w, a, m, n0, n1, y); break;
      case 2: q8_rows_m<2>(w, a, m, n0, n1, y); break;
      case 1: q8_rows_m<1>(w, a, m, n0, n1, y); break;
    }
  }
}

#else  // portable fallback: the same integer products

void q8_rows(const QMat& w, const Q8Act& a, int64_t M, int64_t n0, int64_t n1, float* y) {
  const uint8_t* all = static_cast<const uint8_t*>(w.q);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* codes = all + n * (w.K / 2);
      float s = 0.0f;
      for (int64_t p = 0; p < a.pairs; ++p)
        for (int h = 0; h < 2; ++h) {
          int32_t dot = 0;
          for (int j = 0; j < 32; ++j) {
            const uint8_t byte = codes[p * 32 + h * 16 + (j % 16)];
            dot += (j < 16 ? byte & 15 : byte >> 4) * a.q[m * a.K + p * 64 + (j < 16 ? 0 : 32) + h * 16 + (j % 16)];
          }
          const int64_t g = (p * 64 + h * 32) / w.G;
          s += static_cast<float>(dot) * w.scale[n * a.ng + g] * a.d[(m * a.pairs + p) * 16 + h * 4];
        }
      if (w.offset)
        for (int64_t g = 0; g < a.ng; ++g) s += w.offset[n * a.ng + g] * a.gsum[m * a.ng + g];
      y[m * w.N + n] = s;
    }
}

#endif

// The int32 index operand: [layer] or [layer, rows]. `rows` is how many leading rows of x are
// real (a padded step bucket: the rest are padding nobody reads); only those are multiplied,
// and the others come back as zeros.
struct Index {
  int64_t layer, rows;
};

ffi::Error read_index(const ffi::Buffer<ffi::S32>& b, int64_t L, int64_t M, Index* out) {
  const int32_t* p = b.typed_data();
  out->layer = p[0];
  out->rows = b.element_count() >= 2 ? std::clamp<int64_t>(p[1], 0, M) : M;
  if (out->layer < 0 || out->layer >= L) return ffi::Error::InvalidArgument("layer index out of range");
  return ffi::Error::Success();
}

// zeros for the padded rows [rows, M) of y [M, N]
void zero_rows(float* y, int64_t rows, int64_t M, int64_t N) {
  if (rows < M) std::memset(y + rows * N, 0, sizeof(float) * (M - rows) * N);
}

bool scale_type(const ffi::AnyBuffer& b, bool* f16) {
  *f16 = b.element_type() == ffi::DataType::F16;
  return *f16 || b.element_type() == ffi::DataType::F32;
}

Scales scales_at(const ffi::AnyBuffer& b, bool f16, int64_t offset_elems) {
  Scales s;
  s.f16 = f16;
  s.p = static_cast<const char*>(b.untyped_data()) + offset_elems * (f16 ? 2 : 4);
  return s;
}

ffi::Error QmmImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer q,
                   ffi::AnyBuffer scale, std::optional<ffi::AnyBuffer> offset,
                   ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y, bool q8 = false) {
  auto xd = x.dimensions(), qd = q.dimensions(), sd = scale.dimensions();
  if (xd.size() != 2 || qd.size() != 3 || sd.size() != 3)
    return ffi::Error::InvalidArgument("qmm: x must be [M, K], q and scale [L, N, *]");
  const bool int4 = q.element_type() == ffi::DataType::U8;
  if (!int4 && q.element_type() != ffi::DataType::S8)
    return ffi::Error::InvalidArgument("qmm: codes must be uint8 (int4) or int8");
  const int64_t K = xd[1], L = qd[0], N = qd[1];
  if (qd[2] * (int4 ? 2 : 1) != K || K % 32 || sd[1] != N || K % sd[2] || (K / sd[2]) % 16)
    return ffi::Error::InvalidArgument("qmm: shapes do not match");
  bool f16 = false, f16o = false;
  if (!scale_type(scale, &f16) || (offset && (!scale_type(*offset, &f16o) || f16o != f16)))
    return ffi::Error::InvalidArgument("qmm: scale and offset must both be float16 or float32");
  Index ix;
  if (auto e = read_index(layer, L, xd[0], &ix); e.failure()) return e;
  const int64_t l = ix.layer, M = ix.rows;
  QMat w;
  w.int4 = int4;
  w.N = N;
  w.K = K;
  w.G = K / sd[2];
  const int64_t per_layer_codes = N * qd[2];
  w.q = static_cast<const uint8_t*>(q.untyped_data()) + l * per_layer_codes;
  w.scale = scales_at(scale, f16, l * N * sd[2]);
  if (offset) w.offset = scales_at(*offset, f16, l * N * sd[2]);
  const float* xp = x.typed_data();
  float* yp = y->typed_data();
  zero_rows(yp, M, xd[0], N);
  if (M == 0) return ffi::Error::Success();
  if (q8) {
    if (!int4 || K % 64 || w.G % 32)
      return ffi::Error::InvalidArgument("qmm_q8: int4 codes, K a multiple of 64 and groups of 32s");
    auto act = std::make_shared<Q8Act>();
    quantize_q8(xp, M, K, w.G, *act);
    parallel_rows(pool, N, 64, [=](int64_t n0, int64_t n1) { q8_rows(w, *act, M, n0, n1, yp); }, 4);
    return ffi::Error::Success();
  }
  parallel_rows(pool, N, 64, [=](int64_t n0, int64_t n1) { qmm_rows(w, xp, M, n0, n1, yp); }, 4);
  return ffi::Error::Success();
}

ffi::Error QmmQ8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer q,
                 ffi::AnyBuffer scale, ffi::AnyBuffer offset,
                 ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
  return QmmImpl(pool, x, q, scale, offset, layer, y, true);
}

ffi::Error QmmQ8Sym(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer q,
                    ffi::AnyBuffer scale, ffi::Buffer<ffi::S32> layer,
                    ffi::ResultBuffer<ffi::F32> y) {
  return QmmImpl(pool, x, q, scale, std::nullopt, layer, y, true);
}

ffi::Error QmmOffset(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer q,
                     ffi::AnyBuffer scale, ffi::AnyBuffer offset,
                     ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
  return QmmImpl(pool, x, q, scale, offset, layer, y);
}

ffi::Error QmmSym(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer q,
                  ffi::AnyBuffer scale, ffi::Buffer<ffi::S32> layer,
                  ffi::ResultBuffer<ffi::F32> y) {
  return QmmImpl(pool, x, q, scale, std::nullopt, layer, y);
}

// W8A8: activations quantized per row to int8, stored as value + 128 (unsigned, for VNNI's
// u8 x s8 products); sum_k (x + 128) w = sum_k x w + 128 sum_k w.
void quantize_rows(const float* x, const float* smooth, int64_t M, int64_t K, uint8_t* xu,
                   float* xs) {
#if defined(__AVX512F__)
  if (K % 16 == 0) {  // the same arithmetic, 16 at a time (IEEE division, round half to even)
    for (int64_t m = 0; m < M; ++m) {
      const float* xr = x + m * K;
      __m512 amax = _mm512_setzero_ps();
      for (int64_t k = 0; k < K; k += 16) {
        __m512 t = _mm512_loadu_ps(xr + k);
        if (smooth) t = _mm512_div_ps(t, _mm512_loadu_ps(smooth + k));
        amax = _mm512_max_ps(amax, _mm512_abs_ps(t));
      }
      const float a = _mm512_reduce_max_ps(amax);
      const float s = a > 0 ? a / 127.0f : 1.0f;
      xs[m] = s;
      const __m512 sv = _mm512_set1_ps(s), lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
      const __m512i bias = _mm512_set1_epi32(128);
      for (int64_t k = 0; k < K; k += 16) {
        __m512 t = _mm512_loadu_ps(xr + k);
        if (smooth) t = _mm512_div_ps(t, _mm512_loadu_ps(smooth + k));
        __m512 v = _mm512_roundscale_ps(_mm512_div_ps(t, sv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v = _mm512_min_ps(hi, _mm512_max_ps(lo, v));
        const __m512i u = _mm512_add_epi32(_mm512_cvtps_epi32(v), bias);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(xu + m * K + k), _mm512_cvtepi32_epi8(u));
      }
    }
    return;
  }
#endif
  std::vector<float> t(K);
  for (int64_t m = 0; m < M; ++m) {
    float amax = 0;
    for (int64_t k = 0; k < K; ++k) {
      t[k] = smooth ? x[m * K + k] / smooth[k] : x[m * K + k];
      amax = std::max(amax, std::fabs(t[k]));
    }
    const float s = amax > 0 ? amax / 127.0f : 1.0f;
    xs[m] = s;
    for (int64_t k = 0; k < K; ++k) {
      float v = std::nearbyint(t[k] / s);  // round half to even, as jnp.round
      v = std::min(127.0f, std::max(-127.0f, v));
      xu[m * K + k] = static_cast<uint8_t>(static_cast<int>(v) + 128);
    }
  }
}

constexpr int kPanel = 48;  // columns per packed panel: 3 vectors

#if defined(__AVX512F__) && defined(__AVX512VNNI__)

template <int NR, int MR>
void tile8(const int8_t* w, const float* ws, const uint8_t* xu, const float* xs, int64_t K,
           int64_t n, float* y, int64_t N) {
  __m512i acc[NR][MR], wsum[NR];
  for (int r = 0; r < NR; ++r) {
    wsum[r] = _mm512_setzero_si512();
    for (int i = 0; i < MR; ++i) acc[r][i] = _mm512_setzero_si512();
  }
  const __m512i ones = _mm512_set1_epi8(1);
  for (int64_t k = 0; k < K; k += 64) {
    const __mmask64 mask = K - k >= 64 ? ~__mmask64(0) : ((__mmask64(1) << (K - k)) - 1);
    __m512i xv[MR];
    for (int i = 0; i < MR; ++i) xv[i] = _mm512_maskz_loadu_epi8(mask, xu + i * K + k);
    for (int r = 0; r < NR; ++r) {
      const __m512i wv = _mm512_maskz_loadu_epi8(mask, w + (n + r) * K + k);
      wsum[r] = _mm512_dpbusd_epi32(wsum[r], ones, wv);
      for (int i = 0; i < MR; ++i) acc[r][i] = _mm512_dpbusd_epi32(acc[r][i], xv[i], wv);
    }
  }
  for (int r = 0; r < NR; ++r) {
    const int32_t corr = 128 * _mm512_reduce_add_epi32(wsum[r]);
    for (int i = 0; i < MR; ++i) {
      const int32_t dot = _mm512_reduce_add_epi32(acc[r][i]) - corr;
      y[i * N + n + r] = static_cast<float>(dot) * xs[i] * ws[n + r];
    }
  }
}

template <int MR>
void rows8_m(const int8_t* w, const float* ws, const uint8_t* xu, const float* xs, int64_t K,
             int64_t n0, int64_t n1, float* y, int64_t N) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) tile8<4, MR>(w, ws, xu, xs, K, n, y, N);
  for (; n < n1; ++n) tile8<1, MR>(w, ws, xu, xs, K, n, y, N);
}

void w8a8_rows(const int8_t* w, const float* ws, const uint8_t* xu, const float* xs, int64_t M,
               int64_t K, int64_t n0, int64_t n1, float* y, int64_t N) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) rows8_m<4>(w, ws, xu + m * K, xs + m, K, n0, n1, y + m * N, N);
  switch (M - m) {
    case 3: rows8_m<3>(w, ws, xu + m * K, xs + m, K, n0, n1, y + m * N, N); break;
    case 2: rows8_m<2>(w, ws, xu + m * K, xs + m, K, n0, n1, y + m * N, N); break;
    case 1: rows8_m<1>(w, ws, xu + m * K, xs + m, K, n0, n1, y + m * N, N); break;
  }
}

// Many activation rows: the weights of 16-column groups are first packed so that one 64-byte
// vector holds 4 consecutive k of 16 columns (VNNI's operand order). A broadcast of 4
// activation bytes times that vector then adds into 16 outputs at once: no horizontal sums,
// and each packed panel (in L1/L2) serves every row. The per-column sums of the weights, for
// the +128 of the unsigned activations, come out of the packing.

#if defined(JAXLLM_AMX)
// AMX, the tile matrix unit of recent Xeons: one TDPBUSD (TDPBF16PS) multiplies a tile of 16
// activation rows x 64 bytes of k by a tile of 16 columns and adds into 16 x 16 int32 (f32)
// sums: 16 times the products of an AVX-512 VNNI instruction. The packed panels below are
// already in the tiles' order (a column's 4 k of int8, or 2 k of bf16, per 4 bytes), so a
// panel of 48 columns is three B tiles. Linux hands a process the tile state only when asked;
// where it refuses (a kernel before 5.16), or with cpu_amx off, the AVX-512 loops run.
bool amx_on() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                      18 /* XFEATURE_XTILEDATA */) == 0;
  return granted && g_amx_allowed.load(std::memory_order_relaxed);
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tiles 0-2: sums, 3: activations, 4-6: weights; all 16 rows of 64 bytes. The configuration
// is the thread's: each task sets it and releases the tiles when done
inline void amx_begin() {
  TileConfig c;
  for (int t = 0; t < 7; ++t) {
    c.colsb[t] = 64;
    c.rows[t] = 16;
  }
  _tile_loadconfig(&c);
}

// tiles 0..nr-1 <- 16 activation rows (a, `stride` bytes apart) x nr column tiles of the
// packed panel, over all of K (a multiple of 64 for int8, 32 for bf16)
template <bool BF16>
inline void amx_block(const void* a, int64_t stride, const int32_t* buf, int64_t K, int nr) {
  constexpr int kstep = BF16 ? 32 : 64, per_entry = BF16 ? 2 : 4, bytes = BF16 ? 2 : 1;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  for (int64_t k = 0; k < K; k += kstep) {
    _tile_loadd(3, static_cast<const uint8_t*>(a) + k * bytes, stride);
    const int32_t* b = buf + k / per_entry * kPanel;
    _tile_loadd(4, b, kPanel * 4);
    if (nr > 1) _tile_loadd(5, b + 16, kPanel * 4);
    if (nr > 2) _tile_loadd(6, b + 32, kPanel * 4);
    if constexpr (BF16) {
      _tile_dpbf16ps(0, 3, 4);
      if (nr > 1) _tile_dpbf16ps(1, 3, 5);
      if (nr > 2) _tile_dpbf16ps(2, 3, 6);
    } else {
      _tile_dpbusd(0, 3, 4);
      if (nr > 1) _tile_dpbusd(1, 3, 5);
      if (nr > 2) _tile_dpbusd(2, 3, 6);
    }
  }
}

inline void amx_store(int32_t* c) {
  _tile_stored(0, c, 64);
  _tile_stored(1, c + 256, 64);
  _tile_stored(2, c + 512, 64);
}

#endif

// a task's tiles: configured at its start, released at its end
struct AmxScope {
  explicit AmxScope(bool on) : on(on) {
#if defined(JAXLLM_AMX)
    if (on) amx_begin();
#endif
  }
  ~AmxScope() {
#if defined(JAXLLM_AMX)
    if (on) _tile_release();
#endif
  }
  bool on;
};

// v[j] (16 x 4-byte groups) <- the j-th group of every v: a 16 x 16 transpose
inline void transpose16(__m512i* v) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(v[i], v[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(v[i], v[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    v[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    v[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    v[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    v[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int h = 0; h < 16; h += 8)
    for (int i = 0; i < 4; ++i) {
      t[h + i] = _mm512_shuffle_i32x4(v[h + i], v[h + i + 4], 0x88);
      t[h + i + 4] = _mm512_shuffle_i32x4(v[h + i], v[h + i + 4], 0xdd);
    }
  for (int i = 0; i < 8; ++i) {
    v[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    v[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
  }
}

// pack columns [n, n + 16 * nr) of w [N, K] (K % 4 == 0): buf[kq][16 r + j] = w[n + 16 r + j,
// 4 kq .. 4 kq + 3]; wsum[16 r + j] = sum_k w[n + 16 r + j, k]
inline void pack_panel(const int8_t* w, int64_t K, int64_t n, int nr, int32_t* buf,
                       int32_t* wsum) {
  const __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6,
                                                           5, 4, 3, 2, 1, 0),
                                          _mm512_set1_epi32(static_cast<int32_t>(K)));
  const __m512i ones = _mm512_set1_epi8(1);
  for (int r = 0; r < nr; ++r) {
    const int8_t* base = w + (n + 16 * r) * K;
    __m512i sum = _mm512_setzero_si512();
    int64_t kq = 0;
    // 64 k of 16 rows: 16 loads and a 16 x 16 transpose of 4-byte groups (a gather per
    // group of 4 k would cost several times more)
    for (; kq + 16 <= K / 4; kq += 16) {
      __m512i v[16];
      for (int j = 0; j < 16; ++j) v[j] = _mm512_loadu_si512(base + j * K + 4 * kq);
      transpose16(v);
      for (int j = 0; j < 16; ++j) {
        _mm512_storeu_si512(buf + (kq + j) * kPanel + 16 * r, v[j]);
        sum = _mm512_dpbusd_epi32(sum, ones, v[j]);
      }
    }
    for (; kq < K / 4; ++kq) {
      const __m512i v = _mm512_i32gather_epi32(rows, base + 4 * kq, 1);
      _mm512_storeu_si512(buf + kq * kPanel + 16 * r, v);
      sum = _mm512_dpbusd_epi32(sum, ones, v);
    }
    _mm512_storeu_si512(wsum + 16 * r, sum);
  }
}

// MR activation rows x NR packed vectors of 16 columns
template <int MR, int NR>
void packed_tile(const int32_t* buf, const int32_t* wsum, const float* ws, const uint8_t* xu,
                 const float* xs, int64_t K, float* y, int64_t N) {
  __m512i acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < NR; ++r) acc[i][r] = _mm512_setzero_si512();
  for (int64_t kq = 0; kq < K / 4; ++kq) {
    __m512i wv[NR];
    for (int r = 0; r < NR; ++r) wv[r] = _mm512_loadu_si512(buf + kq * kPanel + 16 * r);
    for (int i = 0; i < MR; ++i) {
      int32_t a;
      std::memcpy(&a, xu + i * K + 4 * kq, 4);
      const __m512i xb = _mm512_set1_epi32(a);
      for (int r = 0; r < NR; ++r) acc[i][r] = _mm512_dpbusd_epi32(acc[i][r], xb, wv[r]);
    }
  }
  for (int r = 0; r < NR; ++r) {
    const __m512i corr = _mm512_slli_epi32(_mm512_loadu_si512(wsum + 16 * r), 7);  // 128 sum w
    const __m512 scale = _mm512_loadu_ps(ws + 16 * r);
    for (int i = 0; i < MR; ++i) {
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[i][r], corr));
      _mm512_storeu_ps(y + i * N + 16 * r,
                       _mm512_mul_ps(_mm512_mul_ps(dot, _mm512_set1_ps(xs[i])), scale));
    }
  }
}

template <int NR>
void packed_rows(const int32_t* buf, const int32_t* wsum, const float* ws, const uint8_t* xu,
                 const float* xs, int64_t M, int64_t K, float* y, int64_t N) {
  int64_t m = 0;
  for (; m + 8 <= M; m += 8) packed_tile<8, NR>(buf, wsum, ws, xu + m * K, xs + m, K, y + m * N, N);
  for (; m + 4 <= M; m += 4) packed_tile<4, NR>(buf, wsum, ws, xu + m * K, xs + m, K, y + m * N, N);
  for (; m < M; ++m) packed_tile<1, NR>(buf, wsum, ws, xu + m * K, xs + m, K, y + m * N, N);
}

#if defined(JAXLLM_AMX)
// packed_rows on AMX: xu holds M rows rounded up to 16 (the padding's sums are dropped); the
// same integer sums, then the same float arithmetic as packed_tile
void packed_rows_amx(const int32_t* buf, const int32_t* wsum, const float* ws, const uint8_t* xu,
                     const float* xs, int64_t M, int64_t K, float* y, int64_t N, int nr) {
  alignas(64) int32_t c[3 * 256];
  for (int64_t m0 = 0; m0 < M; m0 += 16) {
    amx_block<false>(xu + m0 * K, K, buf, K, nr);
    amx_store(c);
    for (int r = 0; r < nr; ++r) {
      const __m512i corr = _mm512_slli_epi32(_mm512_loadu_si512(wsum + 16 * r), 7);  // 128 sum w
      const __m512 scale = _mm512_loadu_ps(ws + 16 * r);
      for (int64_t i = 0; i < 16 && m0 + i < M; ++i) {
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_load_si512(c + 256 * r + 16 * i), corr));
        _mm512_storeu_ps(y + (m0 + i) * N + 16 * r,
                         _mm512_mul_ps(_mm512_mul_ps(dot, _mm512_set1_ps(xs[m0 + i])), scale));
      }
    }
  }
}
#else
void packed_rows_amx(const int32_t*, const int32_t*, const float*, const uint8_t*, const float*,
                     int64_t, int64_t, float*, int64_t, int) {}
#endif

// columns [n0, n1) (multiples of 16) of y [M, N]; amx: on the tiles (K a multiple of 64)
void w8a8_packed(const int8_t* w, const float* ws, const uint8_t* xu, const float* xs, int64_t M,
                 int64_t K, int64_t n0, int64_t n1, float* y, int64_t N, bool amx) {
  std::vector<int32_t> buf(K / 4 * kPanel);
  alignas(64) int32_t wsum[kPanel];
  AmxScope tiles(amx);
  for (int64_t n = n0; n < n1; n += kPanel) {
    const int nr = static_cast<int>(std::min<int64_t>(kPanel, n1 - n) / 16);
    pack_panel(w, K, n, nr, buf.data(), wsum);
    if (amx) {
      packed_rows_amx(buf.data(), wsum, ws + n, xu, xs, M, K, y + n, N, nr);
      continue;
    }
    switch (nr) {
      case 3: packed_rows<3>(buf.data(), wsum, ws + n, xu, xs, M, K, y + n, N); break;
      case 2: packed_rows<2>(buf.data(), wsum, ws + n, xu, xs, M, K, y + n, N); break;
      case 1: packed_rows<1>(buf.data(), wsum, ws + n, xu, xs, M, K, y + n, N); break;
    }
  }
}

// columns [n0, n1) (whole panels) of y [M, N] from panels packed at load (W8A8Panels): each
// panel is K / 4 rows of 48 words, then the 48 columns' sums
void w8a8_panels(const int32_t* w, const float* ws, const uint8_t* xu, const float* xs, int64_t M,
                 int64_t K, int64_t n0, int64_t n1, float* y, int64_t N, bool amx) {
  AmxScope tiles(amx);
  for (int64_t n = n0; n < n1; n += kPanel) {
    const int32_t* buf = w + n / kPanel * (K / 4 + 1) * kPanel;
    const int32_t* wsum = buf + K / 4 * kPanel;
    if (amx)
      packed_rows_amx(buf, wsum, ws + n, xu, xs, M, K, y + n, N, 3);
    else
      packed_rows<3>(buf, wsum, ws + n, xu, xs, M, K, y + n, N);
  }
}

constexpr bool kPackedKernel = true;

#else

constexpr bool kPackedKernel = false;
void w8a8_packed(const int8_t*, const float*, const uint8_t*, const float*, int64_t, int64_t,
                 int64_t, int64_t, float*, int64_t, bool) {}
void w8a8_panels(const int32_t*, const float*, const uint8_t*, const float*, int64_t, int64_t,
                 int64_t, int64_t, float*, int64_t, bool) {}

void w8a8_rows(const int8_t* w, const float* ws, const uint8_t* xu, const float* xs, int64_t M,
               int64_t K, int64_t n0, int64_t n1, float* y, int64_t N) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = n0; n < n1; ++n) {
      int64_t dot = 0;
      for (int64_t k = 0; k < K; ++k)
        dot += (static_cast<int>(xu[m * K + k]) - 128) * static_cast<int>(w[n * K + k]);
      y[m * N + n] = static_cast<float>(dot) * xs[m] * ws[n];
    }
}

#endif

// from this many activation rows the packed kernel wins (packing costs a pass over the
// weights; measured at [8, 576] x [576, 1536]: 136-150 GOP/s against 78-96)
constexpr int64_t kPackedMinRows = 8;

// per-channel scales of layer l as float32 (N values: a copy costs nothing)
std::shared_ptr<std::vector<float>> channel_scales(ffi::AnyBuffer& scale, bool f16, int64_t l,
                                                   int64_t N) {
  auto ws = std::make_shared<std::vector<float>>(N);
  const Scales sc = scales_at(scale, f16, l * N);
  for (int64_t n = 0; n < N; ++n) (*ws)[n] = sc[n];
  return ws;
}

struct QuantizedRows {
  std::shared_ptr<std::vector<uint8_t>> u;  // values + 128
  std::shared_ptr<std::vector<float>> s;    // each row's scale
};

// the first M rows of x quantized as quantize_rows does (divided by layer l's smoothing vector
// first), on this thread: a second round on the pool costs more in wake-ups than it saves.
// For AMX, which reads activations 16 rows at a time, the rows are padded to 16 (the padding
// rows' sums are dropped)
QuantizedRows quantized_rows(ffi::Buffer<ffi::F32>& x,
                             std::optional<ffi::Buffer<ffi::F32>>& smooth, int64_t l, int64_t M,
                             int64_t K, bool amx) {
  auto xu = std::make_shared<std::vector<uint8_t>>((amx ? (M + 15) / 16 * 16 : M) * K);
  auto xs = std::make_shared<std::vector<float>>(M);
  quantize_rows(x.typed_data(), smooth ? smooth->typed_data() + l * K : nullptr, M, K,
                xu->data(), xs->data());
  return {xu, xs};
}

ffi::Error W8A8Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> q,
                    ffi::AnyBuffer scale, std::optional<ffi::Buffer<ffi::F32>> smooth,
                    ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), qd = q.dimensions(), sd = scale.dimensions();
  if (xd.size() != 2 || qd.size() != 3 || sd.size() != 3)
    return ffi::Error::InvalidArgument("w8a8: x must be [M, K], q and scale [L, N, *]");
  const int64_t K = xd[1], L = qd[0], N = qd[1];
  if (qd[2] != K || sd[1] != N || sd[2] != 1)
    return ffi::Error::InvalidArgument("w8a8: shapes do not match (per-channel scales)");
  Index ix;
  if (auto e = read_index(layer, L, xd[0], &ix); e.failure()) return e;
  const int64_t l = ix.layer, M = ix.rows;
  const int8_t* w = q.typed_data() + l * N * K;
  bool f16 = false;
  if (!scale_type(scale, &f16)) return ffi::Error::InvalidArgument("w8a8: scale must be float16 or float32");
  auto wsv = channel_scales(scale, f16, l, N);
  zero_rows(y->typed_data(), M, xd[0], N);
  if (M == 0) return ffi::Error::Success();
  const bool packed = kPackedKernel && M >= kPackedMinRows && K % 4 == 0 && N % 16 == 0;
  const bool amx = packed && K % 64 == 0 && amx_on();
  const QuantizedRows xq = quantized_rows(x, smooth, l, M, K, amx);
  float* yp = y->typed_data();
  if (packed) {
    parallel_rows(pool, N, kPanel, [=](int64_t n0, int64_t n1) {
      w8a8_packed(w, wsv->data(), xq.u->data(), xq.s->data(), M, K, n0, n1, yp, N, amx);
    });
    return ffi::Error::Success();
  }
  parallel_rows(pool, N, 64, [=](int64_t n0, int64_t n1) {
    w8a8_rows(w, wsv->data(), xq.u->data(), xq.s->data(), M, K, n0, n1, yp, N);
  });
  return ffi::Error::Success();
}

// w: [L, P, K / 4 + 1, 48] int32: each 48-column panel of an int8 [N, K] matrix packed once at
// load in the order pack_panel packs it per call, followed by its columns' sums (the +128 of
// the unsigned activations). A call then reads the weights once, in order, at every row
// count: on AMX's tiles from kI8AmxMinRows rows, with VNNI below that (the gate/up stack of
// the default model over 30 layers: 1.59 ms on VNNI against 1.82 on AMX at 4 rows, 1.97
// against 1.90 at 5, 2.47 against 2.12 at 8).
constexpr int64_t kI8AmxMinRows = 5;

ffi::Error W8A8PanelsImpl(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, ffi::Buffer<ffi::S32>& w,
                          ffi::AnyBuffer& scale, std::optional<ffi::Buffer<ffi::F32>> smooth,
                          ffi::Buffer<ffi::S32>& layer, ffi::ResultBuffer<ffi::F32>& y) {
  auto xd = x.dimensions(), wd = w.dimensions(), sd = scale.dimensions();
  if (xd.size() != 2 || wd.size() != 4 || wd[3] != kPanel || sd.size() != 3)
    return ffi::Error::InvalidArgument("w8a8 panels: x must be [M, K], w [L, P, K / 4 + 1, 48], scale [L, N, 1]");
  const int64_t K = xd[1], L = wd[0], P = wd[1], N = P * kPanel;
  if (K % 4 || wd[2] != K / 4 + 1 || sd[0] != L || sd[1] != N || sd[2] != 1)
    return ffi::Error::InvalidArgument("w8a8 panels: shapes do not match (K a multiple of 4)");
  if (!kPackedKernel)
    return ffi::Error::InvalidArgument("w8a8 panels: this CPU has no AVX512-VNNI");
  Index ix;
  if (auto e = read_index(layer, L, xd[0], &ix); e.failure()) return e;
  const int64_t l = ix.layer, M = ix.rows;
  bool f16 = false;
  if (!scale_type(scale, &f16)) return ffi::Error::InvalidArgument("w8a8 panels: scale must be float16 or float32");
  auto wsv = channel_scales(scale, f16, l, N);
  float* yp = y->typed_data();
  zero_rows(yp, M, xd[0], N);
  if (M == 0) return ffi::Error::Success();
  const bool amx = M >= kI8AmxMinRows && K % 64 == 0 && amx_on();
  const QuantizedRows xq = quantized_rows(x, smooth, l, M, K, amx);
  const int32_t* wp = w.typed_data() + l * P * (K / 4 + 1) * kPanel;
  parallel_rows(pool, N, kPanel, [=](int64_t n0, int64_t n1) {
    w8a8_panels(wp, wsv->data(), xq.u->data(), xq.s->data(), M, K, n0, n1, yp, N, amx);
  });
  return ffi::Error::Success();
}

ffi::Error W8A8Panels(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> w,
                      ffi::AnyBuffer scale, ffi::Buffer<ffi::S32> layer,
                      ffi::ResultBuffer<ffi::F32> y) {
  return W8A8PanelsImpl(pool, x, w, scale, std::nullopt, layer, y);
}

ffi::Error W8A8PanelsSmooth(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> w,
                            ffi::AnyBuffer scale, ffi::Buffer<ffi::F32> smooth,
                            ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
  return W8A8PanelsImpl(pool, x, w, scale, smooth, layer, y);
}

ffi::Error W8A8Plain(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> q,
                     ffi::AnyBuffer scale, ffi::Buffer<ffi::S32> layer,
                     ffi::ResultBuffer<ffi::F32> y) {
  return W8A8Impl(pool, x, q, scale, std::nullopt, layer, y);
}

ffi::Error W8A8Smooth(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> q,
                      ffi::AnyBuffer scale, ffi::Buffer<ffi::F32> smooth,
                      ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
  return W8A8Impl(pool, x, q, scale, smooth, layer, y);
}

// ---- bf16 weights ----

inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

#if defined(__AVX512F__)

inline __m512 bf16x16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// in_out: y[i, n..n+16*NC) = sum_k x[i, k] w[k, n..]; W is streamed row by row, each row's
// 16*NC columns once per MR activation rows
template <int MR, int NC>
void bf16_io_tile(const uint16_t* w, const float* x, int64_t K, int64_t N, int64_t n, float* y) {
  __m512 acc[MR][NC];
  for (int i = 0; i < MR; ++i)
    for (int c = 0; c < NC; ++c) acc[i][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const uint16_t* row = w + k * N + n;
    __m512 wv[NC];
    for (int c = 0; c < NC; ++c) wv[c] = bf16x16(row + 16 * c);
    for (int i = 0; i < MR; ++i) {
      const __m512 xb = _mm512_set1_ps(x[i * K + k]);
      for (int c = 0; c < NC; ++c) acc[i][c] = _mm512_fmadd_ps(xb, wv[c], acc[i][c]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(y + i * N + n + 16 * c, acc[i][c]);
}

template <int MR, int NC>
void bf16_io_cols(const uint16_t* w, const float* x, int64_t K, int64_t N, int64_t n0,
                  int64_t n1, float* y) {
  int64_t n = n0;
  for (; n + 16 * NC <= n1; n += 16 * NC) bf16_io_tile<MR, NC>(w, x, K, N, n, y);
  for (; n + 16 <= n1; n += 16) bf16_io_tile<MR, 1>(w, x, K, N, n, y);
  for (; n < n1; ++n)
    for (int i = 0; i < MR; ++i) {
      float s = 0;
      for (int64_t k = 0; k < K; ++k) s += x[i * K + k] * bf16_to_float(w[k * N + n]);
      y[i * N + n] = s;
    }
}

void bf16_in_out(const uint16_t* w, const float* x, int64_t M, int64_t K, int64_t N, int64_t n0,
                 int64_t n1, float* y) {
  // fewer activation rows leave registers for more columns per pass over W
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) bf16_io_cols<4, 4>(w, x + m * K, K, N, n0, n1, y + m * N);
  switch (M - m) {
    case 3: bf16_io_cols<3, 4>(w, x + m * K, K, N, n0, n1, y + m * N); break;
    case 2: bf16_io_cols<2, 8>(w, x + m * K, K, N, n0, n1, y + m * N); break;
    case 1: bf16_io_cols<1, 8>(w, x + m * K, K, N, n0, n1, y + m * N); break;
  }
}

// out_in: rows of W are contiguous in K, dot products reduced at the end (as tile above)
template <int NR, int MR>
void bf16_oi_tile(const uint16_t* w, const float* x, int64_t K, int64_t n, float* y, int64_t N) {
  __m512 acc[NR][MR];
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < MR; ++i) acc[r][i] = _mm512_setzero_ps();
  const int64_t K16 = K - K % 16;
  for (int64_t k = 0; k < K16; k += 16) {
    __m512 xv[MR];
    for (int i = 0; i < MR; ++i) xv[i] = _mm512_loadu_ps(x + i * K + k);
    for (int r = 0; r < NR; ++r) {
      const __m512 wv = bf16x16(w + (n + r) * K + k);
      for (int i = 0; i < MR; ++i) acc[r][i] = _mm512_fmadd_ps(wv, xv[i], acc[r][i]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < MR; ++i) {
      float s = _mm512_reduce_add_ps(acc[r][i]);
      for (int64_t k = K16; k < K; ++k) s += x[i * K + k] * bf16_to_float(w[(n + r) * K + k]);
      y[i * N + n + r] = s;
    }
}

template <int MR>
void bf16_oi_rows(const uint16_t* w, const float* x, int64_t K, int64_t n0, int64_t n1,
                  float* y, int64_t N) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) bf16_oi_tile<4, MR>(w, x, K, n, y, N);
  for (; n < n1; ++n) bf16_oi_tile<1, MR>(w, x, K, n, y, N);
}

void bf16_out_in(const uint16_t* w, const float* x, int64_t M, int64_t K, int64_t N, int64_t n0,
                 int64_t n1, float* y) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) bf16_oi_rows<4>(w, x + m * K, K, n0, n1, y + m * N, N);
  switch (M - m) {
    case 3: bf16_oi_rows<3>(w, x + m * K, K, n0, n1, y + m * N, N); break;
    case 2: bf16_oi_rows<2>(w, x + m * K, K, n0, n1, y + m * N, N); break;
    case 1: bf16_oi_rows<1>(w, x + m * K, K, n0, n1, y + m * N, N); break;
  }
}

#else  // portable fallback

void bf16_in_out(const uint16_t* w, const float* x, int64_t M, int64_t K, int64_t N, int64_t n0,
                 int64_t n1, float* y) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = n0; n < n1; ++n) {
      float s = 0;
      for (int64_t k = 0; k < K; ++k) s += x[m * K + k] * bf16_to_float(w[k * N + n]);
      y[m * N + n] = s;
    }
}

void bf16_out_in(const uint16_t* w, const float* x, int64_t M, int64_t K, int64_t N, int64_t n0,
                 int64_t n1, float* y) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = n0; n < n1; ++n) {
      float s = 0;
      for (int64_t k = 0; k < K; ++k) s += x[m * K + k] * bf16_to_float(w[n * K + k]);
      y[m * N + n] = s;
    }
}

#endif

// w: [L, K, N] (in_out) or [L, N, K] (out_in), bf16; layer picks one matrix in place
// Many activation rows, with AVX512-BF16: the activations are rounded to bf16 and multiplied
// by pairs of k with vdpbf16ps (twice the products of an f32 FMA per instruction). As for w8a8,
// each 48-column panel of weights is first packed in the instruction's order, a pair of k of
// 16 columns per vector, and serves every row from the cache.
#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)

constexpr bool kBf16Packed = true;

// buf[kp][16 r + j] = (w[2 kp, n + 16 r + j], w[2 kp + 1, ...]) for in_out [K, N] (K even)
inline void pack_bf16_io(const uint16_t* w, int64_t K, int64_t N, int64_t n, int nr,
                         uint32_t* buf) {
  for (int64_t kp = 0; kp < K / 2; ++kp)
    for (int r = 0; r < nr; ++r) {
      const uint16_t* p = w + 2 * kp * N + n + 16 * r;
      const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
      const __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + N)));
      _mm512_storeu_si512(buf + kp * kPanel + 16 * r, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
}

// the same from out_in [N, K]: a pair of k is 4 bytes of a row, so int8's transposes serve
inline void pack_bf16_oi(const uint16_t* w, int64_t K, int64_t n, int nr, uint32_t* buf) {
  const int64_t KP = K / 2;
  for (int r = 0; r < nr; ++r) {
    const uint16_t* base = w + (n + 16 * r) * K;
    int64_t kp = 0;
    for (; kp + 16 <= KP; kp += 16) {
      __m512i v[16];
      for (int j = 0; j < 16; ++j) v[j] = _mm512_loadu_si512(base + j * K + 2 * kp);
      transpose16(v);
      for (int j = 0; j < 16; ++j) _mm512_storeu_si512(buf + (kp + j) * kPanel + 16 * r, v[j]);
    }
    for (; kp < KP; ++kp)
      for (int j = 0; j < 16; ++j) std::memcpy(buf + kp * kPanel + 16 * r + j, base + j * K + 2 * kp, 4);
  }
}

// one-byte codes [N, K] (int8, or fp8 e4m3) as bf16 pairs (exact: 8 and 4 significant bits),
// in pack_bf16_oi's order
template <typename T>
inline void pack_codes_oi(const T* w, int64_t K, int64_t n, int nr, uint32_t* buf) {
  const int64_t KP = K / 2;
  for (int r = 0; r < nr; ++r) {
    const T* base = w + (n + 16 * r) * K;
    int64_t kp = 0;
    for (; kp + 16 <= KP; kp += 16) {
      __m512i v[16];
      for (int j = 0; j < 16; ++j) {
        const T* p = base + j * K + 2 * kp;
        v[j] = (__m512i)_mm512_cvtne2ps_pbh(load16(p + 16), load16(p));  // k 0..15 low, 16..31 high
      }
      transpose16(v);
      for (int j = 0; j < 16; ++j) _mm512_storeu_si512(buf + (kp + j) * kPanel + 16 * r, v[j]);
    }
    for (; kp < KP; ++kp)
      for (int j = 0; j < 16; ++j) {
        const float lo = load_kv(base + j * K + 2 * kp), hi = load_kv(base + j * K + 2 * kp + 1);
        uint32_t bl, bh;
        std::memcpy(&bl, &lo, 4);
        std::memcpy(&bh, &hi, 4);
        buf[kp * kPanel + 16 * r + j] = (bl >> 16) | (bh & 0xffff0000u);
      }
  }
}

template <int MR, int NR>
void bf16_packed_tile(const uint32_t* buf, const uint16_t* xb, int64_t K, float* y, int64_t N) {
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < NR; ++r) acc[i][r] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < K / 2; ++kp) {
    __m512bh wv[NR];
    for (int r = 0; r < NR; ++r) wv[r] = (__m512bh)_mm512_loadu_si512(buf + kp * kPanel + 16 * r);
    for (int i = 0; i < MR; ++i) {
      int32_t a;
      std::memcpy(&a, xb + i * K + 2 * kp, 4);
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(a);
      for (int r = 0; r < NR; ++r) acc[i][r] = _mm512_dpbf16_ps(acc[i][r], xv, wv[r]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < NR; ++r) _mm512_storeu_ps(y + i * N + 16 * r, acc[i][r]);
}

template <int NR>
void bf16_packed_rows(const uint32_t* buf, const uint16_t* xb, int64_t M, int64_t K, float* y,
                      int64_t N) {
  int64_t m = 0;
  for (; m + 8 <= M; m += 8) bf16_packed_tile<8, NR>(buf, xb + m * K, K, y + m * N, N);
  for (; m + 4 <= M; m += 4) bf16_packed_tile<4, NR>(buf, xb + m * K, K, y + m * N, N);
  for (; m < M; ++m) bf16_packed_tile<1, NR>(buf, xb + m * K, K, y + m * N, N);
}

#if defined(JAXLLM_AMX)
// bf16_packed_rows on AMX: xb holds M rows rounded up to 16 (the padding's sums are dropped)
void bf16_amx_rows(const uint32_t* buf, const uint16_t* xb, int64_t M, int64_t K, float* y,
                   int64_t N, int nr) {
  alignas(64) int32_t c[3 * 256];
  for (int64_t m0 = 0; m0 < M; m0 += 16) {
    amx_block<true>(xb + m0 * K, 2 * K, reinterpret_cast<const int32_t*>(buf), K, nr);
    if (m0 + 16 <= M) {  // straight into y
      float* out = y + m0 * N;
      _tile_stored(0, out, 4 * N);
      if (nr > 1) _tile_stored(1, out + 16, 4 * N);
      if (nr > 2) _tile_stored(2, out + 32, 4 * N);
      continue;
    }
    amx_store(c);
    for (int64_t i = 0; m0 + i < M; ++i)
      for (int r = 0; r < nr; ++r) std::memcpy(y + (m0 + i) * N + 16 * r, c + 256 * r + 16 * i, 64);
  }
}
#endif

// the panel's columns of y for all M rows: on AMX's tiles when `amx` (K a multiple of 32)
template <int NR>
inline void bf16_rows(const uint32_t* buf, const uint16_t* xb, int64_t M, int64_t K, float* y,
                      int64_t N, bool amx) {
#if defined(JAXLLM_AMX)
  if (amx) return bf16_amx_rows(buf, xb, M, K, y, N, NR);
#endif
  bf16_packed_rows<NR>(buf, xb, M, K, y, N);
}

inline void bf16_panel(const uint32_t* buf, const uint16_t* xb, int64_t M, int64_t K, float* y,
                       int64_t N, int nr, bool amx) {
  switch (nr) {
    case 3: bf16_rows<3>(buf, xb, M, K, y, N, amx); break;
    case 2: bf16_rows<2>(buf, xb, M, K, y, N, amx); break;
    case 1: bf16_rows<1>(buf, xb, M, K, y, N, amx); break;
  }
}

void bf16_packed(const uint16_t* w, const uint16_t* xb, int64_t M, int64_t K, int64_t N,
                 int64_t n0, int64_t n1, float* y, bool in_out, bool amx) {
  std::vector<uint32_t> buf(K / 2 * kPanel);
  AmxScope tiles(amx);
  for (int64_t n = n0; n < n1; n += kPanel) {
    const int nr = static_cast<int>(std::min<int64_t>(kPanel, n1 - n) / 16);
    if (in_out) pack_bf16_io(w, K, N, n, nr, buf.data());
    else pack_bf16_oi(w, K, n, nr, buf.data());
    bf16_panel(buf.data(), xb, M, K, y + n, N, nr, amx);
  }
}

// y = xb . (codes * scale)^T for one-byte codes [N, K] (int8 or fp8) with one scale per
// column: the codes as bf16 pairs, the scales applied to each finished panel (xs: each row's
// activation scale first, when the activations were quantized)
template <typename T>
void codes_packed(const T* w, const Scales& sc, const float* xs, const uint16_t* xb, int64_t M,
                  int64_t K, int64_t N, int64_t n0, int64_t n1, float* y, bool amx) {
  std::vector<uint32_t> buf(K / 2 * kPanel);
  AmxScope tiles(amx);
  for (int64_t n = n0; n < n1; n += kPanel) {
    const int nr = static_cast<int>(std::min<int64_t>(kPanel, n1 - n) / 16);
    pack_codes_oi(w, K, n, nr, buf.data());
    bf16_panel(buf.data(), xb, M, K, y + n, N, nr, amx);
    alignas(64) float s[kPanel];
    for (int c = 0; c < 16 * nr; ++c) s[c] = sc[n + c];
    for (int64_t m = 0; m < M; ++m) {
      const __m512 xm = _mm512_set1_ps(xs ? xs[m] : 1.0f);
      for (int r = 0; r < nr; ++r) {
        float* p = y + m * N + n + 16 * r;
        __m512 v = _mm512_loadu_ps(p);
        if (xs) v = _mm512_mul_ps(v, xm);
        _mm512_storeu_ps(p, _mm512_mul_ps(v, _mm512_load_ps(s + 16 * r)));
      }
    }
  }
}

// f32 -> bf16, round to nearest even (as jnp's astype)
void round_bf16(const float* x, int64_t n, uint16_t* out) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
  for (; i < n; ++i) {
    uint32_t b;
    std::memcpy(&b, x + i, 4);
    out[i] = static_cast<uint16_t>((b + 0x7fff + ((b >> 16) & 1)) >> 16);
  }
}

#else

constexpr bool kBf16Packed = false;
void bf16_packed(const uint16_t*, const uint16_t*, int64_t, int64_t, int64_t, int64_t, int64_t,
                 float*, bool, bool) {}
void round_bf16(const float*, int64_t, uint16_t*) {}
void bf16_panel(const uint32_t*, const uint16_t*, int64_t, int64_t, float*, int64_t, int, bool) {}
template <typename T>
void codes_packed(const T*, const Scales&, const float*, const uint16_t*, int64_t, int64_t,
                  int64_t, int64_t, int64_t, float*, bool) {}

#endif

// from this many activation rows the bf16 weights multiply activations rounded to bf16 (the
// engine's bf16 policy rounds them before every dot, so there both paths see the same values)
constexpr int64_t kBf16PackedMinRows = 16;
// on AMX's tiles packing the weights bounds the packed path, not the products: from 4 rows it
// wins ([M, 576] x [576, 3072] and the layers' other three x 30: 13 ms from 2 to 8 rows,
// against 18 ms at 4 rows and 21 ms at 8 for the float kernel)
constexpr int64_t kBf16AmxMinRows = 4;

ffi::Error Bf16Impl(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, ffi::Buffer<ffi::BF16>& w,
                    ffi::Buffer<ffi::S32>& layer, ffi::ResultBuffer<ffi::F32>& y, bool in_out) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3)
    return ffi::Error::InvalidArgument("bf16 matmul: x must be [M, K], w [L, *, *]");
  const int64_t K = xd[1], L = wd[0];
  const int64_t N = in_out ? wd[2] : wd[1];
  if ((in_out ? wd[1] : wd[2]) != K)
    return ffi::Error::InvalidArgument("bf16 matmul: shapes do not match");
  Index ix;
  if (auto e = read_index(layer, L, xd[0], &ix); e.failure()) return e;
  const int64_t l = ix.layer, M = ix.rows;
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.typed_data()) + l * K * N;
  const float* xp = x.typed_data();
  float* yp = y->typed_data();
  zero_rows(yp, M, xd[0], N);
  if (M == 0) return ffi::Error::Success();
  const bool amx = kBf16Packed && K % 32 == 0 && N % 16 == 0 && amx_on();
  if (kBf16Packed && M >= (amx ? kBf16AmxMinRows : kBf16PackedMinRows) && K % 2 == 0 &&
      N % 16 == 0) {
    // AMX reads activations 16 rows at a time: the last tile's padding rows are zeros
    auto xb = std::make_shared<std::vector<uint16_t>>((amx ? (M + 15) / 16 * 16 : M) * K);
    round_bf16(xp, M * K, xb->data());
    parallel_rows(pool, N, kPanel, [=](int64_t n0, int64_t n1) {
      bf16_packed(wp, xb->data(), M, K, N, n0, n1, yp, in_out, amx);
    });
    return ffi::Error::Success();
  }
  if (in_out) {
    // column chunks of whole 128-column tiles, so threads never share a tile
    parallel_rows(pool, N, 128, [=](int64_t n0, int64_t n1) { bf16_in_out(wp, xp, M, K, N, n0, n1, yp); });
  } else {
    parallel_rows(pool, N, 64, [=](int64_t n0, int64_t n1) { bf16_out_in(wp, xp, M, K, N, n0, n1, yp); }, 4);
  }
  return ffi::Error::Success();
}

// int8 codes with one scale per output channel (weight-only: W8A16) times activations the
// engine rounded to bf16 (its CPU bf16 policy): from 16 rows (4 on AMX) the codes are packed
// as bf16 and multiplied with vdpbf16ps or on the tiles (products of bf16 and int8 are exact
// in f32), below that the float kernel computes the same products
ffi::Error QmmSymBf16(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer q,
                      ffi::AnyBuffer scale, ffi::Buffer<ffi::S32> layer,
                      ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), qd = q.dimensions(), sd = scale.dimensions();
  if (xd.size() != 2 || qd.size() != 3 || sd.size() != 3)
    return ffi::Error::InvalidArgument("qmm: x must be [M, K], q and scale [L, N, *]");
  const int64_t K = xd[1], L = qd[0], N = qd[1];
  Index ix;
  if (auto e = read_index(layer, L, xd[0], &ix); e.failure()) return e;
  const int64_t M = ix.rows;
  bool f16 = false;
  const bool amx = kBf16Packed && amx_on();
  if (!kBf16Packed || M < (amx ? kBf16AmxMinRows : kBf16PackedMinRows) || K % 32 || N % 16 ||
      q.element_type() != ffi::DataType::S8 || qd[2] != K || sd[1] != N || sd[2] != 1 ||
      !scale_type(scale, &f16))
    return QmmImpl(pool, x, q, scale, std::nullopt, layer, y);  // checks and reports shapes
  const int8_t* w = static_cast<const int8_t*>(q.untyped_data()) + ix.layer * N * K;
  const Scales sc = scales_at(scale, f16, ix.layer * N);
  float* yp = y->typed_data();
  zero_rows(yp, M, xd[0], N);
  auto xb = std::make_shared<std::vector<uint16_t>>((amx ? (M + 15) / 16 * 16 : M) * K);
  round_bf16(x.typed_data(), M * K, xb->data());
  parallel_rows(pool, N, kPanel, [=](int64_t n0, int64_t n1) {
    codes_packed(w, sc, nullptr, xb->data(), M, K, N, n0, n1, yp, amx);
  });
  return ffi::Error::Success();
}

// f32 -> the nearest e4m3fn value, ties to even (as XLA's convert), for |v| <= 448, as bf16
// bits (exact: 4 significant bits)
inline uint16_t e4m3_as_bf16(float v) {
  uint32_t b;
  std::memcpy(&b, &v, 4);
  const uint32_t sign = b & 0x80000000u, a = b & 0x7fffffffu;
  float av;
  std::memcpy(&av, &a, 4);
  uint32_t r;
  if (av < 0.015625f) {  // under e4m3's smallest normal (2^-6) its values are multiples of 2^-9
    const float q = std::nearbyint(av * 512.0f) / 512.0f;  // power-of-two scalings: exact
    std::memcpy(&r, &q, 4);
  } else {
    r = (a + 0x7ffffu + ((a >> 20) & 1)) & 0xfff00000u;  // 3 mantissa bits
  }
  return static_cast<uint16_t>((sign | r) >> 16);
}

// The `fp8` method: e4m3 weights with one scale per output channel, activations quantized per
// token to e4m3 at run time (scale max|x| / 448). XLA:CPU only emulates an fp8 dot (measured:
// 190 ms a decode step of the default model's shapes at one sequence, against 22 for int8
// weights); both e4m3 operands are exact in bf16, so vdpbf16ps and AMX's tiles multiply them
// as fp8 would, with f32 sums, and the row and column scales apply to each finished panel.
ffi::Error Fp8Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer q,
                     ffi::AnyBuffer scale, ffi::Buffer<ffi::S32> layer,
                     ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), qd = q.dimensions(), sd = scale.dimensions();
  if (xd.size() != 2 || qd.size() != 3 || sd.size() != 3)
    return ffi::Error::InvalidArgument("fp8 matmul: x must be [M, K], q and scale [L, N, *]");
  const int64_t K = xd[1], L = qd[0], N = qd[1];
  bool f16 = false;
  if (qd[2] != K || sd[0] != L || sd[1] != N || sd[2] != 1 || K % 32 || N % 16 ||
      !scale_type(scale, &f16) ||
      (q.element_type() != ffi::DataType::F8E4M3FN && q.element_type() != ffi::DataType::U8))
    return ffi::Error::InvalidArgument(
        "fp8 matmul: e4m3 codes [L, N, K] with scales [L, N, 1], K a multiple of 32, N of 16");
  if (!kBf16Packed) return ffi::Error::InvalidArgument("fp8 matmul: this CPU has no AVX512-BF16");
  Index ix;
  if (auto e = read_index(layer, L, xd[0], &ix); e.failure()) return e;
  const int64_t M = ix.rows;
  const Fp8* w = static_cast<const Fp8*>(q.untyped_data()) + ix.layer * N * K;
  const Scales sc = scales_at(scale, f16, ix.layer * N);
  float* yp = y->typed_data();
  zero_rows(yp, M, xd[0], N);
  if (M == 0) return ffi::Error::Success();
  const bool amx = M >= kBf16AmxMinRows && amx_on();
  // AMX reads activations 16 rows at a time: the last tile's padding rows are zeros
  auto xb = std::make_shared<std::vector<uint16_t>>((amx ? (M + 15) / 16 * 16 : M) * K);
  auto xs = std::make_shared<std::vector<float>>(M);
  const float* xp = x.typed_data();
  for (int64_t m = 0; m < M; ++m) {
    const float* row = xp + m * K;
    float amax = 0.0f;
    for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(row[k]));
    const float s = amax > 0 ? amax / 448.0f : 1.0f;
    (*xs)[m] = s;
    for (int64_t k = 0; k < K; ++k) (*xb)[m * K + k] = e4m3_as_bf16(row[k] / s);
  }
  parallel_rows(pool, N, kPanel, [=](int64_t n0, int64_t n1) {
    codes_packed(w, sc, xs->data(), xb->data(), M, K, N, n0, n1, yp, amx);
  });
  return ffi::Error::Success();
}

// w: [L, P, K / 2, 48] uint32, each 48-column panel of a bf16 [K, N] matrix (N = 48 P) packed
// once at load in the order the kernels above pack it per call (pack_bf16_io): a panel is
// then K / 2 x 192 contiguous bytes, and a call reads the weights once, in order. Packing per
// call cost more than the products at every row count (the four layer matmuls of the default
// model over 30 layers, one thread: 31 -> 18 ms at 64 rows, 21 -> 9.5 ms at 4).
ffi::Error Bf16Panels(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U32> w,
                      ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 4 || wd[3] != kPanel)
    return ffi::Error::InvalidArgument("bf16 panels: x must be [M, K], w [L, P, K / 2, 48]");
  const int64_t K = xd[1], L = wd[0], P = wd[1], N = P * kPanel;
  if (wd[2] * 2 != K || K % 32)
    return ffi::Error::InvalidArgument("bf16 panels: shapes do not match (K a multiple of 32)");
  if (!kBf16Packed)
    return ffi::Error::InvalidArgument("bf16 panels: this CPU has no AVX512-BF16");
  Index ix;
  if (auto e = read_index(layer, L, xd[0], &ix); e.failure()) return e;
  const int64_t M = ix.rows;
  const uint32_t* wp = w.typed_data() + ix.layer * P * (K / 2) * kPanel;
  float* yp = y->typed_data();
  zero_rows(yp, M, xd[0], N);
  if (M == 0) return ffi::Error::Success();
  const bool amx = M >= kBf16AmxMinRows && amx_on();
  // AMX reads activations 16 rows at a time: the last tile's padding rows are zeros
  auto xb = std::make_shared<std::vector<uint16_t>>((amx ? (M + 15) / 16 * 16 : M) * K);
  round_bf16(x.typed_data(), M * K, xb->data());
  parallel_rows(pool, N, kPanel, [=](int64_t n0, int64_t n1) {
    AmxScope tiles(amx);
    for (int64_t n = n0; n < n1; n += kPanel)
      bf16_panel(wp + n / kPanel * (K / 2) * kPanel, xb->data(), M, K, yp + n, N, 3, amx);
  });
  return ffi::Error::Success();
}

ffi::Error Bf16InOut(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::BF16> w,
                     ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
  return Bf16Impl(pool, x, w, layer, y, true);
}

ffi::Error Bf16OutIn(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::BF16> w,
                     ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
  return Bf16Impl(pool, x, w, layer, y, false);
}

}  // namespace

// ---- decode attention ----
// The last token of each sequence against its cached context, read in place from the paged
// cache [L, 2, KVH, slots, D] (f32, bf16 kept as uint16 bits, or int8 / fp8 with a scale per
// token and head, as kv.py writes them): XLA's form gathers (and dequantizes) every
// context row into a new array first, which at many sequences costs more than the arithmetic.
// One task per (sequence, KV head) runs its G query heads' online softmax over chunks of 16
// positions. With AVX-512 a chunk's 16 scores are one vector: each position's D products are
// summed by a 16 x 16 transposing reduction (not one horizontal sum per score), and exp runs
// on the vector. Matches the XLA decode pass (attention.py) to float rounding.
namespace {

constexpr int kAttnChunk = 16;

// Whether the cache holds quantized values with a scale per token and head (kv.py): int8 or
// fp8. Their rows are widened, then multiplied by the scale, as kv.read dequantizes.
template <typename T>
constexpr bool kScaled = std::is_same_v<T, int8_t> || std::is_same_v<T, Fp8>;

inline float load_kv(const float* p) { return *p; }
inline float load_kv(const uint16_t* p) { return bf16_to_float(*p); }

#if defined(__AVX512F__)

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) { return bf16x16(p); }

// r[t] = sum of the 16 lanes of d[t], for t < 16
inline __m512 transpose_sum16(const __m512* d) {
  __m512 e[8], f[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    e[i] = _mm512_add_ps(_mm512_unpacklo_ps(d[2 * i], d[2 * i + 1]),
                         _mm512_unpackhi_ps(d[2 * i], d[2 * i + 1]));
  for (int j = 0; j < 4; ++j) {  // per 128-bit lane: the sums of positions 4j .. 4j+3
    const __m512d x = _mm512_castps_pd(e[2 * j]), y = _mm512_castps_pd(e[2 * j + 1]);
    f[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // add the four 128-bit lanes of each f[j] and put f[j]'s into lane j
  const __m512 h01 = _mm512_add_ps(_mm512_shuffle_f32x4(f[0], f[1], 0x44),
                                   _mm512_shuffle_f32x4(f[0], f[1], 0xEE));
  const __m512 h23 = _mm512_add_ps(_mm512_shuffle_f32x4(f[2], f[3], 0x44),
                                   _mm512_shuffle_f32x4(f[2], f[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(h01, h23, 0x88), _mm512_shuffle_f32x4(h01, h23, 0xDD));
}

// e^x for x <= 0 (scores less their maximum): 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2],
// p of degree 6 (relative error ~2e-7); below -87 the result is 0
inline __m512 exp16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.0f);
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_max_ps(x, lo);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_maskz_mov_ps(~tiny, _mm512_scalef_ps(p, n));
}

// a chunk's 16 scores from their dot-product vectors d: summed, soft-capped when asked, and
// the positions outside `live` (the context, the causal edge) at -1e30
inline __m512 chunk_scores(const __m512* d, float soft_cap, __mmask16 live) {
  __m512 sc = transpose_sum16(d);
  if (soft_cap > 0) {
    alignas(64) float tmp[kAttnChunk];
    _mm512_store_ps(tmp, sc);
    for (int t = 0; t < kAttnChunk; ++t) tmp[t] = soft_cap * std::tanh(tmp[t] / soft_cap);
    sc = _mm512_load_ps(tmp);
  }
  return _mm512_mask_mov_ps(_mm512_set1_ps(-1e30f), live, sc);
}

// D = 16 * NV. Per chunk: the chunk's K rows widened to f32 once (L1), each query head's 16
// scores as one vector, the online-softmax update, then each V row once for all G heads. A
// quantized cache's K rows are scaled as they are widened; a V row's scale goes into its
// probabilities (ks, vs: the scale planes, per slot; unused for float caches).
template <int NV, typename T>
void attend_vec(const float* q, const T* k_base, const T* v_base, const float* ks,
                const float* vs, const int32_t* table, int64_t bs, int64_t lo, int64_t n,
                int64_t G, float soft_cap, float* out) {
  constexpr int64_t D = 16 * NV;
  constexpr int kMaxG = 8;
  alignas(64) float kf[kAttnChunk][D];
  alignas(64) float pr[kMaxG][kAttnChunk];
  float vscale[kAttnChunk];
  __m512 acc[kMaxG][NV];
  float m[kMaxG], l[kMaxG];
  for (int64_t g = 0; g < G; ++g) {
    m[g] = -1e30f;
    l[g] = 0.0f;
    for (int j = 0; j < NV; ++j) acc[g][j] = _mm512_setzero_ps();
  }
  const T* krow[kAttnChunk];
  const T* vrow[kAttnChunk];
  for (int64_t c0 = lo - lo % kAttnChunk; c0 < n; c0 += kAttnChunk) {
    // positions c0 + t, t in [t0, t1), are in the context window
    const int64_t t0 = std::max<int64_t>(lo - c0, 0), t1 = std::min<int64_t>(kAttnChunk, n - c0);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t pos = c0 + t;
      const int64_t slot = int64_t(table[pos / bs]) * bs + pos % bs;
      krow[t] = k_base + slot * D;
      vrow[t] = v_base + slot * D;
      if constexpr (kScaled<T>) {
        const __m512 sk = _mm512_set1_ps(ks[slot]);
        vscale[t] = vs[slot];
        for (int j = 0; j < NV; ++j)
          _mm512_store_ps(&kf[t][16 * j], _mm512_mul_ps(load16(krow[t] + 16 * j), sk));
      } else {
        for (int j = 0; j < NV; ++j) _mm512_store_ps(&kf[t][16 * j], load16(krow[t] + 16 * j));
      }
    }
    const __mmask16 live = __mmask16(((1u << t1) - 1) & ~((1u << t0) - 1));
    // the next chunk's rows, a block that may lie anywhere in the cache: no hardware
    // prefetcher would fetch it before the loads below miss (30 layers at 64 sequences x 270
    // tokens: 35 -> 29 ms)
    for (int64_t t = 0, c1 = c0 + kAttnChunk; t < kAttnChunk && c1 + t < n; ++t) {
      const int64_t pos = c1 + t;
      const int64_t slot = int64_t(table[pos / bs]) * bs + pos % bs;
      for (int64_t b = 0; b < int64_t(D * sizeof(T)); b += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(k_base + slot * D) + b, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(v_base + slot * D) + b, _MM_HINT_T0);
      }
      if constexpr (kScaled<T>) {
        _mm_prefetch(reinterpret_cast<const char*>(ks + slot), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(vs + slot), _MM_HINT_T0);
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      __m512 d[kAttnChunk];
      __m512 qv[NV];
      for (int j = 0; j < NV; ++j) qv[j] = _mm512_loadu_ps(q + g * D + 16 * j);
      for (int t = 0; t < kAttnChunk; ++t) {
        if (t < t0 || t >= t1) {
          d[t] = _mm512_setzero_ps();
          continue;
        }
        __m512 x = _mm512_mul_ps(qv[0], _mm512_load_ps(&kf[t][0]));
        for (int j = 1; j < NV; ++j) x = _mm512_fmadd_ps(qv[j], _mm512_load_ps(&kf[t][16 * j]), x);
        d[t] = x;
      }
      const __m512 sc = chunk_scores(d, soft_cap, live);
      const float m_new = std::max(m[g], _mm512_reduce_max_ps(sc));
      const float corr = std::exp(m[g] - m_new);
      m[g] = m_new;
      const __m512 p = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(sc, _mm512_set1_ps(m_new))));
      l[g] = l[g] * corr + _mm512_reduce_add_ps(p);
      _mm512_store_ps(pr[g], p);
      const __m512 cv = _mm512_set1_ps(corr);
      for (int j = 0; j < NV; ++j) acc[g][j] = _mm512_mul_ps(acc[g][j], cv);
    }
    for (int64_t t = t0; t < t1; ++t) {
      __m512 vv[NV];
      for (int j = 0; j < NV; ++j) vv[j] = load16(vrow[t] + 16 * j);
      for (int64_t g = 0; g < G; ++g) {
        const __m512 pv = _mm512_set1_ps(kScaled<T> ? pr[g][t] * vscale[t] : pr[g][t]);
        for (int j = 0; j < NV; ++j) acc[g][j] = _mm512_fmadd_ps(pv, vv[j], acc[g][j]);
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    const __m512 inv = _mm512_set1_ps(1.0f / std::max(l[g], 1e-30f));
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(out + g * D + 16 * j, _mm512_mul_ps(acc[g][j], inv));
  }
}

#endif

template <typename T>
void attend_one(const float* q, const T* k_base, const T* v_base, const float* ks,
                const float* vs, const int32_t* table, int64_t bs, int64_t lo, int64_t n,
                int64_t G, int64_t D, float soft_cap, float* out) {
#if defined(__AVX512F__)
  if (G <= 8) {
    switch (D) {
      case 16: return attend_vec<1>(q, k_base, v_base, ks, vs, table, bs, lo, n, G, soft_cap, out);
      case 32: return attend_vec<2>(q, k_base, v_base, ks, vs, table, bs, lo, n, G, soft_cap, out);
      case 64: return attend_vec<4>(q, k_base, v_base, ks, vs, table, bs, lo, n, G, soft_cap, out);
      case 96: return attend_vec<6>(q, k_base, v_base, ks, vs, table, bs, lo, n, G, soft_cap, out);
      case 128: return attend_vec<8>(q, k_base, v_base, ks, vs, table, bs, lo, n, G, soft_cap, out);
    }
  }
#endif
  std::vector<float> m(G, -1e30f), l(G, 0.0f), acc(G * D, 0.0f), kf(kAttnChunk * D),
      vf(kAttnChunk * D), sc(G * kAttnChunk);
  for (int64_t c0 = lo; c0 < n; c0 += kAttnChunk) {
    const int64_t C = std::min<int64_t>(kAttnChunk, n - c0);
    for (int64_t t = 0; t < C; ++t) {
      const int64_t pos = c0 + t;
      const int64_t slot = int64_t(table[pos / bs]) * bs + pos % bs;
      const float sk = kScaled<T> ? ks[slot] : 1.0f, sv = kScaled<T> ? vs[slot] : 1.0f;
      for (int64_t d = 0; d < D; ++d) {
        kf[t * D + d] = load_kv(k_base + slot * D + d) * sk;
        vf[t * D + d] = load_kv(v_base + slot * D + d) * sv;
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      float cmax = -1e30f;
      for (int64_t t = 0; t < C; ++t) {
        float dot = 0.0f;
        for (int64_t d = 0; d < D; ++d) dot += q[g * D + d] * kf[t * D + d];
        if (soft_cap > 0) dot = soft_cap * std::tanh(dot / soft_cap);
        sc[g * kAttnChunk + t] = dot;
        cmax = std::max(cmax, dot);
      }
      const float m_new = std::max(m[g], cmax);
      const float corr = std::exp(m[g] - m_new);
      float* a = acc.data() + g * D;
      for (int64_t d = 0; d < D; ++d) a[d] *= corr;
      float psum = 0.0f;
      for (int64_t t = 0; t < C; ++t) {
        const float p = std::exp(sc[g * kAttnChunk + t] - m_new);
        psum += p;
        for (int64_t d = 0; d < D; ++d) a[d] += p * vf[t * D + d];
      }
      l[g] = l[g] * corr + psum;
      m[g] = m_new;
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = acc[g * D + d] / std::max(l[g], 1e-30f);
}

// What both attention handlers check of their operands: q [., KVH, G, D], the cache
// [L, 2, KVH, slots, D] in f32, bf16 bits, int8 or fp8 (the last two with f32 scales
// [L, 2, KVH, slots]), whole blocks, a block table [S, MB], the layer.
enum class KvKind { kF32, kBf16, kI8, kFp8 };

struct PagedCache {
  int64_t KVH, G, D, NS, S, MB, layer, num_blocks, bs;
  KvKind kind;
  const void* base;
  const float* scales;
  const int32_t* tables;
  // K (0) or V (1) plane of head h of the layer, as T (float, uint16_t, int8_t or Fp8)
  template <typename T>
  const T* plane(int which, int64_t h) const {
    return static_cast<const T*>(base) + ((layer * 2 + which) * KVH + h) * NS * D;
  }
  // its scales, one per slot (quantized caches)
  const float* scale_plane(int which, int64_t h) const {
    return scales + ((layer * 2 + which) * KVH + h) * NS;
  }
  // f(K plane, V plane, K scales, V scales) with the planes typed as the cache is stored
  template <typename F>
  void with_planes(int64_t h, F&& f) const {
    const float* none = nullptr;
    switch (kind) {
      case KvKind::kF32: return f(plane<float>(0, h), plane<float>(1, h), none, none);
      case KvKind::kBf16: return f(plane<uint16_t>(0, h), plane<uint16_t>(1, h), none, none);
      case KvKind::kI8:
        return f(plane<int8_t>(0, h), plane<int8_t>(1, h), scale_plane(0, h), scale_plane(1, h));
      case KvKind::kFp8:
        return f(plane<Fp8>(0, h), plane<Fp8>(1, h), scale_plane(0, h), scale_plane(1, h));
    }
  }
  // every block a context [lo, n) of row s reads is inside the cache
  bool blocks_ok(int64_t s, int64_t lo, int64_t n) const {
    for (int64_t b = lo / bs; b * bs < n; ++b)
      if (tables[s * MB + b] < 0 || tables[s * MB + b] >= num_blocks) return false;
    return true;
  }
};

ffi::Error read_paged(const char* what, const ffi::Buffer<ffi::F32>& q, const ffi::AnyBuffer& cache,
                      const ffi::AnyBuffer& scale, const ffi::Buffer<ffi::S32>& layer,
                      const ffi::Buffer<ffi::S32>& tables, int64_t block_size, PagedCache* pc) {
  auto qd = q.dimensions(), cd = cache.dimensions(), td = tables.dimensions();
  auto bad = [what](const char* why) { return ffi::Error::InvalidArgument(std::string(what) + ": " + why); };
  if (qd.size() != 4 || cd.size() != 5 || td.size() != 2)
    return bad("q [., KVH, G, D], cache [L, 2, KVH, slots, D], tables [S, blocks]");
  pc->KVH = qd[1], pc->G = qd[2], pc->D = qd[3], pc->NS = cd[3], pc->S = td[0], pc->MB = td[1];
  if (cd[1] != 2 || cd[2] != pc->KVH || cd[4] != pc->D) return bad("shapes do not match");
  switch (cache.element_type()) {
    case ffi::DataType::F32: pc->kind = KvKind::kF32; break;
    case ffi::DataType::U16: pc->kind = KvKind::kBf16; break;
    case ffi::DataType::S8: pc->kind = KvKind::kI8; break;
    case ffi::DataType::F8E4M3FN:
    case ffi::DataType::U8: pc->kind = KvKind::kFp8; break;  // fp8, or its bytes (kv.FP8_BITS)
    default: return bad("the cache must be f32, bf16 bits (uint16), int8 or fp8 (or its bytes)");
  }
  pc->scales = nullptr;
  if (pc->kind == KvKind::kI8 || pc->kind == KvKind::kFp8) {
    auto sd = scale.dimensions();
    if (scale.element_type() != ffi::DataType::F32 || sd.size() != 4 || sd[0] != cd[0] ||
        sd[1] != 2 || sd[2] != pc->KVH || sd[3] != pc->NS)
      return bad("a quantized cache needs f32 scales [L, 2, KVH, slots]");
    pc->scales = static_cast<const float*>(scale.untyped_data());
  }
  if (block_size <= 0 || pc->NS % block_size) return bad("slots must be whole blocks");
  pc->bs = block_size;
  pc->num_blocks = pc->NS / block_size;
  Index ix;
  if (auto e = read_index(layer, cd[0], 1, &ix); e.failure()) return e;
  pc->layer = ix.layer;
  pc->base = cache.untyped_data();
  pc->tables = tables.typed_data();
  return ffi::Error::Success();
}

// Prefill tiles (attention.py's prefill pass): the tokens of a sequence with more than one
// token this step, up to 16 at a time, each against its causal context [lo, position]. A
// (tile, KV head) task walks the context in chunks of 16 positions; each chunk's K and V rows
// are widened to f32 once and serve the sub-tile's 16 x G query rows, whose online-softmax
// state (m, l and the D accumulators) stays in a small buffer.
constexpr int kSubTile = 16;

template <int NV, typename T>
void attend_tile_vec(const float* q, int64_t q_stride, const int32_t* pos, int64_t nq, int64_t G,
                     const T* k_base, const T* v_base, const float* ks, const float* vs,
                     const int32_t* table, int64_t bs, int64_t window, float soft_cap, float* out) {
#if defined(__AVX512F__)
  constexpr int64_t D = 16 * NV;
  alignas(64) float kf[kAttnChunk][D], vf[kAttnChunk][D];
  std::vector<float> accbuf(kSubTile * G * D);
  std::vector<float> mbuf(kSubTile * G), lbuf(kSubTile * G);
  for (int64_t i0 = 0; i0 < nq; i0 += kSubTile) {
    const int64_t ni = std::min<int64_t>(kSubTile, nq - i0);
    int64_t lo_min = INT64_MAX, hi = 0;
    for (int64_t i = i0; i < i0 + ni; ++i) {
      lo_min = std::min<int64_t>(lo_min, window > 0 ? std::max<int64_t>(pos[i] - window + 1, 0) : 0);
      hi = std::max<int64_t>(hi, pos[i] + 1);
    }
    std::fill(accbuf.begin(), accbuf.end(), 0.0f);
    std::fill(mbuf.begin(), mbuf.end(), -1e30f);
    std::fill(lbuf.begin(), lbuf.end(), 0.0f);
    for (int64_t c0 = lo_min - lo_min % kAttnChunk; c0 < hi; c0 += kAttnChunk) {
      const int64_t t0 = std::max<int64_t>(lo_min - c0, 0), t1 = std::min<int64_t>(kAttnChunk, hi - c0);
      for (int64_t t = 0; t < kAttnChunk; ++t) {
        if (t < t0 || t >= t1) {  // zeros: finite scores and values for the masked positions
          for (int j = 0; j < NV; ++j) {
            _mm512_store_ps(&kf[t][16 * j], _mm512_setzero_ps());
            _mm512_store_ps(&vf[t][16 * j], _mm512_setzero_ps());
          }
          continue;
        }
        const int64_t p = c0 + t;
        const int64_t slot = int64_t(table[p / bs]) * bs + p % bs;
        if constexpr (kScaled<T>) {
          const __m512 sk = _mm512_set1_ps(ks[slot]), sv = _mm512_set1_ps(vs[slot]);
          for (int j = 0; j < NV; ++j) {
            _mm512_store_ps(&kf[t][16 * j], _mm512_mul_ps(load16(k_base + slot * D + 16 * j), sk));
            _mm512_store_ps(&vf[t][16 * j], _mm512_mul_ps(load16(v_base + slot * D + 16 * j), sv));
          }
        } else {
          for (int j = 0; j < NV; ++j) {
            _mm512_store_ps(&kf[t][16 * j], load16(k_base + slot * D + 16 * j));
            _mm512_store_ps(&vf[t][16 * j], load16(v_base + slot * D + 16 * j));
          }
        }
      }
      for (int64_t i = 0; i < ni; ++i) {
        const int64_t p_i = pos[i0 + i];
        const int64_t lo_i = window > 0 ? std::max<int64_t>(p_i - window + 1, 0) : 0;
        const int64_t a = std::max<int64_t>(lo_i - c0, t0), b = std::min<int64_t>(p_i + 1 - c0, t1);
        if (a >= b) continue;  // none of this chunk is in the token's context
        const __mmask16 live = __mmask16(((1u << b) - 1) & ~((1u << a) - 1));
        for (int64_t g = 0; g < G; ++g) {
          const float* qr = q + (i0 + i) * q_stride + g * D;
          __m512 qv[NV];
          for (int j = 0; j < NV; ++j) qv[j] = _mm512_loadu_ps(qr + 16 * j);
          __m512 d[kAttnChunk];
          for (int t = 0; t < kAttnChunk; ++t) {
            __m512 x = _mm512_mul_ps(qv[0], _mm512_load_ps(&kf[t][0]));
            for (int j = 1; j < NV; ++j) x = _mm512_fmadd_ps(qv[j], _mm512_load_ps(&kf[t][16 * j]), x);
            d[t] = x;
          }
          const __m512 sc = chunk_scores(d, soft_cap, live);
          const int64_t r = i * G + g;
          const float m_new = std::max(mbuf[r], _mm512_reduce_max_ps(sc));
          const float corr = std::exp(mbuf[r] - m_new);
          mbuf[r] = m_new;
          const __m512 pv = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(sc, _mm512_set1_ps(m_new))));
          lbuf[r] = lbuf[r] * corr + _mm512_reduce_add_ps(pv);
          alignas(64) float pr[kAttnChunk];
          _mm512_store_ps(pr, pv);
          float* acc_p = accbuf.data() + r * D;
          __m512 acc[NV];
          const __m512 cv = _mm512_set1_ps(corr);
          for (int j = 0; j < NV; ++j) acc[j] = _mm512_mul_ps(_mm512_loadu_ps(acc_p + 16 * j), cv);
          for (int64_t t = a; t < b; ++t) {
            const __m512 w = _mm512_set1_ps(pr[t]);
            for (int j = 0; j < NV; ++j) acc[j] = _mm512_fmadd_ps(w, _mm512_load_ps(&vf[t][16 * j]), acc[j]);
          }
          for (int j = 0; j < NV; ++j) _mm512_storeu_ps(acc_p + 16 * j, acc[j]);
        }
      }
    }
    for (int64_t i = 0; i < ni; ++i)
      for (int64_t g = 0; g < G; ++g) {
        const int64_t r = i * G + g;
        const __m512 inv = _mm512_set1_ps(1.0f / std::max(lbuf[r], 1e-30f));
        float* o = out + (i0 + i) * q_stride + g * D;
        for (int j = 0; j < NV; ++j) _mm512_storeu_ps(o + 16 * j, _mm512_mul_ps(_mm512_loadu_ps(accbuf.data() + r * D + 16 * j), inv));
      }
  }
#endif
}

// any D and G: each token as its own decode query over [lo, position]
template <typename T>
void attend_tile(const float* q, int64_t q_stride, const int32_t* pos, int64_t nq, int64_t G,
                 int64_t D, const T* k_base, const T* v_base, const float* ks, const float* vs,
                 const int32_t* table, int64_t bs, int64_t window, float soft_cap, float* out) {
#if defined(__AVX512F__)
  switch (D) {
    case 16: return attend_tile_vec<1>(q, q_stride, pos, nq, G, k_base, v_base, ks, vs, table, bs, window, soft_cap, out);
    case 32: return attend_tile_vec<2>(q, q_stride, pos, nq, G, k_base, v_base, ks, vs, table, bs, window, soft_cap, out);
    case 64: return attend_tile_vec<4>(q, q_stride, pos, nq, G, k_base, v_base, ks, vs, table, bs, window, soft_cap, out);
    case 96: return attend_tile_vec<6>(q, q_stride, pos, nq, G, k_base, v_base, ks, vs, table, bs, window, soft_cap, out);
    case 128: return attend_tile_vec<8>(q, q_stride, pos, nq, G, k_base, v_base, ks, vs, table, bs, window, soft_cap, out);
  }
#endif
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t lo = window > 0 ? std::max<int64_t>(pos[i] - window + 1, 0) : 0;
    attend_one(q + i * q_stride, k_base, v_base, ks, vs, table, bs, lo, int64_t(pos[i]) + 1, G,
               D, soft_cap, out + i * q_stride);
  }
}

ffi::Error PrefillAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer cache,
                            ffi::AnyBuffer scale, ffi::Buffer<ffi::S32> layer,
                            ffi::Buffer<ffi::S32> tables,
                            ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::S32> qsl,
                            ffi::Buffer<ffi::S32> tile_seq, ffi::Buffer<ffi::S32> tile_start,
                            ffi::Buffer<ffi::S32> num_tiles, int64_t block_size, int64_t q_tile,
                            int64_t window, float soft_cap, ffi::ResultBuffer<ffi::F32> out) {
  PagedCache pc;
  if (auto e = read_paged("prefill attention", q, cache, scale, layer, tables, block_size, &pc);
      e.failure())
    return e;
  const int64_t T = q.dimensions()[0], S = pc.S, KVH = pc.KVH, G = pc.G, D = pc.D, MB = pc.MB;
  const int64_t W = tile_seq.element_count();
  if (positions.element_count() != T || qsl.element_count() != S + 1 ||
      tile_start.element_count() != W || q_tile <= 0)
    return ffi::Error::InvalidArgument("prefill attention: shapes do not match");
  const int64_t nt = std::min<int64_t>(*num_tiles.typed_data(), W);
  const int32_t *tp = pc.tables, *pp = positions.typed_data(), *qs = qsl.typed_data(),
                *ts = tile_seq.typed_data(), *st = tile_start.typed_data();
  float* op = out->typed_data();
  std::memset(op, 0, sizeof(float) * T * KVH * G * D);
  // every tile's tokens and blocks are checked before any is read
  for (int64_t w = 0; w < nt; ++w) {
    const int64_t s = ts[w];
    if (s < 0 || s >= S) return ffi::Error::InvalidArgument("prefill attention: a tile's sequence is out of range");
    const int64_t a = st[w], b = std::min<int64_t>(a + q_tile, qs[s + 1]);
    if (a < 0 || a < qs[s] || b > T) return ffi::Error::InvalidArgument("prefill attention: a tile is outside its sequence");
    for (int64_t i = a; i < b; ++i) {
      if (pp[i] < 0 || pp[i] >= MB * block_size)
        return ffi::Error::InvalidArgument("prefill attention: a position is past its block table");
      if (i > a && pp[i] != pp[i - 1] + 1)
        return ffi::Error::InvalidArgument("prefill attention: a tile's positions are not consecutive");
    }
    if (b > a && !pc.blocks_ok(s, 0, pp[b - 1] + 1))
      return ffi::Error::InvalidArgument("prefill attention: a block id is outside the cache");
  }
  const float* qp = q.typed_data();
  parallel_rows(pool, nt * KVH, 1, [=](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t w = i / KVH, h = i % KVH, s = ts[w];
      const int64_t a = st[w], b = std::min<int64_t>(a + q_tile, qs[s + 1]);
      if (b <= a) continue;
      const int64_t stride = KVH * G * D;
      const float* qa = qp + a * stride + h * G * D;
      float* oa = op + a * stride + h * G * D;
      pc.with_planes(h, [&](auto k, auto v, const float* ks, const float* vs) {
        attend_tile(qa, stride, pp + a, b - a, G, D, k, v, ks, vs, tp + s * MB, block_size, window,
                    soft_cap, oa);
      });
    }
  });
  return ffi::Error::Success();
}

ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer cache,
                           ffi::AnyBuffer scale, ffi::Buffer<ffi::S32> layer,
                           ffi::Buffer<ffi::S32> tables,
                           ffi::Buffer<ffi::S32> lens, ffi::Buffer<ffi::S32> lows,
                           int64_t block_size, float soft_cap, ffi::ResultBuffer<ffi::F32> out) {
  PagedCache pc;
  if (auto e = read_paged("decode attention", q, cache, scale, layer, tables, block_size, &pc);
      e.failure())
    return e;
  const int64_t S = pc.S, KVH = pc.KVH, G = pc.G, D = pc.D, MB = pc.MB;
  if (q.dimensions()[0] != S || lens.element_count() != S || lows.element_count() != S)
    return ffi::Error::InvalidArgument("decode attention: shapes do not match");
  const float* qp = q.typed_data();
  const int32_t *tp = pc.tables, *np_ = lens.typed_data(), *lp = lows.typed_data();
  float* op = out->typed_data();
  for (int64_t s = 0; s < S; ++s) {  // reads stay inside the cache, whatever the tables hold
    if (np_[s] > MB * block_size || lp[s] < 0)
      return ffi::Error::InvalidArgument("decode attention: a context is longer than its block table");
    if (!pc.blocks_ok(s, lp[s], np_[s]))
      return ffi::Error::InvalidArgument("decode attention: a block id is outside the cache");
  }
  parallel_rows(pool, S * KVH, 1, [=](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t s = i / KVH, h = i % KVH, n = np_[s], lo = lp[s];
      const float* qs = qp + i * G * D;
      float* os = op + i * G * D;
      pc.with_planes(h, [&](auto k, auto v, const float* ks, const float* vs) {
        attend_one(qs, k, v, ks, vs, tp + s * MB, block_size, lo, n, G, D, soft_cap, os);
      });
    }
  });
  return ffi::Error::Success();
}

}  // namespace

// q, the cache, its scales (read for int8 / fp8 caches only), the layer index, the block
// tables: both attention handlers start so
namespace {
auto BindAttention() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Arg<ffi::Buffer<ffi::S32>>();
}
}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmPrefillAttention, PrefillAttention,
                              BindAttention()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("block_size")
                                  .Attr<int64_t>("q_tile")
                                  .Attr<int64_t>("window")
                                  .Attr<float>("soft_cap")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmDecodeAttention, DecodeAttention,
                              BindAttention()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("block_size")
                                  .Attr<float>("soft_cap")
                                  .Ret<ffi::Buffer<ffi::F32>>());

// The argument lists several handlers share: x, the weight's parts, the layer index; y.
namespace {
auto BindQmm() {  // codes, scale, offset
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Ret<ffi::Buffer<ffi::F32>>();
}

auto BindQmmSym() {  // codes, scale
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Ret<ffi::Buffer<ffi::F32>>();
}

auto BindBf16() {  // the bf16 matrix
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::BF16>>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Ret<ffi::Buffer<ffi::F32>>();
}
}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmQmm, QmmOffset, BindQmm());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmQmmSym, QmmSym, BindQmmSym());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmQmmQ8, QmmQ8, BindQmm());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmQmmQ8Sym, QmmQ8Sym, BindQmmSym());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmQmmSymBf16, QmmSymBf16, BindQmmSym());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmFp8, Fp8Matmul, BindQmmSym());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmW8A8, W8A8Plain,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmW8A8Smooth, W8A8Smooth,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmW8A8Panels, W8A8Panels,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmW8A8PanelsSmooth, W8A8PanelsSmooth,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmBf16InOut, Bf16InOut, BindBf16());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmBf16OutIn, Bf16OutIn, BindBf16());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmBf16Panels, Bf16Panels,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// whether Bf16Panels runs here (AVX512-BF16): the loader packs bf16 matrices only then
extern "C" int JaxllmBf16PanelsBuilt() { return kBf16Packed ? 1 : 0; }

// whether W8A8Panels runs here (AVX512-VNNI): the loader packs w8a8 matrices only then
extern "C" int JaxllmI8PanelsBuilt() { return kPackedKernel ? 1 : 0; }

// whether the packed kernels run on AMX's tiles here and now (the CPU has them, Linux grants
// them, cpu_amx is on): for the benchmarks' machine line and the tests
extern "C" int JaxllmAmx() { return amx_on() ? 1 : 0; }

// EngineConfig.cpu_amx (jaxllm.kernels.cpu.build.set_amx)
extern "C" void JaxllmSetAmx(int on) { g_amx_allowed.store(on != 0, std::memory_order_relaxed); }
