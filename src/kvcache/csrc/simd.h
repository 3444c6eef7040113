// Vectors the C++ libraries share (float_decode.cpp, coded_decode.cpp, linear.cpp): GCC vector
// extensions, sized by the instruction set the library is built for (-march, as KVCACHE_ISA says;
// kvcache.attention.native_build hashes this header with each source).
//
//   v16   16 floats: two registers on AVX2, four on NEON, one on AVX-512
//   vw    the register width: 16 floats with AVX-512, else 8
//   load16 / loadw   floats, or bfloat16 bits widened in registers (a bfloat16 is the top half of a float32)
//   sums16  lane t = the sum of the 16 lanes of part[t], for 16 vectors at once
//   hsum16  the sum of one vector's 16 lanes
#pragma once

#include <cstdint>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define KV_INLINE inline __attribute__((always_inline))

namespace kv {

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16 __attribute__((vector_size(64)));
typedef uint16_t h16 __attribute__((vector_size(32)));
typedef uint16_t bf16;  // bfloat16's bits

KV_INLINE v16 load16(const float* p) {
    v16 v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}

// A vector V of float32 from as many bfloat16 (H: their vector, I: 32-bit integers of V's lanes).
template <typename V, typename H, typename I>
KV_INLINE V widen_bits(const bf16* p) {
    H h;
    __builtin_memcpy(&h, p, sizeof h);
    const I bits = __builtin_convertvector(h, I) << 16;
    V v;
    __builtin_memcpy(&v, &bits, sizeof v);
    return v;
}

KV_INLINE v16 load16(const bf16* p) { return widen_bits<v16, h16, i16>(p); }

KV_INLINE float widen(float v) { return v; }

KV_INLINE float widen(bf16 v) {
    const uint32_t bits = static_cast<uint32_t>(v) << 16;
    float f;
    __builtin_memcpy(&f, &bits, sizeof f);
    return f;
}

// The register-wide vector: a scalar times a vector wider than the registers is broadcast through
// memory element by element, so loops that scale vectors by scalars use this width.
#if defined(__AVX512F__)
typedef v16 vw;
#else
typedef float vw __attribute__((vector_size(32)));
#endif
constexpr int kW = sizeof(vw) / sizeof(float);
typedef uint16_t hw __attribute__((vector_size(2 * kW)));
typedef int32_t iw __attribute__((vector_size(4 * kW)));

KV_INLINE vw loadw(const float* p) {
    vw v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}

KV_INLINE vw loadw(const bf16* p) { return widen_bits<vw, hw, iw>(p); }

#if defined(__AVX512F__)
// Two vectors each holding 16 / WIDTH vectors' partial sums, a group of WIDTH lanes each -> one
// vector holding all of them in order (a's, then b's), WIDTH / 2 lanes each: each group's upper
// half added to its lower half.
template <int WIDTH>
KV_INLINE v16 fold(v16 a, v16 b) {
    i16 lo, hi;
    for (int i = 0; i < 16; ++i) {
        constexpr int keys = 16 / WIDTH;
        const int group = i / (WIDTH / 2), lane = i % (WIDTH / 2);
        const int source = group < keys ? group * WIDTH + lane : 16 + (group - keys) * WIDTH + lane;
        lo[i] = source;
        hi[i] = source + WIDTH / 2;
    }
    return __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, hi);
}

// Four rounds of pairwise shuffles and adds (15 of each, against 64 for a horizontal sum a vector).
KV_INLINE v16 sums16(const v16* part) {
    v16 l8[8], l4[4], l2[2];
    for (int i = 0; i < 8; ++i) l8[i] = fold<16>(part[2 * i], part[2 * i + 1]);
    for (int i = 0; i < 4; ++i) l4[i] = fold<8>(l8[2 * i], l8[2 * i + 1]);
    for (int i = 0; i < 2; ++i) l2[i] = fold<4>(l4[2 * i], l4[2 * i + 1]);
    return fold<2>(l2[0], l2[1]);
}

KV_INLINE float hsum16(v16 a) { return _mm512_reduce_add_ps((__m512)a); }
#else
// Where registers hold 8 floats, a 16-lane shuffle spans two registers and compiles to
// element-by-element moves through memory: each vector's 16 lanes are first added into 8, and on
// AVX2 8 vectors' sums are folded by horizontal adds (two levels) and one 128-bit lane swap.
typedef float v8 __attribute__((vector_size(32)));

KV_INLINE v8 half_sum(const v16& a) {
    v8 lo, hi;
    __builtin_memcpy(&lo, &a, sizeof lo);
    __builtin_memcpy(&hi, reinterpret_cast<const float*>(&a) + 8, sizeof hi);
    return lo + hi;
}

#if defined(__AVX2__)
// Lane t: the sum of the 8 lanes of h[t].
KV_INLINE v8 sums8(const v8* h) {
    const __m256 s01 = _mm256_hadd_ps((__m256)h[0], (__m256)h[1]), s23 = _mm256_hadd_ps((__m256)h[2], (__m256)h[3]);
    const __m256 s45 = _mm256_hadd_ps((__m256)h[4], (__m256)h[5]), s67 = _mm256_hadd_ps((__m256)h[6], (__m256)h[7]);
    const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
    return (v8)_mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}
#else
KV_INLINE v8 sums8(const v8* h) {
    v8 out;
    for (int t = 0; t < 8; ++t) {
        float x = 0.f;
        for (int i = 0; i < 8; ++i) x += h[t][i];
        out[t] = x;
    }
    return out;
}
#endif

KV_INLINE v16 sums16(const v16* part) {
    v8 h[8];
    v16 out;
    for (int half = 0; half < 2; ++half) {
        for (int t = 0; t < 8; ++t) h[t] = half_sum(part[8 * half + t]);
        const v8 got = sums8(h);
        __builtin_memcpy(reinterpret_cast<float*>(&out) + 8 * half, &got, sizeof got);
    }
    return out;
}

KV_INLINE float hsum16(v16 a) {
    const v8 h = half_sum(a);
    float x = 0.f;
    for (int i = 0; i < 8; ++i) x += h[i];
    return x;
}
#endif

}  // namespace kv
