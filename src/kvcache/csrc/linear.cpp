// Linear layers y = x W^T (+ bias) over a weight packed once into column panels
// (kvcache.hf.panels), in float32 or bfloat16. Built for the few rows of a decode step, where a
// BLAS call re-blocks the weight every time and reads it at a fraction of the memory bandwidth; any
// row count computes.
//
// One plain C entry point per operation, called through ctypes with raw pointers (no Python or
// torch headers, so it builds in a second or two).
//
//   w       T [N, K]              row major (a torch Linear's weight)
//   packed  T [ceil(N/16), K, 16] panel p holds columns 16p..16p+15 for every k, zero past N
//                                 (bfloat16 with AVX-512 BF16: k in pairs, [K/2, 16, 2] a panel)
//   x       T [M, K]              row stride ldx, K contiguous
//   bias    T [N] or null
//   y       T [M, N]              row stride ldy
//
// T is float (kv_linear*) or bfloat16 (kv_linear_bf16*, its bits as uint16). In bfloat16 the
// products are exact in float32, the sums run in float32, and each output is rounded to bfloat16
// once, to nearest even, after the bias: the weights stream at half the bytes. Three kernels, one
// per build and CPU (kv_linear_bf16_kernel): AMX tiles, vdpbf16ps on k pairs, or float32 FMAs on
// weights widened as they load.
//
// Each thread takes a contiguous run of panels (the runs differ by at most one panel), so the
// weight is read from memory once per call however many rows there are: in groups of kGroup panels
// (kept in L2), each tile of MR rows times G panels accumulates in registers over k, one weight
// vector loaded per panel and k, one row value broadcast per row and k. MR and G are chosen per
// row count and per register file: a tile holds at most kAcc accumulators of 16 floats.
// Sums run over k in the same order whatever the row count, so a row's output does not depend on
// how many rows share the call.

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <omp.h>

#include "amx.h"
#include "simd.h"
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

using namespace kv;  // v16, bf16, load16, widen: simd.h

constexpr int kPanel = 16;  // columns a panel is wide
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

// Round to nearest even, as torch's float32 -> bfloat16 conversion does (NaN stays a quiet NaN).
inline bf16 narrow(float f) {
    uint32_t bits;
    __builtin_memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return static_cast<bf16>(bits >> 16);
}

inline void store(float* y, const v16& v, int64_t width) { __builtin_memcpy(y, &v, width * sizeof(float)); }

inline void store(bf16* y, const v16& v, int64_t width) {
#if defined(__AVX512BF16__)
    // vcvtneps2bf16 rounds to nearest even as narrow does (a denormal input or output is flushed to 0)
    __m512 f;
    __builtin_memcpy(&f, &v, sizeof f);
    const __m256i h = (__m256i)_mm512_cvtneps_pbh(f);
    if (width == kPanel) _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), h);
    else _mm256_mask_storeu_epi16(y, static_cast<__mmask16>((1u << width) - 1), h);
#else
    for (int64_t j = 0; j < width; ++j) y[j] = narrow(v[j]);
#endif
}

// The bias of columns c0 .. c0 + width (width <= 16) as float32, zeros past them or without one.
template <typename T>
inline v16 bias16(const T* bias, int64_t c0, int64_t width) {
    v16 add = v16{};
    if (bias == nullptr) return add;
    if (width == kPanel) return load16(bias + c0);
    for (int64_t j = 0; j < width; ++j) add[j] = widen(bias[c0 + j]);
    return add;
}

