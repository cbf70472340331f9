// AMX tile configuration shared by the AMX kernels (gemm_amx.cpp, attention_bf16.cpp): every tile
// 16 rows x 64 bytes (16 x 16 floats, 16 x 32 bf16, 16 pair rows x 16 columns). Included after a
// translation unit's AMX target options.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace kiln {
namespace amx_tiles {

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Per call: another library (oneDNN) may have configured this thread's tiles otherwise.
inline void configure() {
  TileConfig c{};
  c.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = 16;
    c.colsb[t] = 64;
  }
  _tile_loadconfig(&c);
}

}  // namespace amx_tiles
}  // namespace kiln
