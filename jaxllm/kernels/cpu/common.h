// What the CPU kernels (quantized.cc, dense.cc, attention.cc) share: the split of rows over
// XLA's intra-op thread pool, half / bf16 / fp8 widening, scale operands (float16 or float32),
// the index operand every matmul takes, and AMX's tile setup with the 48-column panels it
// multiplies. build.py compiles the kernels into one library and registers their handlers.
//
// The index operand: int32 [layer] or [layer, rows]. Weights are layer stacks [L, ...] and the
// layer picks one in place, so no slice of a stack is ever copied; `rows` is how many leading
// rows of x are real (a step padded to its bucket: the rest come back as zeros).
//
// All but the AMX switch is in an anonymous namespace, as each kernel file's own code is: each
// file gets a private copy that the compiler inlines as it would within one file.
#ifndef JAXLLM_KERNELS_CPU_COMMON_H_
#define JAXLLM_KERNELS_CPU_COMMON_H_

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

// EngineConfig.cpu_amx, set through JaxllmSetAmx: whether the packed kernels may use AMX. One
// object for every kernel file (defined in dense.cc), not exported from the library
extern __attribute__((visibility("hidden"))) std::atomic<bool> g_amx_allowed;

namespace {

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

// bf16 bits -> f32 (exact)
inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
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

#if defined(__AVX512F__)
inline __m512 bf16x16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
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

constexpr int kPanel = 48;  // columns per packed panel: 3 vectors

#if defined(JAXLLM_AMX)
// AMX, the tile matrix unit of recent Xeons: one TDPBUSD (TDPBF16PS) multiplies a tile of 16
// activation rows x 64 bytes of k by a tile of 16 columns and adds into 16 x 16 int32 (f32)
// sums: 16 times the products of an AVX-512 VNNI instruction. The packed panels (w8a8's in
// quantized.cc, bf16_panels.h's) are already in the tiles' order (a column's 4 k of int8, or
// 2 k of bf16, per 4 bytes), so a panel of 48 columns is three B tiles. Linux hands a process
// the tile state only when asked; where it refuses (a kernel before 5.16), or with cpu_amx off,
// the AVX-512 loops run.
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

#else

bool amx_on() { return false; }

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

#if defined(__AVX512F__)

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

#endif

}  // namespace

#endif  // JAXLLM_KERNELS_CPU_COMMON_H_
