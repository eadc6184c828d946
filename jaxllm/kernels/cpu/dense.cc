// bf16 float matmuls for XLA:CPU, called through XLA's FFI (build.py builds and registers this
// file with the others): bf16 weights, f32 activations and accumulation. XLA:CPU converts a
// bf16 operand to f32 in memory before its dot, so bf16 storage only pays through a kernel
// that widens in registers.
//
//   jaxllm_bf16_in_out  w [L, K, N] bf16 (the layers' stacks)
//   jaxllm_bf16_out_in  w [L, N, K] bf16 (a tied embedding table as the head)
//   jaxllm_bf16_panels  w [L, N/48, K/2, 48] uint32: a [L, K, N] stack packed at load
//   jaxllm_grouped_bf16 / _f32  w [L, X, K, N]: a mixture of experts' stack, rows in groups
//
// The index operand (common.h) picks the layer in place and says how many rows of x are real.
// From 16 activation rows (4 on AMX) the activations are rounded to bf16 and multiply packed
// panels (bf16_panels.h); below that the float kernels here widen the weights in registers.
// Also here: the AMX switch every kernel file reads, and the library's probes.
#include "bf16_panels.h"
#include "common.h"

// common.h's AMX switch, one for the library: on until JaxllmSetAmx turns it off
std::atomic<bool> g_amx_allowed{true};

namespace {

#if defined(__AVX512F__)

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

// out_in: rows of W are contiguous in K, dot products reduced at the end (as quantized.cc's tile)
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

// w: [L, P, K / 2, 48] uint32, each 48-column panel of a bf16 [K, N] matrix (N = 48 P) packed
// once at load in the order bf16_packed packs it per call (pack_bf16_io): a panel is
// then K / 2 x 192 contiguous bytes, and a call reads the weights once, in order. Packed once
// because packing per call costs more than the products at every row count.
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

// Grouped matmuls (a mixture of experts' projections): x [M, K] has its rows sorted into
// groups of sizes g [X], and each group multiplies its expert's matrix of w [L, X, K, N] at
// the index operand's layer, in place: a used expert's weights are read once, an unused
// one's not at all. Rows past the groups come back as zeros.
void f32_in_out(const float* w, const float* x, int64_t M, int64_t K, int64_t N, int64_t n0,
                int64_t n1, float* y) {
  for (int64_t m = 0; m < M; ++m) {
    float* yr = y + m * N;
    for (int64_t n = n0; n < n1; ++n) yr[n] = 0;
    for (int64_t k = 0; k < K; ++k) {
      const float xv = x[m * K + k];
      const float* wr = w + k * N;
      for (int64_t n = n0; n < n1; ++n) yr[n] += xv * wr[n];
    }
  }
}

template <typename W>
ffi::Error GroupedImpl(ffi::ThreadPool& pool, const ffi::Buffer<ffi::F32>& x, const W* w,
                       ffi::Span<const int64_t> wd, const ffi::Buffer<ffi::S32>& layer,
                       const ffi::Buffer<ffi::S32>& groups, ffi::ResultBuffer<ffi::F32>& y) {
  auto xd = x.dimensions();
  if (xd.size() != 2 || wd.size() != 4 || wd[2] != xd[1])
    return ffi::Error::InvalidArgument("grouped matmul: x must be [M, K], w [L, X, K, N]");
  const int64_t M = xd[0], L = wd[0], X = wd[1], K = wd[2], N = wd[3];
  if (groups.element_count() != X)
    return ffi::Error::InvalidArgument("grouped matmul: one group size per expert");
  Index ix;
  if (auto e = read_index(layer, L, M, &ix); e.failure()) return e;
  const float* xp = x.typed_data();
  float* yp = y->typed_data();
  const int32_t* g = groups.typed_data();
  // the used groups, then one pool pass over (group, column chunk) items: few rows per group
  // (decode) would otherwise leave a barrier per group and idle threads at each
  struct Group {
    int64_t start, rows;
    const W* w;
    bool packed;
  };
  std::vector<Group> used;
  int64_t start = 0;
  bool amx = false;
  if constexpr (std::is_same_v<W, uint16_t>) amx = kBf16Packed && K % 32 == 0 && N % 16 == 0 && amx_on();
  for (int64_t e = 0; e < X && start < M; ++e) {
    const int64_t c = std::clamp<int64_t>(g[e], 0, M - start);
    if (c == 0) continue;
    bool packed = false;
    if constexpr (std::is_same_v<W, uint16_t>)
      packed = kBf16Packed && c >= (amx ? kBf16AmxMinRows : kBf16PackedMinRows) && K % 2 == 0 && N % 16 == 0;
    used.push_back({start, c, w + (ix.layer * X + e) * K * N, packed});
    start += c;
  }
  zero_rows(yp, start, M, N);
  if (used.empty()) return ffi::Error::Success();
  // the packed path's activations, rounded to bf16 once (AMX reads 16-row tiles: a group's
  // rows are padded to 16 with zeros)
  std::vector<int64_t> xb_at(used.size(), 0);
  int64_t xb_rows = 0;
  for (size_t i = 0; i < used.size(); ++i)
    if (used[i].packed) {
      xb_at[i] = xb_rows;
      xb_rows += amx ? (used[i].rows + 15) / 16 * 16 : used[i].rows;
    }
  std::vector<uint16_t> xb(xb_rows * K);
  for (size_t i = 0; i < used.size(); ++i)
    if (used[i].packed) round_bf16(xp + used[i].start * K, used[i].rows * K, xb.data() + xb_at[i] * K);
  constexpr int64_t kChunk = 2 * kPanel;  // whole panels for the packed path, 96 columns
  const int64_t per_group = (N + kChunk - 1) / kChunk;
  const Group* gp = used.data();
  const int64_t* at = xb_at.data();
  const uint16_t* xbp = xb.data();
  parallel_rows(pool, static_cast<int64_t>(used.size()) * per_group, 1, [=](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const Group& gr = gp[i / per_group];
      const int64_t n0 = i % per_group * kChunk, n1 = std::min(N, n0 + kChunk);
      const float* xe = xp + gr.start * K;
      float* ye = yp + gr.start * N;
      if constexpr (std::is_same_v<W, uint16_t>) {
        if (gr.packed) bf16_packed(gr.w, xbp + at[i / per_group] * K, gr.rows, K, N, n0, n1, ye, true, amx);
        else bf16_in_out(gr.w, xe, gr.rows, K, N, n0, n1, ye);
      } else {
        f32_in_out(gr.w, xe, gr.rows, K, N, n0, n1, ye);
      }
    }
  });
  return ffi::Error::Success();
}

