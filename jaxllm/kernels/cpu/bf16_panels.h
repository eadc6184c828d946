// The bf16 packed panels, shared by the bf16 float matmuls (dense.cc) and the matmuls of
// one-byte codes that multiply as bf16 (quantized.cc: int8 per channel with bf16 activations,
// fp8). With many activation rows and AVX512-BF16 the activations are rounded to bf16 and
// multiplied by pairs of k with vdpbf16ps (twice the products of an f32 FMA per instruction),
// or on AMX's tiles. As for w8a8, each 48-column panel of weights is first packed in the
// instruction's order, a pair of k of 16 columns per vector (buf[kp][16 r + j]: column
// n + 16 r + j at k = 2 kp low, 2 kp + 1 high), and serves every row from the cache. Packed
// here per call from a bf16 [K, N] or [N, K] matrix or from one-byte codes [N, K]; dense.cc's
// Bf16Panels reads panels packed once at load in the same order.
#ifndef JAXLLM_KERNELS_CPU_BF16_PANELS_H_
#define JAXLLM_KERNELS_CPU_BF16_PANELS_H_

#include "common.h"

namespace {

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
// on AMX's tiles packing the weights bounds the packed path, not the products, so its cost
// barely grows with the rows while the float kernel's grows with each row: from this many
// rows the packed path wins
constexpr int64_t kBf16AmxMinRows = 4;

}  // namespace

#endif  // JAXLLM_KERNELS_CPU_BF16_PANELS_H_