// The products of rows [0, MR) of x and panels [0, G) of a group, summed over k in order: float32
// x and panels (each bfloat16 weight vector widened as it is loaded).
template <int MR, int G, typename T>
inline void sums(const float* x, int64_t ldx, int64_t k, const T* panels, int64_t panel_stride, v16 (&acc)[MR][G]) {
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
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// One panel (G = 1, every full tile of rows) on AVX2: each row's two 8-float sums in variables of
// their own; an array of them, however indexed, GCC 12 also stores to the stack at every k (2.5x
// slower).
#define KV_ROW(r)                                                                   \
    if constexpr (MR > r) {                                                         \
        const __m256 b = _mm256_broadcast_ss(x + r * ldx + i);                      \
        lo##r = _mm256_fmadd_ps(b, wl, lo##r);                                      \
        hi##r = _mm256_fmadd_ps(b, wh, hi##r);                                      \
    }
#define KV_OUT(r)                                                                   \
    if constexpr (MR > r) {                                                         \
        _mm256_storeu_ps(reinterpret_cast<float*>(&acc[r][0]), lo##r);              \
        _mm256_storeu_ps(reinterpret_cast<float*>(&acc[r][0]) + 8, hi##r);          \
    }
template <int MR>
inline void sums_one(const float* x, int64_t ldx, int64_t k, const float* panel, v16 (&acc)[MR][1]) {
    static_assert(MR <= 6, "six rows at most: 12 sums and 2 weights of 16 registers");
    __m256 lo0 = _mm256_setzero_ps(), hi0 = lo0, lo1 = lo0, hi1 = lo0, lo2 = lo0, hi2 = lo0;
    __m256 lo3 = lo0, hi3 = lo0, lo4 = lo0, hi4 = lo0, lo5 = lo0, hi5 = lo0;
    for (int64_t i = 0; i < k; ++i) {
        const float* w = panel + i * kPanel;
        __builtin_prefetch(w + 64 * kPanel);
        const __m256 wl = _mm256_loadu_ps(w), wh = _mm256_loadu_ps(w + 8);
        KV_ROW(0) KV_ROW(1) KV_ROW(2) KV_ROW(3) KV_ROW(4) KV_ROW(5)
    }
    KV_OUT(0) KV_OUT(1) KV_OUT(2) KV_OUT(3) KV_OUT(4) KV_OUT(5)
}
#undef KV_ROW
#undef KV_OUT

// The same as the generic sums for float32 panels on AVX2, at the register width: each 16-float
// sum as two 8-float registers, never a 64-byte generic vector (which GCC lowers through memory
// there: about 6x slower). Same order of sums.
template <int MR, int G>
inline void sums(const float* x, int64_t ldx, int64_t k, const float* panels, int64_t panel_stride, v16 (&acc)[MR][G]) {
    if constexpr (G == 1 && MR <= 6) {
        (void)panel_stride;
        return sums_one<MR>(x, ldx, k, panels, acc);
    }
    __m256 lo[MR][G], hi[MR][G];
    for (int r = 0; r < MR; ++r)
        for (int g = 0; g < G; ++g) {
            lo[r][g] = _mm256_setzero_ps();
            hi[r][g] = _mm256_setzero_ps();
        }
    for (int64_t i = 0; i < k; ++i) {
        __m256 wl[G], wh[G];
        for (int g = 0; g < G; ++g) {
            const float* w = panels + g * panel_stride + i * kPanel;
            __builtin_prefetch(w + 64 * kPanel);
            wl[g] = _mm256_loadu_ps(w);
            wh[g] = _mm256_loadu_ps(w + 8);
        }
        for (int r = 0; r < MR; ++r) {
            const __m256 b = _mm256_broadcast_ss(x + r * ldx + i);
            for (int g = 0; g < G; ++g) {
                lo[r][g] = _mm256_fmadd_ps(b, wl[g], lo[r][g]);
                hi[r][g] = _mm256_fmadd_ps(b, wh[g], hi[r][g]);
            }
        }
    }
    for (int r = 0; r < MR; ++r)
        for (int g = 0; g < G; ++g) {
            float* out = reinterpret_cast<float*>(&acc[r][g]);
            _mm256_storeu_ps(out, lo[r][g]);
            _mm256_storeu_ps(out + 8, hi[r][g]);
        }
}
#endif

#if defined(__AVX512BF16__)
// bfloat16 x and panels in k pairs ([K/2, 16, 2] per panel): one vdpbf16ps adds two products to
// each of 16 float32 sums, pair after pair (the pair's two products added to the sum at once).
template <int MR, int G>
inline void sums(const bf16* x, int64_t ldx, int64_t k, const bf16* panels, int64_t panel_stride, v16 (&acc)[MR][G]) {
    __m512 sum[MR][G];
    for (int r = 0; r < MR; ++r)
        for (int g = 0; g < G; ++g) sum[r][g] = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i += 2) {
        __m512bh w[G];
        for (int g = 0; g < G; ++g) {
            __builtin_prefetch(panels + g * panel_stride + (i + 64) * kPanel);
            w[g] = (__m512bh)_mm512_loadu_si512(panels + g * panel_stride + i * kPanel);
        }
        for (int r = 0; r < MR; ++r) {
            const __m512bh b = pair_at(x + r * ldx + i);
            for (int g = 0; g < G; ++g) sum[r][g] = _mm512_dpbf16_ps(sum[r][g], w[g], b);
        }
    }
    for (int r = 0; r < MR; ++r)
        for (int g = 0; g < G; ++g) __builtin_memcpy(&acc[r][g], &sum[r][g], sizeof(v16));
}
constexpr bool kPairs = true;  // bfloat16 panels hold k in pairs
#else
constexpr bool kPairs = false;
#endif

// Rows [0, MR) of x times panels [0, G) of a group: y's columns col .. col + 16G (cut at n).
template <int MR, int G, typename X, typename T>
inline void tile(const X* x, int64_t ldx, int64_t k, const T* panels, int64_t panel_stride,
                 const T* bias, T* y, int64_t ldy, int64_t col, int64_t n) {
    v16 acc[MR][G];
    for (int r = 0; r < MR; ++r)
        for (int g = 0; g < G; ++g) acc[r][g] = v16{};
    sums<MR, G>(x, ldx, k, panels, panel_stride, acc);
    for (int g = 0; g < G; ++g) {
        const int64_t c0 = col + g * kPanel;
        const int64_t width = std::min<int64_t>(kPanel, n - c0);
        if (width <= 0) break;
        const v16 add = bias16(bias, c0, width);
        for (int r = 0; r < MR; ++r) store(y + r * ldy + c0, acc[r][g] + add, width);
    }
}

// Tiles of MR rows over `count` panels starting at `first`, G at a time (fewer at the end).
template <int MR, typename X, typename T>
void rows_over(const X* x, int64_t ldx, int64_t k, const T* packed, int64_t first, int64_t count,
               const T* bias, T* y, int64_t ldy, int64_t n) {
    constexpr int G = std::max(1, std::min(kGroup, kAcc / MR));
    const int64_t stride = k * kPanel;
    int64_t p = first;
    for (; p + G <= first + count; p += G) tile<MR, G>(x, ldx, k, packed + p * stride, stride, bias, y, ldy, p * kPanel, n);
    for (; p < first + count; ++p) tile<MR, 1>(x, ldx, k, packed + p * stride, stride, bias, y, ldy, p * kPanel, n);
}

template <int MR, typename X, typename T>
void rows_dispatch(int rows, const X* x, int64_t ldx, int64_t k, const T* packed, int64_t first,
                   int64_t count, const T* bias, T* y, int64_t ldy, int64_t n) {
    if constexpr (MR > 0) {
        if (rows == MR) return rows_over<MR>(x, ldx, k, packed, first, count, bias, y, ldy, n);
        return rows_dispatch<MR - 1>(rows, x, ldx, k, packed, first, count, bias, y, ldy, n);
    }
}

// Panel p's element for column 16p + j and row i of k (pairs: [K/2, 16, 2], else [K, 16]).
template <bool Pairs>
inline int64_t at(int64_t i, int j) {
    return Pairs ? (i / 2) * 2 * kPanel + j * 2 + (i % 2) : i * kPanel + j;
}

template <bool Pairs, typename T>
void pack(const T* w, int64_t n, int64_t k, T* packed, int threads) {
    const int64_t panels = (n + kPanel - 1) / kPanel;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t p = 0; p < panels; ++p) {
        T* out = packed + p * k * kPanel;
        for (int64_t i = 0; i < k; ++i)
            for (int j = 0; j < kPanel; ++j) {
                const int64_t c = p * kPanel + j;
                out[at<Pairs>(i, j)] = c < n ? w[c * k + i] : T(0);
            }
    }
}

// run(lo, hi) on each of up to `threads` threads, over contiguous runs of the ceil(n/16) panels
// that differ by at most one panel.
template <typename F>
void over_panel_runs(int64_t n, int threads, F&& run) {
    const int64_t panels = (n + kPanel - 1) / kPanel;
    const int used = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, panels)));
