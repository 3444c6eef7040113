// Vectors the C++ libraries share (float_decode.cpp, coded_decode.cpp, linear.cpp, bf16_attention.cpp): GCC vector
// extensions, sized by the instruction set the library is built for (-march, as KVCACHE_ISA says;
// kvcache.attention.native_build hashes this header with each source).
//
//   v16   16 floats: two registers on AVX2, four on NEON, one on AVX-512
//   vw    the register width: 16 floats with AVX-512, else 8
//   load16 / loadw   floats, or bfloat16 bits widened in registers (a bfloat16 is the top half of a float32)
//   sums16  lane t = the sum of the 16 lanes of part[t], for 16 vectors at once
//   hsum16  the sum of one vector's 16 lanes
//   codes_w / codes16   codes of BITS bits as floats, widened in registers from bytes (KV_FP8: e4m3
//                       bytes, in units of kCodeUnit)
//   code_at             one code as a float
//   exp_nonpositive     e^x for x <= 0, on a float or a vw
//   exp_and_sum         a row of scores turned into their softmax numerators, and their sum
//   to_split            a row of floats in the coded kernels' split channel order
//   pair_at             (AVX-512 BF16) the bfloat16 pair at p in every lane, as vdpbf16ps takes it
//   words_w / dot_pairs / lane_sums   16-bit integer dot products (below)
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

#if defined(KV_FP8)
// ---- e4m3 codes (the coded library's fp8 build: coded_decode.cpp compiled with KV_FP8): each byte
// is a float of 1 sign, 4 exponent (bias 7) and 3 mantissa bits, subnormal below exponent 1, with
// no infinities (0x7f/0xff are NaN, which the coder never writes). kE4M3[b]: the value of byte b.
struct E4M3Values {
    float value[256];
    E4M3Values() {
        for (int b = 0; b < 256; ++b) {
            const int e = (b >> 3) & 15, m = b & 7;
            const float mag = e ? __builtin_ldexpf(8.f + m, e - 10) : __builtin_ldexpf(static_cast<float>(m), -9);
            value[b] = b & 0x80 ? -mag : mag;
        }
    }
};
inline const E4M3Values kE4M3{};
#endif

// The code at `shift` of a byte, as a float: (byte >> shift) & (2^BITS - 1), or (KV_FP8) the
// e4m3 value of the byte (BITS 8).
template <int BITS>
KV_INLINE float code_at(uint8_t byte, int shift) {
#if defined(KV_FP8)
    static_assert(BITS == 8, "fp8 codes are bytes");
    return kE4M3.value[byte];
#else
    return static_cast<float>((byte >> shift) & ((1 << BITS) - 1));
#endif
}

// kW floats from kW bytes: (byte >> shift) & (2^BITS - 1), each a code of BITS bits (shift 0 for 8).
// KV_FP8: each byte's e4m3 value over kCodeUnit. With F16C the byte is sign-extended to 16 bits and
// shifted left by 7 (its exponent and mantissa into float16's, below a copy of the sign that is then
// cleared): a float16 of 2^-8 times the value (float16's exponent bias is 8 more; subnormals line
// up), widened by vcvtph2ps. The callers fold kCodeUnit into the scale they apply anyway.
#if defined(KV_FP8) && defined(__F16C__) && defined(__AVX2__)
constexpr float kCodeUnit = 256.f;
#else
constexpr float kCodeUnit = 1.f;
#endif

template <int BITS>
KV_INLINE vw codes_w(const uint8_t* p, int shift) {
    constexpr int mask = (1 << BITS) - 1;
#if defined(KV_FP8) && defined(__F16C__) && defined(__AVX2__)
    static_assert(BITS == 8, "fp8 codes are bytes");
    (void)mask;
    (void)shift;
#if defined(__AVX512F__)
    const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i h = _mm256_and_si256(_mm256_slli_epi16(w, 7), _mm256_set1_epi16(static_cast<short>(0xBFFF)));
    return (vw)_mm512_cvtph_ps(h);
#else
    const __m128i w = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m128i h = _mm_and_si128(_mm_slli_epi16(w, 7), _mm_set1_epi16(static_cast<short>(0xBFFF)));
    return (vw)_mm256_cvtph_ps(h);
#endif
#elif defined(KV_FP8)
    (void)mask;
    vw v;
    for (int i = 0; i < kW; ++i) v[i] = code_at<BITS>(p[i], shift);
    return v;
#elif defined(__AVX512F__)
    __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    if (BITS < 8) x = _mm512_and_si512(_mm512_srl_epi32(x, _mm_cvtsi32_si128(shift)), _mm512_set1_epi32(mask));
    return (vw)_mm512_cvtepi32_ps(x);
#elif defined(__AVX2__)
    __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    if (BITS < 8) x = _mm256_and_si256(_mm256_srl_epi32(x, _mm_cvtsi32_si128(shift)), _mm256_set1_epi32(mask));
    return (vw)_mm256_cvtepi32_ps(x);
#else
    vw v;
    for (int i = 0; i < kW; ++i) v[i] = static_cast<float>((p[i] >> shift) & mask);
    return v;
#endif
}