ffi::Error GroupedBf16(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::BF16> w,
                       ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> groups,
                       ffi::ResultBuffer<ffi::F32> y) {
  return GroupedImpl(pool, x, reinterpret_cast<const uint16_t*>(w.typed_data()), w.dimensions(),
                     layer, groups, y);
}

ffi::Error GroupedF32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                      ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> groups,
                      ffi::ResultBuffer<ffi::F32> y) {
  return GroupedImpl(pool, x, w.typed_data(), w.dimensions(), layer, groups, y);
}

#define JAXLLM_BIND_GROUPED(T)                \
  ffi::Ffi::Bind()                            \
      .Ctx<ffi::ThreadPool>()                 \
      .Arg<ffi::Buffer<ffi::F32>>()           \
      .Arg<ffi::Buffer<T>>()                  \
      .Arg<ffi::Buffer<ffi::S32>>()           \
      .Arg<ffi::Buffer<ffi::S32>>()           \
      .Ret<ffi::Buffer<ffi::F32>>()

auto BindBf16() {  // the bf16 matrix
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::BF16>>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Ret<ffi::Buffer<ffi::F32>>();
}
}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmBf16InOut, Bf16InOut, BindBf16());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmBf16OutIn, Bf16OutIn, BindBf16());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmGroupedBf16, GroupedBf16, JAXLLM_BIND_GROUPED(ffi::BF16));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmGroupedF32, GroupedF32, JAXLLM_BIND_GROUPED(ffi::F32));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmBf16Panels, Bf16Panels,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// whether Bf16Panels runs here (AVX512-BF16): the loader packs bf16 matrices only then
extern "C" int JaxllmBf16PanelsBuilt() { return kBf16Packed ? 1 : 0; }

// whether the packed kernels run on AMX's tiles here and now (the CPU has them, Linux grants
// them, cpu_amx is on): for the benchmarks' machine line and the tests
extern "C" int JaxllmAmx() { return amx_on() ? 1 : 0; }

// EngineConfig.cpu_amx (jaxllm.kernels.cpu.build.set_amx)
extern "C" void JaxllmSetAmx(int on) { g_amx_allowed.store(on != 0, std::memory_order_relaxed); }
