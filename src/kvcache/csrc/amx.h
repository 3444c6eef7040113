// AMX tiles, shared by the libraries that multiply bfloat16 on them (linear.cpp, bf16_attention.cpp):
// the tile configuration and whether this process may use the tiles at all.
//
//   kAmx        whether this build has AMX (bfloat16 tiles; -march as KVCACHE_ISA says)
//   TileConfig  the 64-byte palette-1 configuration _tile_loadconfig takes
//   amx_usable  the CPU has the tiles, the OS saves and grants them, and oneDNN is not capped below them
#pragma once

#include <cstdint>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <cpuid.h>
#include <cstdlib>
#include <cstring>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace kv {

constexpr bool kAmx = true;

struct TileConfig {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

// Whether this process may use AMX tiles: the CPU has them, the OS saves their state (XCR0 bits 17
// and 18) and grants this process the permission to use them (asked once), and oneDNN is not
// capped below AMX (ONEDNN_MAX_CPU_ISA naming no AMX: set where AMX kernels crash this CPU,
// kvcache.attention.half_precision), which the libraries honour as well.
inline bool amx_usable() {
    static const bool usable = [] {
        const char* cap = std::getenv("ONEDNN_MAX_CPU_ISA");
        if (cap != nullptr && *cap != 0 && std::strstr(cap, "AMX") == nullptr) return false;
        unsigned a, b, c, d;
        if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 22))) return false;
        if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return false;  // OSXSAVE
        unsigned lo, hi;
        __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
        if ((lo & (3u << 17)) != (3u << 17)) return false;
        constexpr long kReqPerm = 0x1023, kXtileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
        return syscall(SYS_arch_prctl, kReqPerm, kXtileData) == 0;
    }();
    return usable;
}

}  // namespace kv
#else
namespace kv {
constexpr bool kAmx = false;
inline bool amx_usable() { return false; }
}  // namespace kv
#endif