// 16 floats from 16 bytes as codes_w, each times `scale` (applied at the register width).
template <int BITS>
KV_INLINE v16 codes16(const uint8_t* p, int shift, float scale = 1.f) {
#if defined(__AVX512F__)
    return codes_w<BITS>(p, shift) * scale;
#else
    const vw lo = codes_w<BITS>(p, shift) * scale, hi = codes_w<BITS>(p + kW, shift) * scale;
    v16 v;
    __builtin_memcpy(&v, &lo, sizeof lo);
    __builtin_memcpy(reinterpret_cast<float*>(&v) + kW, &hi, sizeof hi);
    return v;
#endif
}

#if defined(__AVX512F__)
// Two vectors each holding 16 / WIDTH vectors' partial sums, a group of WIDTH lanes each -> one
// vector holding all of them in order (a's, then b's), WIDTH / 2 lanes each: each group's upper
// half added to its lower half. V: 16 floats or 16 32-bit integers.
template <int WIDTH, typename V>
KV_INLINE V fold(V a, V b) {
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
template <typename V>
KV_INLINE V sums16(const V* part) {
    V l8[8], l4[4], l2[2];
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

// ---- integer dot products (the coded key scores of coded_decode.cpp): kWords codes widened to 16-bit
// integers in one register, times a query rounded to 16 bits, adjacent products summed in pairs
// into kW 32-bit lanes (vpmaddwd, or VNNI's vpdpwssd where the build has it). Codes of at most 8 bits
// times |query| <= 32767 sum exactly in 32 bits over up to 256 channels.
//
//   words_w     kWords codes of BITS bits (bytes p, shifted right by `shift`) as 16-bit integers
//   dot_pairs   acc + the pairwise sums of a * b
//   lane_sums   lane t = the sum of the kW lanes of part[t], as floats
//   interleave_lo / interleave_hi / pair_words   two tokens' words in pairs, and a pair of weights in every lane
// Not for e4m3 codes (KV_FP8): their values are not small integers.
#if ((defined(__AVX512F__) && defined(__AVX512BW__)) || (defined(__AVX2__) && !defined(__AVX512F__))) && !defined(KV_FP8)
#define KV_INT_DOTS 1
typedef int16_t ww __attribute__((vector_size(4 * kW)));
constexpr int kWords = 2 * kW;

template <int BITS>
KV_INLINE ww words_w(const uint8_t* p, int shift) {
    constexpr int mask = (1 << BITS) - 1;
#if defined(__AVX512F__)
    __m512i x = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    if (BITS < 8) x = _mm512_and_si512(_mm512_srl_epi16(x, _mm_cvtsi32_si128(shift)), _mm512_set1_epi16(mask));
#else
    __m256i x = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    if (BITS < 8) x = _mm256_and_si256(_mm256_srl_epi16(x, _mm_cvtsi32_si128(shift)), _mm256_set1_epi16(mask));
#endif
    return (ww)x;
}

KV_INLINE iw dot_pairs(iw acc, ww a, ww b) {
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
    return (iw)_mm512_dpwssd_epi32((__m512i)acc, (__m512i)a, (__m512i)b);
#elif defined(__AVX512F__)
    return acc + (iw)_mm512_madd_epi16((__m512i)a, (__m512i)b);
#elif defined(__AVXVNNI__)
    return (iw)_mm256_dpwssd_avx_epi32((__m256i)acc, (__m256i)a, (__m256i)b);
#else
    return acc + (iw)_mm256_madd_epi16((__m256i)a, (__m256i)b);
#endif
}

// Words of a and b interleaved in pairs (a_i, b_i), within each 128-bit lane: interleave_lo takes
// each lane's first four words of a and b, interleave_hi its last four.
KV_INLINE ww interleave_lo(ww a, ww b) {
#if defined(__AVX512F__)
    return (ww)_mm512_unpacklo_epi16((__m512i)a, (__m512i)b);
#else
    return (ww)_mm256_unpacklo_epi16((__m256i)a, (__m256i)b);
#endif
}

KV_INLINE ww interleave_hi(ww a, ww b) {
#if defined(__AVX512F__)
    return (ww)_mm512_unpackhi_epi16((__m512i)a, (__m512i)b);
#else
    return (ww)_mm256_unpackhi_epi16((__m256i)a, (__m256i)b);
#endif
}

// The 32-bit integer x in every lane, as a vector of words.
KV_INLINE ww pair_words(int32_t x) {
#if defined(__AVX512F__)
    return (ww)_mm512_set1_epi32(x);
#else
    return (ww)_mm256_set1_epi32(x);
#endif
}

KV_INLINE vw lane_sums(const iw* part) {
#if defined(__AVX512F__)
    return __builtin_convertvector(sums16(part), vw);
#else
    const __m256i s01 = _mm256_hadd_epi32((__m256i)part[0], (__m256i)part[1]);
    const __m256i s23 = _mm256_hadd_epi32((__m256i)part[2], (__m256i)part[3]);
    const __m256i s45 = _mm256_hadd_epi32((__m256i)part[4], (__m256i)part[5]);
    const __m256i s67 = _mm256_hadd_epi32((__m256i)part[6], (__m256i)part[7]);
    const __m256i s0123 = _mm256_hadd_epi32(s01, s23), s4567 = _mm256_hadd_epi32(s45, s67);
    const __m256i sums = _mm256_add_epi32(_mm256_permute2x128_si256(s0123, s4567, 0x20),
                                          _mm256_permute2x128_si256(s0123, s4567, 0x31));
    return __builtin_convertvector((iw)sums, vw);
#endif
}

KV_INLINE float lane_sum(iw a) {
    int32_t x = 0;
    for (int i = 0; i < kW; ++i) x += a[i];
    return static_cast<float>(x);
}
#endif

// exp(x) for x <= 0 without std::exp (a scalar call): x = n ln2 + r with |r| <= ln2 / 2, exp(r) by
// its degree-6 Taylor polynomial (relative error below 2e-7), and 2^n put straight into the
// exponent bits. Below -87 the result is 0. exp_reduced is the polynomial (V: float or a vector).
template <typename V>
KV_INLINE V exp_reduced(V x, V n) {
    const V r = x - n * 0.693145752f - n * 1.42860677e-6f;
    V p = V{} + 1.f / 720.f;
    p = p * r + 1.f / 120.f;
    p = p * r + 1.f / 24.f;
    p = p * r + 1.f / 6.f;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    return p * r + 1.f;
}

KV_INLINE float exp_nonpositive(float x) {
    const float clamped = x < -87.f ? -87.f : x;
    const float n = __builtin_floorf(clamped * 1.44269504f + 0.5f);
    const float p = exp_reduced(clamped, n);
    const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
    float scale;
    __builtin_memcpy(&scale, &bits, 4);
    return x < -87.f ? 0.f : p * scale;
}

// exp_nonpositive on a vector: the scalar one's bit moves keep GCC from vectorizing a loop over it,
// so loops over whole vectors call this one.
KV_INLINE vw exp_nonpositive(vw x) {
    const vw low = vw{} - 87.f;
    const vw clamped = x < low ? low : x;
    const vw y = clamped * 1.44269504f + 0.5f;
    vw n = __builtin_convertvector(__builtin_convertvector(y, iw), vw);  // toward zero, then down
    n = n > y ? n - 1.f : n;
    const vw p = exp_reduced(clamped, n);
    const iw bits = (__builtin_convertvector(n, iw) + 127) << 23;
    vw scale;
    __builtin_memcpy(&scale, &bits, sizeof scale);
    return x < low ? vw{} : p * scale;
}

// s[j] = e^(s[j] - m) for j < n, in place (m: at least every score, so each exponent is <= 0), and
// their sum. MASKED: a score at or below `floor` (a masked key's) becomes 0 instead.
template <bool MASKED = false>
KV_INLINE float exp_and_sum(float* __restrict s, int n, float m, float floor = 0.f) {
    vw total{};
    int j = 0;
    for (; j + kW <= n; j += kW) {  // the vector exp (a loop over the scalar one stays scalar)
        const vw x = loadw(s + j);
        vw p = exp_nonpositive(x - m);
        if constexpr (MASKED) p = x > floor ? p : vw{};
        __builtin_memcpy(s + j, &p, sizeof p);
        total += p;
    }
    float sum = 0.f;
    for (int i = 0; i < kW; ++i) sum += total[i];
    for (; j < n; ++j) {
        const float p = MASKED && !(s[j] > floor) ? 0.f : exp_nonpositive(s[j] - m);
        s[j] = p;
        sum += p;
    }
    return sum;
}

// x [dim] in split order into out: element per_byte * i + j of x at j * (dim / per_byte) + i (the
// order in which the coded kernels unpack a token's codes, per_byte of them a byte).
KV_INLINE void to_split(const float* __restrict x, int dim, int per_byte, float* __restrict out) {
    const int n = dim / per_byte;
    for (int j = 0; j < per_byte; ++j)
        for (int i = 0; i < n; ++i) out[j * n + i] = x[per_byte * i + j];
}

#if defined(__AVX512BF16__)
// A 32-bit broadcast of the bfloat16 pair at p: the two values every lane's dot product takes.
KV_INLINE __m512bh pair_at(const bf16* p) {
    int32_t pair;
    __builtin_memcpy(&pair, p, sizeof pair);
    return (__m512bh)_mm512_set1_epi32(pair);
}
#endif

}  // namespace kv