#pragma omp parallel num_threads(used)
    {
        const int t = omp_get_thread_num(), count = omp_get_num_threads();
        run(panels * t / count, panels * (t + 1) / count);
    }
}

template <typename X, typename T>
void linear(const X* x, int64_t m, int64_t k, int64_t ldx, const T* packed, int64_t n, const T* bias, T* y,
            int64_t ldy, int threads) {
    over_panel_runs(n, threads, [&](int64_t lo, int64_t hi) {
        for (int64_t g = lo; g < hi; g += kGroup) {
            const int64_t width = std::min<int64_t>(kGroup, hi - g);
            int64_t r = 0;
            for (; r + kRows <= m; r += kRows)
                rows_dispatch<kRows>(kRows, x + r * ldx, ldx, k, packed, g, width, bias, y + r * ldy, ldy, n);
            if (r < m)
                rows_dispatch<kRows>(static_cast<int>(m - r), x + r * ldx, ldx, k, packed, g, width, bias,
                                     y + r * ldy, ldy, n);
        }
    });
}


#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
// AMX: a tile multiply adds a [16 rows, 32 k] block of x times a [32 k, 16 columns] block of a
// panel (16 k pairs of the pairs layout, 1 KB contiguous) into a [16, 16] float32 tile. Tiles:
// 0-3 the sums of four panels, 4 the rows of x, 5-7 panel blocks. A call of up to 16 rows takes
// tiles of its own rows; more rows come zero-padded to 16-row blocks. Either way each output row is
// summed over k in the same order whatever the other rows.
constexpr int64_t kAhead = 128;  // k rows of a panel prefetched ahead (4 KB)

