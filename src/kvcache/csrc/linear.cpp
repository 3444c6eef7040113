// float32 linear layers y = x W^T (+ bias) over a weight packed once into column panels
// (kvcache.hf.panels). Built for the few rows of a decode step, where a BLAS call re-blocks the
// weight every time and reads it at a fraction of the memory bandwidth; any row count computes.
//
// One plain C entry point per operation, called through ctypes with raw pointers (no Python or
// torch headers, so it builds in a second or two).
//
//   w       float32 [N, K]              row major (a torch Linear's weight)
//   packed  float32 [ceil(N/16), K, 16] panel p holds columns 16p..16p+15 for every k, zero past N
//   x       float32 [M, K]              row stride ldx, K contiguous
//   bias    float32 [N] or null
//   y       float32 [M, N]              row stride ldy
//
// Each thread takes a contiguous run of panels (the runs differ by at most one panel), so the
// weight is read from memory once per call however many rows there are: in groups of kGroup panels
// (kept in L2), each tile of MR rows times G panels accumulates in registers over k, one weight
// vector loaded per panel and k, one row value broadcast per row and k. MR and G are chosen per
// row count and per register file: a tile holds at most kAcc accumulators of 16 floats.
// Sums run over k in order, so a row's output does not depend on how many rows share the call.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <omp.h>

namespace {

typedef float v16 __attribute__((vector_size(64)));

constexpr int kPanel = 16;  // floats a panel is wide
constexpr int kGroup = 8;   // panels a thread walks every row tile over before the next group
#if defined(__AVX512F__)
constexpr int kAcc = 24;  // of 32 vector registers: accumulators, the rest weights and a broadcast
constexpr int kRows = 12;
#elif defined(__AVX__) || defined(__ARM_NEON)
constexpr int kAcc = 6;  // 16 (AVX) or 32 (NEON, 4 each) registers, a v16 taking 2 or 4 of them
constexpr int kRows = 6;
#else
constexpr int kAcc = 3;
constexpr int kRows = 3;
#endif

inline __attribute__((always_inline)) v16 load16(const float* p) {
    v16 v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}

// Rows [0, MR) of x times panels [0, G) of a group: y's columns col .. col + 16G (cut at n).
template <int MR, int G>
inline void tile(const float* x, int64_t ldx, int64_t k, const float* panels, int64_t panel_stride,
                 const float* bias, float* y, int64_t ldy, int64_t col, int64_t n) {
    v16 acc[MR][G];
    for (int r = 0; r < MR; ++r)
        for (int g = 0; g < G; ++g) acc[r][g] = v16{};
    for (int64_t i = 0; i < k; ++i) {
        v16 w[G];
        for (int g = 0; g < G; ++g) {
            __builtin_prefetch(panels + g * panel_stride + (i + 64) * kPanel);
            w[g] = load16(panels + g * panel_stride + i * kPanel);
        }
        for (int r = 0; r < MR; ++r) {
            const float b = x[r * ldx + i];
            for (int g = 0; g < G; ++g) acc[r][g] += b * w[g];
        }
    }
    for (int g = 0; g < G; ++g) {
        const int64_t c0 = col + g * kPanel;
        const int64_t width = std::min<int64_t>(kPanel, n - c0);
        if (width <= 0) break;
        v16 add = v16{};
        if (bias != nullptr) {
            if (width == kPanel) add = load16(bias + c0);
            else for (int j = 0; j < width; ++j) add[j] = bias[c0 + j];
        }
        for (int r = 0; r < MR; ++r) {
            const v16 out = acc[r][g] + add;
            __builtin_memcpy(y + r * ldy + c0, &out, width * sizeof(float));
        }
    }
}

// Tiles of MR rows over `count` panels starting at `first`, G at a time (fewer at the end).
template <int MR>
void rows_over(const float* x, int64_t ldx, int64_t k, const float* packed, int64_t first, int64_t count,
               const float* bias, float* y, int64_t ldy, int64_t n) {
    constexpr int G = std::max(1, std::min(kGroup, kAcc / MR));
    const int64_t stride = k * kPanel;
    int64_t p = first;
    for (; p + G <= first + count; p += G) tile<MR, G>(x, ldx, k, packed + p * stride, stride, bias, y, ldy, p * kPanel, n);
    for (; p < first + count; ++p) tile<MR, 1>(x, ldx, k, packed + p * stride, stride, bias, y, ldy, p * kPanel, n);
}

template <int MR>
void rows_dispatch(int rows, const float* x, int64_t ldx, int64_t k, const float* packed, int64_t first,
                   int64_t count, const float* bias, float* y, int64_t ldy, int64_t n) {
    if constexpr (MR > 0) {
        if (rows == MR) return rows_over<MR>(x, ldx, k, packed, first, count, bias, y, ldy, n);
        return rows_dispatch<MR - 1>(rows, x, ldx, k, packed, first, count, bias, y, ldy, n);
    }
}

}  // namespace

extern "C" {

// Panel width in floats (the packed layout's last dimension).
int kv_linear_panel() { return kPanel; }

// w [n, k] -> packed [ceil(n/16), k, 16]; columns past n are zeros.
void kv_linear_pack(const float* w, int64_t n, int64_t k, float* packed, int threads) {
    const int64_t panels = (n + kPanel - 1) / kPanel;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t p = 0; p < panels; ++p) {
        float* out = packed + p * k * kPanel;
        for (int64_t i = 0; i < k; ++i)
            for (int j = 0; j < kPanel; ++j) {
                const int64_t c = p * kPanel + j;
                out[i * kPanel + j] = c < n ? w[c * k + i] : 0.0f;
            }
    }
}

// y [m, n] = x [m, k] packed^T (+ bias).
void kv_linear(const float* x, int64_t m, int64_t k, int64_t ldx, const float* packed, int64_t n,
               const float* bias, float* y, int64_t ldy, int threads) {
    const int64_t panels = (n + kPanel - 1) / kPanel;
    const int used = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, panels)));
#pragma omp parallel num_threads(used)
    {
        const int t = omp_get_thread_num(), count = omp_get_num_threads();
        const int64_t lo = panels * t / count, hi = panels * (t + 1) / count;
        for (int64_t g = lo; g < hi; g += kGroup) {
            const int64_t width = std::min<int64_t>(kGroup, hi - g);
            int64_t r = 0;
            for (; r + kRows <= m; r += kRows)
                rows_dispatch<kRows>(kRows, x + r * ldx, ldx, k, packed, g, width, bias, y + r * ldy, ldy, n);
            if (r < m)
                rows_dispatch<kRows>(static_cast<int>(m - r), x + r * ldx, ldx, k, packed, g, width, bias,
                                     y + r * ldy, ldy, n);
        }
    }
}

}  // extern "C"
