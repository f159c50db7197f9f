// The tile matrix unit (AMX): permission and per-thread tile configuration, shared by the
// kernels that use it. Every tile is configured as 16 rows x 64 bytes (16 x 32 bf16 for A
// and VNNI-paired B, 16 x 16 fp32 for C).
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace pagedllm_amx {

struct TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Linux hands out the tile state only on request, once per process.
inline bool permitted() {
  static const bool ok = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023;
    constexpr long XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}

// Tiles are per-thread state shared with oneDNN/ATen kernels, which may cache the
// configuration they last set: save it before ours and put it back after.
class TileScope {
 public:
  TileScope() {
    _tile_storeconfig(&saved_);
    TileConfig cfg{};
    cfg.palette_id = 1;
    for (int t = 0; t < 8; ++t) {
      cfg.rows[t] = 16;
      cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
  }
  ~TileScope() {
    if (saved_.palette_id != 0) {
      _tile_loadconfig(&saved_);
    } else {
      _tile_release();
    }
  }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;

 private:
  TileConfig saved_{};
};

}  // namespace pagedllm_amx
#endif