template <int G>
inline void amx_block(const bf16* xs, int64_t ldx, int64_t k, const bf16* panels, int64_t stride) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t i = 0; i < k; i += 32) {
        _tile_loadd(4, xs + i, ldx * 2);
        const bf16* b = panels + i * kPanel;  // 16 k pairs of 16 columns: 32 k rows of the panel
        for (int g = 0; g < G; ++g)
            for (int line = 0; line < 16; ++line) __builtin_prefetch(b + g * stride + kAhead * kPanel + line * 32);
        _tile_loadd(5, b, 64);
        _tile_dpbf16ps(0, 4, 5);
        if constexpr (G > 1) { _tile_loadd(6, b + stride, 64); _tile_dpbf16ps(1, 4, 6); }
        if constexpr (G > 2) { _tile_loadd(7, b + 2 * stride, 64); _tile_dpbf16ps(2, 4, 7); }
        if constexpr (G > 3) { _tile_loadd(5, b + 3 * stride, 64); _tile_dpbf16ps(3, 4, 5); }
    }
}

// y rows [0, m) of panels [lo, hi), from xs (row stride ldx): at most 16 rows as they are, in tiles
// of m rows (a row's sums are the same either way), or more rows padded to whole blocks of 16.
void amx_panels(const bf16* xs, int64_t ldx, int64_t m, int64_t k, const bf16* packed, int64_t lo, int64_t hi,
                const bf16* bias, bf16* y, int64_t ldy, int64_t n) {
    TileConfig config;
    const uint8_t tile_rows = static_cast<uint8_t>(std::min<int64_t>(16, m));  // sums and x; panels 16
    for (int t = 0; t < 8; ++t) config.rows[t] = t < 5 ? tile_rows : 16, config.colsb[t] = 64;
    _tile_loadconfig(&config);
    const int64_t stride = k * kPanel;
    alignas(64) float sums[4][16][16];
    for (int64_t p = lo; p < hi; p += 4) {
        const int g = static_cast<int>(std::min<int64_t>(4, hi - p));
        for (int64_t r0 = 0; r0 < m; r0 += 16) {
            const bf16* xb = xs + r0 * ldx;
            const bf16* b = packed + p * stride;
            if (g == 4) amx_block<4>(xb, ldx, k, b, stride);
            else if (g == 3) amx_block<3>(xb, ldx, k, b, stride);
            else if (g == 2) amx_block<2>(xb, ldx, k, b, stride);
            else amx_block<1>(xb, ldx, k, b, stride);
            _tile_stored(0, sums[0], 64); _tile_stored(1, sums[1], 64);
            _tile_stored(2, sums[2], 64); _tile_stored(3, sums[3], 64);
            const int64_t rows = std::min<int64_t>(16, m - r0);
            for (int j = 0; j < g; ++j) {
                const int64_t c0 = (p + j) * kPanel, width = std::min<int64_t>(kPanel, n - c0);
                const v16 add = bias16(bias, c0, width);
                for (int64_t r = 0; r < rows; ++r) {
                    v16 out;
                    __builtin_memcpy(&out, sums[j][r], sizeof out);
                    store(y + (r0 + r) * ldy + c0, out + add, width);
                }
            }
        }
    }
    _tile_release();
}

