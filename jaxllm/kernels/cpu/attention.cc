// Paged attention for XLA:CPU, called through XLA's FFI (build.py builds and registers this
// file with the others):
//
//   jaxllm_decode_attention   the last token of each sequence against its cached context
//   jaxllm_prefill_attention  the tokens of the step's prefill tiles, each against its causal
//                             context
//
// Both read the paged cache [L, 2, KVH, slots, D] in place (f32, bf16 kept as uint16 bits, or
// int8 / fp8 with f32 scales [L, 2, KVH, slots], one per token and head, as kv.py writes them):
// XLA's form gathers (and dequantizes) every context row into a new array first, which at many
// sequences costs more than the arithmetic. The layer is the index operand's (common.h).
//
// Decode: one task per (sequence, KV head) runs its G query heads' online softmax over chunks
// of 16 positions. With AVX-512 a chunk's 16 scores are one vector: each position's D products
// are summed by a 16 x 16 transposing reduction (not one horizontal sum per score), and exp runs
// on the vector. Matches the XLA decode pass (attention.py) to float rounding.
#include "common.h"

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
    // prefetcher would fetch it before the loads below miss
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

