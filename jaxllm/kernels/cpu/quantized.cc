// Quantized matmuls for XLA:CPU, called through XLA's FFI (build.py builds and registers this
// file with the others). XLA:CPU has no dot that dequantizes its operand on the fly, so these
// read the packed codes themselves:
//
//   jaxllm_qmm      y[M,N] = x[M,K] . (code * scale + offset)^T   int4 or int8 codes
//   jaxllm_qmm_sym  the same without an offset
//   jaxllm_qmm_q8 / jaxllm_qmm_q8_sym
//                   int4 codes, x quantized to int8 per block of 32 inside (VNNI products)
//   jaxllm_qmm_sym_bf16  int8 per-channel codes, activations rounded to bf16 (the bf16 policy)
//   jaxllm_fp8      e4m3 codes with per-channel scales; x quantized per row to e4m3 inside,
//                   both multiplied as bf16 (exact) with f32 sums
//   jaxllm_w8a8     int8 codes with per-channel scales; x quantized per row to int8 inside
//                   (jaxllm_w8a8_smooth: divided by a SmoothQuant vector first), int32
//                   accumulation
//   jaxllm_w8a8_panels / jaxllm_w8a8_panels_smooth
//                   the same from codes packed at load as VNNI / AMX panels
//
// Weights are stacks [L, N, K'] (out-major, formats.py) read in place at the index operand's
// layer (common.h). int4: uint8 [L, N, K/2], two codes per byte in blocks of 32 (byte j: code j
// low, code j + 16 high); int8: int8 [L, N, K]; fp8: e4m3fn or its bytes [L, N, K]; scale and
// offset float16 or float32 [L, N, K/G]; w8a8 panels: int32 [L, N/48, K/4 + 1, 48]. Rows of N
// are split over XLA's intra-op thread pool.
#include "bf16_panels.h"
#include "common.h"

namespace {

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
// fit in a core's L1 (a pass whose rows spill from L1 is slower than two passes of 4)
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
// rest (two divisions per pair, which the common group sizes avoid through G32 and G64)
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
// weights, which fewer rows do not repay)
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
// count: on AMX's tiles from kI8AmxMinRows rows, with VNNI below that (a tile multiplies 16
// rows whatever the count, so with fewer rows VNNI's vectors are faster).
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
// token to e4m3 at run time (scale max|x| / 448). XLA:CPU only emulates an fp8 dot, far
// slower than an int8 one; both e4m3 operands are exact in bf16, so vdpbf16ps and AMX's
// tiles multiply them as fp8 would, with f32 sums, and the row and column scales apply to
// each finished panel.
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

// The argument lists several handlers share: x, the weight's parts, the layer index; y.
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

// whether W8A8Panels runs here (AVX512-VNNI): the loader packs w8a8 matrices only then
extern "C" int JaxllmI8PanelsBuilt() { return kPackedKernel ? 1 : 0; }