bool amx_linear(const bf16* x, int64_t m, int64_t k, int64_t ldx, const bf16* packed, int64_t n,
                const bf16* bias, bf16* y, int64_t ldy, int threads) {
    if (k % 32 != 0 || !amx_usable()) return false;
    std::vector<bf16> x16;
    if (m > 16) {  // rows padded with zeros to whole tiles
        x16.assign(static_cast<size_t>((m + 15) / 16 * 16 * k), 0);
        for (int64_t r = 0; r < m; ++r) std::memcpy(x16.data() + r * k, x + r * ldx, k * sizeof(bf16));
    }
    const bf16* xs = m > 16 ? x16.data() : x;
    const int64_t xstride = m > 16 ? k : ldx;
    over_panel_runs(n, threads, [&](int64_t lo, int64_t hi) {
        amx_panels(xs, xstride, m, k, packed, lo, hi, bias, y, ldy, n);
    });
    return true;
}
#else
bool amx_linear(const bf16*, int64_t, int64_t, int64_t, const bf16*, int64_t, const bf16*, bf16*, int64_t, int) {
    return false;
}
#endif

}  // namespace

extern "C" {

// Panel width (the packed layout's last dimension).
int kv_linear_panel() { return kPanel; }

// How bfloat16 calls multiply: 2 AMX tiles (where K is a multiple of 32), 1 vdpbf16ps, 0 float32
// FMAs on widened weights (AVX-512), -1 too slowly to be worth it (narrower vectors: the widening
// and rounding are not vectorized there). Asks the OS for AMX permission the first time.
int kv_linear_bf16_kernel() {
    if (kAmx && amx_usable()) return 2;
#if defined(__AVX512F__)
    return kPairs ? 1 : 0;
#else
    return -1;
#endif
}

// w [n, k] -> packed [ceil(n/16), k, 16]; columns past n are zeros.
void kv_linear_pack(const float* w, int64_t n, int64_t k, float* packed, int threads) {
    pack<false>(w, n, k, packed, threads);
}

void kv_linear_pack_bf16(const bf16* w, int64_t n, int64_t k, bf16* packed, int threads) {
    pack<kPairs>(w, n, k, packed, threads);
}

// y [m, n] = x [m, k] packed^T (+ bias).
void kv_linear(const float* x, int64_t m, int64_t k, int64_t ldx, const float* packed, int64_t n,
               const float* bias, float* y, int64_t ldy, int threads) {
    linear(x, m, k, ldx, packed, n, bias, y, ldy, threads);
}

void kv_linear_bf16(const bf16* x, int64_t m, int64_t k, int64_t ldx, const bf16* packed, int64_t n,
                    const bf16* bias, bf16* y, int64_t ldy, int threads) {
    if constexpr (kPairs) {
        if (amx_linear(x, m, k, ldx, packed, n, bias, y, ldy, threads)) return;
        linear(x, m, k, ldx, packed, n, bias, y, ldy, threads);
    } else {  // rows widened once here, not at every broadcast
        std::vector<float> rows(static_cast<size_t>(m * k));
        for (int64_t r = 0; r < m; ++r)
            for (int64_t i = 0; i < k; ++i) rows[r * k + i] = widen(x[r * ldx + i]);
        linear(rows.data(), m, k, k, packed, n, bias, y, ldy, threads);
    }
}

}  // extern "C"
