// The AMX-BF16 GEMM kernel: x in bf16 (p.xb, rows padded to 16), weights as bf16 pair panels
// (gemm_avx512.h), which are exactly AMX's B-tile layout: 16 pair rows of one panel (32 k x 16
// columns) are one 1 KiB tile, contiguous. One TDPBF16PS multiplies 16 rows by 32 k by 16 columns,
// 16x the work of a vdpbf16ps.
//
// Per thread, panels two at a time (decoded once when not bf16; gemm_swiglu: a gate panel and its up
// panel, whose C tiles the epilogue combines) and rows 32 at a time: 4 C tiles
// (2 row blocks x 2 panels) accumulate over K from 2 A tiles and 2 B tiles per 32 k, so each tile
// loaded feeds two multiplies. A is loaded with the streaming hint (TILELOADDT1): each A block is
// used once per panel pair, and a plain load would evict from L1 the B pair that the next row block
// reuses (at K = 576 they are 36 KiB each). The C tiles then go through a float buffer to the
// epilogue (scale, bias, output dtype). Called only where cpu_features() reports AMX, whose tile state Linux lends
// on request (cpu_features.cpp); the tiles are configured per call, since another library (oneDNN)
// may have configured them differently on this thread, and released at the end.

#include "gemm.h"
#include "paged_attention_x86.h"

#if KILN_X86_KERNELS
// Standard and intrinsic headers before the target options: their inline code stays generic.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c"))), \
                             apply_to = function)
#else
#pragma GCC push_options
// GCC 12 flags its own _mm512_undefined_* (a self-initialized variable) in many AVX-512 intrinsics.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")
#endif

#include "amx_tiles.h"
#include "gemm_avx512.h"

namespace kiln {
namespace amx {
namespace {

// tmm0-3: C (16 x 16 float), tmm4-5: A (16 rows x 32 bf16), tmm6-7: B (16 pair rows x 16 columns).

constexpr int64_t kTileK = 32, kTileBytes = 1024;

// C tiles for row blocks [m0, m0 + 16 * RB) and panels w[0 .. NP) over all of K, stored into
// c [32][32] floats (row stride 128 bytes).
template <int RB, int NP>
void tiles(const GemmParams& p, const uint16_t* w0, const uint16_t* w1, int64_t m0, int64_t kb_count, bool stream,
           float* c) {
  _tile_zero(0);
  if constexpr (NP == 2) _tile_zero(1);
  if constexpr (RB == 2) _tile_zero(2);
  if constexpr (RB == 2 && NP == 2) _tile_zero(3);
  const uint16_t* a = p.xb + m0 * p.ldxb;
  const int64_t lda = p.ldxb * 2;
  for (int64_t kb = 0; kb < kb_count; ++kb) {
    if (stream) {  // the next B tiles' lines, 2 KiB ahead: a small batch streams the weights once
      const char* next0 = reinterpret_cast<const char*>(w0 + kb * kTileK * kPanel) + 2 * kTileBytes;
      for (int l = 0; l < 16; ++l) _mm_prefetch(next0 + 64 * l, _MM_HINT_T0);
      if constexpr (NP == 2) {
        const char* next1 = reinterpret_cast<const char*>(w1 + kb * kTileK * kPanel) + 2 * kTileBytes;
        for (int l = 0; l < 16; ++l) _mm_prefetch(next1 + 64 * l, _MM_HINT_T0);
      }
    }
    _tile_stream_loadd(4, a + kb * kTileK, lda);
    _tile_loadd(6, w0 + kb * kTileK * kPanel, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NP == 2) {
      _tile_loadd(7, w1 + kb * kTileK * kPanel, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (RB == 2) {
      _tile_stream_loadd(5, a + 16 * p.ldxb + kb * kTileK, lda);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (NP == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, 128);
  if constexpr (NP == 2) _tile_stored(1, c + 16, 128);
  if constexpr (RB == 2) _tile_stored(2, c + 16 * 32, 128);
  if constexpr (RB == 2 && NP == 2) _tile_stored(3, c + 16 * 32 + 16, 128);
}

// Panels `panel` and `second` (np of them) into out; with swiglu_panels, gate panel `panel` and its up
// panel `second` into one block of silu(gate) * up.
void panels(const GemmParams& p, int64_t panel, int64_t second, int np, const uint16_t* w0, const uint16_t* w1,
            float* c) {
  const int64_t kb_count = round_up(p.K, kBf16PadK) / kTileK;
  const bool stream = p.M <= 32;
  const Epilogue e0 = epilogue(p, panel), e1 = np == 2 ? epilogue(p, second) : e0;
  for (int64_t m0 = 0; m0 < p.M; m0 += 32) {
    const int64_t rows = std::min<int64_t>(32, p.M - m0);
    if (rows > 16) {
      if (np == 2) tiles<2, 2>(p, w0, w1, m0, kb_count, stream, c);
      else tiles<2, 1>(p, w0, w1, m0, kb_count, stream, c);
    } else {
      if (np == 2) tiles<1, 2>(p, w0, w1, m0, kb_count, stream, c);
      else tiles<1, 1>(p, w0, w1, m0, kb_count, stream, c);
    }
    if (p.swiglu_panels > 0) {
      for (int64_t m = 0; m < rows; ++m)
        store_swiglu_row(p, e0, e1, m0 + m, _mm512_loadu_ps(c + m * 32), _mm512_loadu_ps(c + m * 32 + 16));
      continue;
    }
    for (int64_t m = 0; m < rows; ++m) {
      store_row(p, e0, m0 + m, _mm512_loadu_ps(c + m * 32));
      if (np == 2) store_row(p, e1, m0 + m, _mm512_loadu_ps(c + m * 32 + 16));
    }
  }
}

}  // namespace

void gemm_bf16_panels(const GemmParams& p, int64_t begin, int64_t end, void* scratch) {
  const int64_t Kb = round_up(p.K, kBf16PadK);
  auto* decoded = static_cast<uint16_t*>(scratch);
  float* c = reinterpret_cast<float*>(decoded + 2 * Kb * kPanel);
  amx_tiles::configure();
  // A gate panel pairs with its up panel, else each panel with the next.
  const int64_t step = p.swiglu_panels > 0 ? 1 : 2;
  for (int64_t panel = begin; panel < end; panel += step) {
    const int64_t second = p.swiglu_panels > 0 ? panel + p.swiglu_panels : panel + 1;
    const int np = p.swiglu_panels > 0 || panel + 1 < end ? 2 : 1;
    const uint16_t* w0 = bf16_panel(p, panel, decoded);
    const uint16_t* w1 = np == 2 ? bf16_panel(p, second, decoded + Kb * kPanel) : w0;
    panels(p, panel, second, np, w0, w1, c);
  }
  _tile_release();
}

}  // namespace amx
}  // namespace kiln

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#else
namespace kiln {
namespace amx {  // never called: cpu_features() reports no AMX here
void gemm_bf16_panels(const GemmParams&, int64_t, int64_t, void*) {}
}  // namespace amx
}  // namespace kiln
#endif
