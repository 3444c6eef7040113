// Decode attention over int8/int4/int2 codes, dequantized in registers (kvcache.attention.fused).
//
// Plain C entry points, called through ctypes with raw pointers (no Python or torch headers,
// so the library builds in a second or two). Layouts are those of kvcache.layers.codes:
//
//   keys:   codes [B, Hkv, nblk, G, D'] (per channel over blocks of G tokens),
//           scale / minimum float32 [B, Hkv, nblk, D]
//   values: codes [B, Hkv, T, Dv'], scale / minimum float32 [B, Hkv, T, Dv / Gv] (per token)
//
// D' = D * bits / 8: 4- and 2-bit codes are packed lowest bits first, element per_byte * i + j in
// bits [bits * j, bits * (j + 1)) of byte i. The kernels work in a "split" channel order,
// position j * (D / per_byte) + i for element per_byte * i + j, so that unpacking byte i's j-th
// code is a contiguous loop the compiler vectorizes; the query and the output are permuted to match.
//
// Scale and minimum never widen a block of codes: for keys they fold into the query,
//   q . (c * s + z) = (q * s) . c + q . z     (per block: s, z per channel),
// for values into the weights and one extra sum per group,
//   sum_t p_t (c_t * s_t + z_t) = sum_t (p_t s_t) c_t + sum_t p_t z_t.
//
// Batch rows and KV heads are split across OpenMP threads, and so are chunks of tokens (so one
// sequence still uses every core). Everything accumulates in float32.
//
// kv_coded_key_scores and kv_coded_weighted are the two products of a decode step, with the softmax
// done by the caller between them; kv_coded_decode_attention does the whole step in one pass over
// the codes (scores, softcap, an online softmax and the weighted values, chunk by chunk) and returns
// each row's normalised output and log-sum-exp. kv_paged_coded_decode is that pass for sequences whose
// blocks lie in a pool, in the order of each one's block table (kvcache.engine.paged), with an exact
// tail block per sequence; its tasks are (sequence, head, run of blocks).
//
// Keys may instead be coded per token, like values (kvcache.layers.slots, an eviction layer's slots,
// which are overwritten one at a time): codes [B, Hkv, T, D'], scale / minimum float32
// [B, Hkv, T, D / Gk]. Their scale folds into the unpacked codes (one multiply a channel, shared
// by the query rows) and their minimum into each group's sum of the query,
//   q . (c * s + z) = sum_g s_g (q_g . c_g) + z_g sum(q_g)     (per token: s, z per group),
// in kv_token_coded_key_scores and kv_token_coded_decode_attention (the one pass over such keys).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace {

using namespace kv;

constexpr int kMaxRows = 16;
constexpr int kMaxDim = 512;

template <int BITS>
KV_INLINE void unpack_split(const uint8_t* __restrict bytes, int dim, float* __restrict out) {
    constexpr int per_byte = 8 / BITS;
    const int n = dim / per_byte;
    for (int j = 0; j < per_byte; ++j) {
        float* __restrict o = out + j * n;
#pragma omp simd
        for (int i = 0; i < n; ++i) o[i] = code_at<BITS>(bytes[i], BITS * j);
    }
}

// Scores of rows query rows against keys [first_block, last_block) of one (batch, head).
template <int BITS>
KV_INLINE void key_scores_run(const float* __restrict q, int rows, int dim, int group, const uint8_t* __restrict codes,
                              const float* __restrict scale, const float* __restrict minimum, int first_block,
                              int last_block, float* __restrict out, int64_t out_row_stride) {
    constexpr int per_byte = 8 / BITS;
    const int n = dim / per_byte, packed = dim * BITS / 8;
    alignas(64) float qs[kMaxRows * kMaxDim];
    alignas(64) float codes_f[kMaxDim];
    float bias[kMaxRows];
    for (int blk = first_block; blk < last_block; ++blk) {
        const float* s = scale + static_cast<int64_t>(blk) * dim;
        const float* z = minimum + static_cast<int64_t>(blk) * dim;
        for (int r = 0; r < rows; ++r) {
            const float* qr = q + r * dim;
            float* qsr = qs + r * dim;
            float b = 0.f;
            for (int j = 0; j < per_byte; ++j)
                for (int i = 0; i < n; ++i) {
                    const int d = per_byte * i + j;
                    qsr[j * n + i] = qr[d] * s[d];
                    b += qr[d] * z[d];
                }
            bias[r] = b;
        }
        const uint8_t* block_codes = codes + static_cast<int64_t>(blk) * group * packed;
        for (int t = 0; t < group; ++t) {
            unpack_split<BITS>(block_codes + static_cast<int64_t>(t) * packed, dim, codes_f);
            const int64_t col = static_cast<int64_t>(blk) * group + t;
            for (int r = 0; r < rows; ++r) {
                const float* __restrict qsr = qs + r * dim;
                float acc = 0.f;
#pragma omp simd reduction(+ : acc)
                for (int d = 0; d < dim; ++d) acc += qsr[d] * codes_f[d];
                out[r * out_row_stride + col] = acc + bias[r];
            }
        }
    }
}

// One token's codes coded per token (groups of `group` channels, scale [dim / group]) unpacked in
// split order, each times its group's scale: in split order, group g of chunk j is the run
// [j * n + g * group / per_byte, ...) of group / per_byte floats.
template <int BITS>
KV_INLINE void unpack_scaled(const uint8_t* __restrict bytes, const float* __restrict scale, int dim, int group,
                             float* __restrict out) {
    constexpr int per_byte = 8 / BITS;
    const int n = dim / per_byte, groups = dim / group, group_bytes = group / per_byte;
    for (int j = 0; j < per_byte; ++j)
        for (int g = 0; g < groups; ++g) {
            const float sg = scale[g];
            float* __restrict o = out + j * n + g * group_bytes;
            const uint8_t* bg = bytes + g * group_bytes;
#pragma omp simd
            for (int i = 0; i < group_bytes; ++i) o[i] = code_at<BITS>(bg[i], BITS * j) * sg;
        }
}

// q [rows, dim] in split order, into out.
template <int BITS>
KV_INLINE void split_rows(const float* __restrict q, int rows, int dim, float* __restrict out) {
    for (int r = 0; r < rows; ++r) to_split(q + r * dim, dim, 8 / BITS, out + r * dim);
}

// out [rows, dim / group]: each row's sum over each group of `group` channels of q [rows, dim].
KV_INLINE void group_sums(const float* __restrict q, int rows, int dim, int group, float* __restrict out) {
    const int groups = dim / group;
    for (int r = 0; r < rows; ++r)
        for (int g = 0; g < groups; ++g) {
            float sum = 0.f;
            for (int i = 0; i < group; ++i) sum += q[r * dim + g * group + i];
            out[r * groups + g] = sum;
        }
}

// Scores of rows query rows (in channel order) against tokens [first, last) of one (batch, head)
// whose keys are coded per token in groups of `group` channels.
template <int BITS>
KV_INLINE void token_scores_run(const float* __restrict q, int rows, int dim, int group, const uint8_t* __restrict codes,
                                const float* __restrict scale, const float* __restrict minimum, int first, int last,
                                float* __restrict out, int64_t out_row_stride) {
    const int packed = dim * BITS / 8, groups = dim / group;
    alignas(64) float qperm[kMaxRows * kMaxDim];
    alignas(64) float scaled[kMaxDim];
    float qsum[kMaxRows * kMaxDim];
    split_rows<BITS>(q, rows, dim, qperm);
    group_sums(q, rows, dim, group, qsum);
    for (int64_t t = first; t < last; ++t) {
        unpack_scaled<BITS>(codes + t * packed, scale + t * groups, dim, group, scaled);
        const float* z = minimum + t * groups;
        for (int r = 0; r < rows; ++r) {
            const float* __restrict qr = qperm + r * dim;
            float acc = 0.f;
#pragma omp simd reduction(+ : acc)
            for (int d = 0; d < dim; ++d) acc += qr[d] * scaled[d];
            for (int g = 0; g < groups; ++g) acc += z[g] * qsum[r * groups + g];
            out[r * out_row_stride + t] = acc;
        }
    }
}

// Weighted values of tokens [first, last) of one (batch, head), added into acc [rows, dim] (split
// order) and zacc [rows, groups].
template <int BITS>
KV_INLINE void weighted_run(const float* __restrict p, int64_t p_row_stride, int rows, int dim, int vgroup,
                            const uint8_t* __restrict codes, const float* __restrict scale,
                            const float* __restrict minimum, int64_t first, int64_t last, float* __restrict acc,
                            float* __restrict zacc) {
    const int packed = dim * BITS / 8, groups = dim / vgroup;
    alignas(64) float scaled[kMaxDim];
    for (int64_t t = first; t < last; ++t) {
        unpack_scaled<BITS>(codes + t * packed, scale + t * groups, dim, vgroup, scaled);
        const float* z = minimum + t * groups;
        for (int r = 0; r < rows; ++r) {
            const float w = p[r * p_row_stride + t];
            if (w == 0.f) continue;  // masked keys (padding) cost no arithmetic
            float* __restrict a = acc + r * dim;
#pragma omp simd
            for (int d = 0; d < dim; ++d) a[d] += w * scaled[d];
            for (int g = 0; g < groups; ++g) zacc[r * groups + g] += w * z[g];
        }
    }
}

// ---- fast paths: head dims of 64 or 128 (NV = D / 16 vectors of 16 floats), a few rows at a time,
// the rows' products kept in registers (GCC vector extensions, sized by -march: simd.h). Scores sum
// each key's 16 lanes with sums16; weighted values accumulate in vectors of the register width.
#if defined(__AVX512F__)
constexpr int kRowsTogether = 4;
#else
constexpr int kRowsTogether = 2;  // 16 registers of 8 floats: more rows' sums would spill
#endif

// One token's codes as NV float vectors in split order (see the top of the file), widened in
// registers: vector k holds split positions [16k, 16k + 16), the bytes from 16k mod n on, chunk 16k / n
// (n = the token's bytes); `scale`, where given, times each vector its group's (gidx: vector_groups);
// without it the codes are in units of kCodeUnit (simd.h), which the caller folds in.
template <int BITS, int NV>
KV_INLINE void unpack_vectors(const uint8_t* __restrict bytes, v16* out, const float* scale = nullptr,
                              const int* gidx = nullptr) {
    constexpr int n = NV * 16 * BITS / 8;
    for (int k = 0; k < NV; ++k)
        out[k] = codes16<BITS>(bytes + 16 * k % n, BITS * (16 * k / n), scale ? scale[gidx[k]] * kCodeUnit : 1.f);
}

// Scores of R rows (qperm: the rows in split order, q: in channel order) against blocks [first, last).
template <int BITS, int NV, int R>
KV_INLINE void key_scores_fast(const float* qperm, const float* q, int group, const uint8_t* codes,
                               const float* scale, const float* minimum, int first, int last, float* out,
                               int64_t out_row) {
    constexpr int dim = NV * 16, packed = dim * BITS / 8;
    alignas(64) float s_split[dim];
    for (int blk = first; blk < last; ++blk) {
        const float* s = scale + static_cast<int64_t>(blk) * dim;
        const float* z = minimum + static_cast<int64_t>(blk) * dim;
        to_split(s, dim, 8 / BITS, s_split);
        v16 qs[R][NV];
        float bias[R];
        for (int r = 0; r < R; ++r) {
            v16 b = {};
            for (int k = 0; k < NV; ++k) {
                qs[r][k] = load16(qperm + r * dim + 16 * k) * load16(s_split + 16 * k) * kCodeUnit;  // unscaled codes: in kCodeUnit
                b += load16(q + r * dim + 16 * k) * load16(z + 16 * k);
            }
            bias[r] = hsum16(b);
        }
        const uint8_t* block_codes = codes + static_cast<int64_t>(blk) * group * packed;
        const int whole = group / 16 * 16;
        v16 partial[R][16];
        for (int t0 = 0; t0 < whole; t0 += 16) {
            for (int t = 0; t < 16; ++t) {
                v16 cf[NV];
                unpack_vectors<BITS, NV>(block_codes + static_cast<int64_t>(t0 + t) * packed, cf);
                for (int r = 0; r < R; ++r) {
                    v16 a = qs[r][0] * cf[0];
                    for (int k = 1; k < NV; ++k) a += qs[r][k] * cf[k];
                    partial[r][t] = a;
                }
            }
            const int64_t col = static_cast<int64_t>(blk) * group + t0;
            for (int r = 0; r < R; ++r) {
                const v16 sums = sums16(partial[r]) + bias[r];
                std::memcpy(out + r * out_row + col, &sums, sizeof sums);
            }
        }
        for (int t = whole; t < group; ++t) {
            v16 cf[NV];
            unpack_vectors<BITS, NV>(block_codes + static_cast<int64_t>(t) * packed, cf);
            const int64_t col = static_cast<int64_t>(blk) * group + t;
            for (int r = 0; r < R; ++r) {
                v16 a = qs[r][0] * cf[0];
                for (int k = 1; k < NV; ++k) a += qs[r][k] * cf[k];
                out[r * out_row + col] = hsum16(a) + bias[r];
            }
        }
    }
}

#if defined(KV_INT_DOTS)
constexpr int kAhead = 48;  // tokens ahead whose codes are prefetched

// The middle code, taken from every code: c * s + z = (c - mid) * s + (z + mid * s), and the rounding
// errors below scale with |c - mid| <= 2^(BITS-1), half of c's largest.
template <int BITS>
constexpr int16_t kMid = 1 << (BITS - 1);

// x [dim] (a multiple of kW) rounded to 16-bit integers against its largest magnitude m (half away
// from zero), into out; returns m / 32767, what a sum of products with out is scaled back by.
KV_INLINE float round_words(const float* x, int dim, int16_t* out) {
    vw top{};
    for (int d = 0; d < dim; d += kW) {
        const vw v = loadw(x + d), mag = v < 0.f ? -v : v;
        top = mag > top ? mag : top;
    }
    float m = 0.f;
    for (int i = 0; i < kW; ++i) m = std::max(m, top[i]);
    const float up = m > 0.f ? 32767.f / m : 0.f;
    for (int d = 0; d < dim; d += kW) {
        const vw v = loadw(x + d) * up;
        const iw whole = __builtin_convertvector(v + (v < 0.f ? vw{} - 0.5f : vw{} + 0.5f), iw);
        for (int i = 0; i < kW; ++i) out[d + i] = static_cast<int16_t>(whole[i]);
    }
    return m / 32767.f;
}

// Rows x [R, dim] (split order) rounded (round_words) into registers; back[r]: row r's scale back.
template <int NE, int R>
KV_INLINE void round_rows(const float* x, ww (&rows)[R][NE], float* back) {
    constexpr int dim = NE * kWords;
    alignas(64) int16_t words[dim];
    for (int r = 0; r < R; ++r) {
        back[r] = round_words(x + r * dim, dim, words);
        for (int k = 0; k < NE; ++k) __builtin_memcpy(&rows[r][k], words + kWords * k, sizeof(ww));
    }
}

// One token's codes (bytes, centred: kMid) against R rounded rows: the lanes of prod[r] sum to row
// r's product. Vector k of the token holds split positions [kWords k, kWords (k + 1)), its bytes
// from kWords k mod n, chunk kWords k / n: n (the token's bytes) is a multiple of kWords.
template <int BITS, int NE, int R>
KV_INLINE void word_products(const uint8_t* bytes, const ww (&rows)[R][NE], iw* prod) {
    constexpr int n = NE * kWords * BITS / 8;
    static_assert(n % kWords == 0, "a vector of codes lies in one chunk of the split order");
    __builtin_prefetch(bytes + kAhead * n);
    ww c[NE];
    for (int k = 0; k < NE; ++k) c[k] = words_w<BITS>(bytes + kWords * k % n, BITS * (kWords * k / n)) - kMid<BITS>;
    for (int r = 0; r < R; ++r) {
        iw a = dot_pairs(iw{}, c[0], rows[r][0]);
        for (int k = 1; k < NE; ++k) a = dot_pairs(a, c[k], rows[r][k]);
        prod[r] = a;
    }
}

// word_products of kW consecutive tokens (codes from bytes), summed: lane i of sums[r] is token i's.
template <int BITS, int NE, int R>
KV_INLINE void word_sums(const uint8_t* bytes, const ww (&rows)[R][NE], vw* sums) {
    constexpr int n = NE * kWords * BITS / 8;
    iw partial[R][kW];
    for (int i = 0; i < kW; ++i) {
        iw prod[R];
        word_products<BITS, NE, R>(bytes + i * n, rows, prod);
        for (int r = 0; r < R; ++r) partial[r][i] = prod[r];
    }
    for (int r = 0; r < R; ++r) sums[r] = lane_sums(partial[r]);
}

// key_scores_fast by integer dot products (simd.h: words_w, dot_pairs): per block, each row's q * scale
// (split order) is rounded to 16-bit integers against its largest magnitude m, the codes are widened
// to 16 bits and centred (kMid) and the products summed exactly in 32 bits, then scaled back by
// m / 32767. The rounding moves a score by at most m / 65534 * sum_d |codes_d - mid|, where float
// products would move it by about 2^-24 of each product; beside the coding error (half a code step
// a channel) it is some 2^-8 of that.
template <int BITS, int NE, int R>
KV_INLINE void key_scores_words(const float* qperm, const float* q, int group, const uint8_t* codes,
                                const float* scale, const float* minimum, int first, int last, float* out,
                                int64_t out_row) {
    constexpr int dim = NE * kWords, n = dim * BITS / 8;
    alignas(64) float s_split[dim];
    alignas(64) float qs[R * dim];
    for (int blk = first; blk < last; ++blk) {
        const float* s = scale + static_cast<int64_t>(blk) * dim;
        const float* z = minimum + static_cast<int64_t>(blk) * dim;
        to_split(s, dim, 8 / BITS, s_split);
        float back[R], bias[R];
        for (int r = 0; r < R; ++r) {
            vw b{};
            for (int d = 0; d < dim; d += kW) {
                const vw x = loadw(qperm + r * dim + d) * loadw(s_split + d);
                __builtin_memcpy(qs + r * dim + d, &x, sizeof x);
                b += loadw(q + r * dim + d) * loadw(z + d) + x * static_cast<float>(kMid<BITS>);  // codes kept centred
            }
            float sum = 0.f;
            for (int i = 0; i < kW; ++i) sum += b[i];
            bias[r] = sum;
        }
        ww qv[R][NE];
        round_rows<NE, R>(qs, qv, back);
        const uint8_t* block_codes = codes + static_cast<int64_t>(blk) * group * n;
        const int64_t col = static_cast<int64_t>(blk) * group;
        int t = 0;
        for (; t + kW <= group; t += kW) {
            vw sums[R];
            word_sums<BITS, NE, R>(block_codes + static_cast<int64_t>(t) * n, qv, sums);
            for (int r = 0; r < R; ++r) {
                const vw scores = sums[r] * back[r] + bias[r];
                std::memcpy(out + r * out_row + col + t, &scores, sizeof scores);
            }
        }
        for (; t < group; ++t) {
            iw prod[R];
            word_products<BITS, NE, R>(block_codes + static_cast<int64_t>(t) * n, qv, prod);
            for (int r = 0; r < R; ++r) out[r * out_row + col + t] = lane_sum(prod[r]) * back[r] + bias[r];
        }
    }
}
#endif

#if defined(KV_INT_DOTS)
// token_scores_fast by integer dot products, for keys with one scale a token: each row (split order)
// rounded to 16 bits once (round_words), each token's centred codes multiplied and summed exactly in
// 32 bits, then scaled back: score = s_t (m / 32767) sum + (z_t + mid s_t) sum(q). The rounding
// moves a score by at most s_t m / 65534 * sum_d |codes_d - mid|. qsum [R]: each row's sum.
template <int BITS, int NE, int R>
KV_INLINE void token_scores_words(const float* qperm, const float* qsum, const uint8_t* codes, const float* scale,
                                  const float* minimum, int first, int last, float* out, int64_t out_row) {
    constexpr int n = NE * kWords * BITS / 8;
    ww qv[R][NE];
    float back[R];
    round_rows<NE, R>(qperm, qv, back);
    int64_t t = first;
    for (; t + kW <= last; t += kW) {
        vw sums[R];
        word_sums<BITS, NE, R>(codes + t * n, qv, sums);
        const vw s = loadw(scale + t), z = loadw(minimum + t) + s * static_cast<float>(kMid<BITS>);
        for (int r = 0; r < R; ++r) {
            const vw scores = sums[r] * (s * back[r]) + z * qsum[r];
            std::memcpy(out + r * out_row + t, &scores, sizeof scores);
        }
    }
    for (; t < last; ++t) {
        iw prod[R];
        word_products<BITS, NE, R>(codes + t * n, qv, prod);
        const float z = minimum[t] + scale[t] * kMid<BITS>;
        for (int r = 0; r < R; ++r) out[r * out_row + t] = lane_sum(prod[r]) * (scale[t] * back[r]) + z * qsum[r];
    }
}
#endif

// gidx[k]: the group of vector k of a token in split order, for groups of `group` channels whose
// codes take a multiple of 16 bytes (no vector straddles two groups).
template <int BITS, int NV>
KV_INLINE void vector_groups(int group, int* gidx) {
    constexpr int per_byte = 8 / BITS, chunks = NV / per_byte;
    const int group_bytes = group / per_byte;
    for (int k = 0; k < NV; ++k) gidx[k] = (k % chunks) * 16 / group_bytes;
}

// One per-token coded key against R rows (q: the rows in split order; qsum [R, groups]: their sums
// per channel group): prod[r], whose lanes sum to row r's score less bias[r], the minimums' share.
template <int BITS, int NV, int R>
KV_INLINE void token_products(const v16 (&q)[R][NV], const float* qsum, int groups, const int* gidx,
                              const uint8_t* bytes, const float* scale, const float* minimum, v16* prod, float* bias) {
    v16 cf[NV];
    unpack_vectors<BITS, NV>(bytes, cf, scale, gidx);
    for (int r = 0; r < R; ++r) {
        v16 a = q[r][0] * cf[0];
        for (int k = 1; k < NV; ++k) a += q[r][k] * cf[k];
        prod[r] = a;
        float b = 0.f;
        for (int g = 0; g < groups; ++g) b += minimum[g] * qsum[r * groups + g];
        bias[r] = b;
    }
}

// Scores of R rows (qperm: in split order; qsum [R, groups]: their sums per channel group) against
// per-token coded keys [first, last), 16 tokens' sums at a time; gidx as for vector_groups.
template <int BITS, int NV, int R>
KV_INLINE void token_scores_fast(const float* qperm, const float* qsum, int groups, const int* gidx,
                                 const uint8_t* codes, const float* scale, const float* minimum, int first, int last,
                                 float* out, int64_t out_row) {
    constexpr int dim = NV * 16, packed = dim * BITS / 8;
    v16 q[R][NV];
    for (int r = 0; r < R; ++r)
        for (int k = 0; k < NV; ++k) q[r][k] = load16(qperm + r * dim + 16 * k);
    v16 prod[R];
    float bias[R];
    int64_t t = first;
    for (; t + 16 <= last; t += 16) {
        v16 partial[R][16], biases[R];
        for (int i = 0; i < 16; ++i) {
            const int64_t u = t + i;
            token_products<BITS, NV, R>(q, qsum, groups, gidx, codes + u * packed, scale + u * groups,
                                        minimum + u * groups, prod, bias);
            for (int r = 0; r < R; ++r) partial[r][i] = prod[r], biases[r][i] = bias[r];
        }
        for (int r = 0; r < R; ++r) {
            const v16 sums = sums16(partial[r]) + biases[r];
            std::memcpy(out + r * out_row + t, &sums, sizeof sums);
        }
    }
    for (; t < last; ++t) {
        token_products<BITS, NV, R>(q, qsum, groups, gidx, codes + t * packed, scale + t * groups, minimum + t * groups,
                                    prod, bias);
        for (int r = 0; r < R; ++r) out[r * out_row + t] = hsum16(prod[r]) + bias[r];
    }
}

// Weighted values of tokens [first, last) for R rows, added into acc [R, dim] (split order) and
// zacc [R, groups]; gidx as for vector_groups. Columns in blocks of CV register-wide vectors (vw):
// R x CV sums stay in registers while the tokens stream by, each token's codes of the block
// widened in registers (a block lies in one chunk of the split order: CV * kW divides n).
template <int BITS, int NV, int R>
KV_INLINE void weighted_fast(const float* p, int64_t p_row, int groups, const int* gidx, const uint8_t* codes,
                             const float* scale, const float* minimum, int64_t first, int64_t last, float* acc,
                             float* zacc) {
    constexpr int dim = NV * 16, n = dim * BITS / 8, CV = std::min(4, n / kW);
    for (int r = 0; r < R; ++r)  // the minimums' share: one sum a row and group
        for (int g = 0; g < groups; ++g) {
            const float* __restrict pr = p + r * p_row;
            float z = 0.f;
#pragma omp simd reduction(+ : z)
            for (int64_t t = first; t < last; ++t) z += pr[t] * minimum[t * groups + g];
            zacc[r * groups + g] += z;
        }
    for (int c = 0; c < dim; c += CV * kW) {
        const int byte = c % n, shift = BITS * (c / n);
        int g[CV];  // each vector's value group
        for (int i = 0; i < CV; ++i) g[i] = gidx[(c + kW * i) / 16];
        vw a[R][CV];
        for (int r = 0; r < R; ++r)
            for (int i = 0; i < CV; ++i) a[r][i] = loadw(acc + r * dim + c + kW * i);
        if (groups == 1) {  // one scale a token: it folds into the rows' weights
            for (int64_t t = first; t < last; ++t) {
                float w[R];
                bool any = false;
                for (int r = 0; r < R; ++r) {
                    w[r] = p[r * p_row + t] * (scale[t] * kCodeUnit);
                    any |= w[r] != 0.f;
                }
                if (!any) continue;  // masked keys (padding) cost no arithmetic
                const uint8_t* bytes = codes + t * n + byte;
                vw x[CV];
                for (int i = 0; i < CV; ++i) x[i] = codes_w<BITS>(bytes + kW * i, shift);
                for (int r = 0; r < R; ++r)
                    for (int i = 0; i < CV; ++i) a[r][i] += w[r] * x[i];
            }
        } else {
            for (int64_t t = first; t < last; ++t) {
                float w[R];
                bool any = false;
                for (int r = 0; r < R; ++r) {
                    w[r] = p[r * p_row + t];
                    any |= w[r] != 0.f;
                }
                if (!any) continue;
                const uint8_t* bytes = codes + t * n + byte;
                const float* s = scale + t * groups;
                vw x[CV];
                for (int i = 0; i < CV; ++i) x[i] = codes_w<BITS>(bytes + kW * i, shift) * (s[g[i]] * kCodeUnit);
                for (int r = 0; r < R; ++r)
                    for (int i = 0; i < CV; ++i) a[r][i] += w[r] * x[i];
            }
        }
        for (int r = 0; r < R; ++r)
            for (int i = 0; i < CV; ++i) __builtin_memcpy(acc + r * dim + c + kW * i, &a[r][i], sizeof(vw));
    }
}

#if defined(KV_INT_DOTS)
// A value weight rounded to 16 bits (|x| <= 32767 after scaling).
KV_INLINE int32_t round_word(float x) { return static_cast<int32_t>(x >= 0.f ? x + 0.5f : x - 0.5f); }

// weighted_fast by integer dot products, for values with one scale a token: per span of up to
// kSpan tokens, each row's weights times the tokens' scales are rounded to 16 bits against the row's
// largest w (a weight moves by at most w / 65534); two tokens' codes are widened to 16 bits and
// interleaved channel by channel (interleave_lo/hi), so one dot_pairs adds both tokens' terms. The
// sums are exact in 32 bits (128 * 32767 * 256 < 2^31) and go into acc in float every 256 tokens.
// A lo vector's lane m holds split position c + 8 (m / 4) + m % 4 of its chunk, a hi's 4 more.
template <int BITS, int NE, int R>
KV_INLINE void weighted_words(const float* p, int64_t p_row, const uint8_t* codes, const float* scale,
                              const float* minimum, int64_t first, int64_t last, float* acc, float* zacc) {
    constexpr int dim = NE * kWords, n = dim * BITS / 8;
    constexpr int64_t kSpan = 256;
#if defined(__AVX512F__)
    constexpr int CW = NE < 2 ? NE : 2;  // chunks of kWords channels summed together
#else
    constexpr int CW = 1;  // 16 registers: R x 2 sums a chunk, the codes and the weights
#endif
    for (int r = 0; r < R; ++r) {  // the minimums' share
        const float* __restrict pr = p + r * p_row;
        float z = 0.f;
#pragma omp simd reduction(+ : z)
        for (int64_t t = first; t < last; ++t) z += pr[t] * (minimum[t] + kMid<BITS> * scale[t]);
        zacc[r] += z;
    }
    for (int64_t s0 = first; s0 < last; s0 += kSpan) {
        const int64_t s1 = std::min(last, s0 + kSpan);
        const int pairs = static_cast<int>((s1 - s0 + 1) / 2);
        const int count = static_cast<int>(s1 - s0);
        alignas(64) float ws[kSpan];
        alignas(64) int16_t w16[R][kSpan + kW];  // token t's weight at t - s0, then zeros (a pair's missing half)
        int32_t wp[R][kSpan / 2];
        float back[R];
        for (int r = 0; r < R; ++r) {
            const float* pr = p + r * p_row + s0;
            const float* sc = scale + s0;
            vw top{};
            int i = 0;
            for (; i + kW <= count; i += kW) {
                const vw x = loadw(pr + i) * loadw(sc + i);
                __builtin_memcpy(ws + i, &x, sizeof x);
                const vw mag = x < 0.f ? -x : x;
                top = mag > top ? mag : top;
            }
            float m = 0.f;
            for (int l = 0; l < kW; ++l) m = std::max(m, top[l]);
            for (; i < count; ++i) ws[i] = pr[i] * sc[i], m = std::max(m, std::fabs(ws[i]));
            const float up = m > 0.f ? 32767.f / m : 0.f;
            back[r] = m / 32767.f;
            for (i = 0; i + kW <= count; i += kW) {
                const vw x = loadw(ws + i) * up;
                const iw whole = __builtin_convertvector(x + (x < 0.f ? vw{} - 0.5f : vw{} + 0.5f), iw);
                for (int l = 0; l < kW; ++l) w16[r][i + l] = static_cast<int16_t>(whole[l]);
            }
            for (; i < count; ++i) w16[r][i] = static_cast<int16_t>(round_word(ws[i] * up));
            w16[r][count] = 0;
            __builtin_memcpy(wp[r], w16[r], sizeof(int32_t) * pairs);
        }
        for (int c = 0; c < dim; c += CW * kWords) {
            iw lo[R][CW] = {}, hi[R][CW] = {};
            for (int i = 0; i < pairs; ++i) {
                bool any = false;
                for (int r = 0; r < R; ++r) any |= wp[r][i] != 0;
                if (!any) continue;  // masked keys (padding) cost no arithmetic
                const int64_t t0 = s0 + 2 * i, t1 = std::min(t0 + 1, s1 - 1);  // an odd last token pairs with itself, weight 0
                if (c == 0) __builtin_prefetch(codes + (t0 + kAhead) * n);
                for (int j = 0; j < CW; ++j) {
                    const int at = c + kWords * j, byte = at % n, shift = BITS * (at / n);
                    const ww a = words_w<BITS>(codes + t0 * n + byte, shift) - kMid<BITS>;
                    const ww b = words_w<BITS>(codes + t1 * n + byte, shift) - kMid<BITS>;
                    const ww pl = interleave_lo(a, b), ph = interleave_hi(a, b);
                    for (int r = 0; r < R; ++r) {
                        const ww w = pair_words(wp[r][i]);
                        lo[r][j] = dot_pairs(lo[r][j], pl, w);
                        hi[r][j] = dot_pairs(hi[r][j], ph, w);
                    }
                }
            }
            for (int r = 0; r < R; ++r)
                for (int j = 0; j < CW; ++j) {
                    float* a = acc + r * dim + c + kWords * j;
                    for (int m = 0; m < kW; ++m) {
                        const int at = 8 * (m / 4) + m % 4;
                        a[at] += static_cast<float>(lo[r][j][m]) * back[r];
                        a[at + 4] += static_cast<float>(hi[r][j][m]) * back[r];
                    }
                }
        }
    }
}
#endif

// fn(std::integral_constant<int, R>{}, r0) for the rows [r0, r0 + R) of a call: runs of kRowsTogether
// rows, then the 3, 2 or 1 left, so each fast path keeps a compile-time number of rows in registers.
template <int MOST = kRowsTogether, class Fn>
KV_INLINE void in_row_runs(int rows, Fn&& fn) {
    for (int r0 = 0; r0 < rows;) {
        const int left = rows - r0;
        if (left >= MOST) fn(std::integral_constant<int, MOST>{}, r0), r0 += MOST;
        else if (left == 3) fn(std::integral_constant<int, 3>{}, r0), r0 += 3;
        else if (left == 2) fn(std::integral_constant<int, 2>{}, r0), r0 += 2;
        else fn(std::integral_constant<int, 1>{}, r0), r0 += 1;
    }
}

template <int BITS, int NV>
KV_INLINE void key_scores_rows(const float* q, int rows, int group, const uint8_t* codes, const float* scale,
                               const float* minimum, int first, int last, float* out, int64_t out_row) {
    constexpr int dim = NV * 16;
    alignas(64) float qperm[kMaxRows * dim];
    split_rows<BITS>(q, rows, dim, qperm);
#if defined(KV_INT_DOTS)
    if constexpr (dim * BITS / 8 % kWords == 0) {
        in_row_runs<4>(rows, [&](auto R, int r0) __attribute__((always_inline)) {
            key_scores_words<BITS, dim / kWords, decltype(R)::value>(qperm + r0 * dim, q + r0 * dim, group, codes, scale,
                                                                     minimum, first, last, out + r0 * out_row, out_row);
        });
        return;
    }
#endif
    in_row_runs(rows, [&](auto R, int r0) __attribute__((always_inline)) {
        key_scores_fast<BITS, NV, decltype(R)::value>(qperm + r0 * dim, q + r0 * dim, group, codes, scale, minimum,
                                                      first, last, out + r0 * out_row, out_row);
    });
}

template <int BITS, int NV>
KV_INLINE void token_scores_rows(const float* q, int rows, int group, const uint8_t* codes, const float* scale,
                                 const float* minimum, int first, int last, float* out, int64_t out_row) {
    constexpr int dim = NV * 16;
    const int groups = dim / group;
    alignas(64) float qperm[kMaxRows * dim];
    float qsum[kMaxRows * dim];
    int gidx[NV];
    split_rows<BITS>(q, rows, dim, qperm);
    group_sums(q, rows, dim, group, qsum);
#if defined(KV_INT_DOTS)
    if constexpr (dim * BITS / 8 % kWords == 0) {
        if (groups == 1) {
            in_row_runs<4>(rows, [&](auto R, int r0) __attribute__((always_inline)) {
                token_scores_words<BITS, dim / kWords, decltype(R)::value>(qperm + r0 * dim, qsum + r0, codes, scale,
                                                                           minimum, first, last, out + r0 * out_row, out_row);
            });
            return;
        }
    }
#endif
    vector_groups<BITS, NV>(group, gidx);
    in_row_runs(rows, [&](auto R, int r0) __attribute__((always_inline)) {
        token_scores_fast<BITS, NV, decltype(R)::value>(qperm + r0 * dim, qsum + r0 * groups, groups, gidx, codes,
                                                        scale, minimum, first, last, out + r0 * out_row, out_row);
    });
}

template <int BITS, int NV>
KV_INLINE void weighted_rows(const float* p, int64_t p_row, int rows, int vgroup, const uint8_t* codes,
                             const float* scale, const float* minimum, int64_t first, int64_t last, float* acc,
                             float* zacc) {
    constexpr int dim = NV * 16;
    const int groups = dim / vgroup;
    int gidx[NV];
#if defined(KV_INT_DOTS)
    if constexpr (dim * BITS / 8 % kWords == 0) {
        if (groups == 1) {
            in_row_runs<4>(rows, [&](auto R, int r0) __attribute__((always_inline)) {
                weighted_words<BITS, dim / kWords, decltype(R)::value>(p + r0 * p_row, p_row, codes, scale, minimum,
                                                                       first, last, acc + r0 * dim, zacc + r0);
            });
            return;
        }
    }
#endif
    vector_groups<BITS, NV>(vgroup, gidx);
    in_row_runs(rows, [&](auto R, int r0) __attribute__((always_inline)) {
        weighted_fast<BITS, NV, decltype(R)::value>(p + r0 * p_row, p_row, groups, gidx, codes, scale, minimum, first,
                                                    last, acc + r0 * dim, zacc + r0 * groups);
    });
}

// Each width's entry, built for the instruction set of -march (KVCACHE_ISA caps it): the fast
// paths for head dims 64 and 128 (per-token groups a multiple of 16 bytes), the plain loops otherwise.
// token_scores_* are the scores of keys coded per token (first, last: tokens).
#define KV_WRAP(BITS)                                                                            \
    void key_scores_##BITS(const float* q, int rows, int dim, int group, const uint8_t* codes,   \
                           const float* scale, const float* minimum, int first, int last,        \
                           float* out, int64_t out_row) {                                        \
        if (dim == 64) key_scores_rows<BITS, 4>(q, rows, group, codes, scale, minimum, first, last, out, out_row); \
        else if (dim == 128) key_scores_rows<BITS, 8>(q, rows, group, codes, scale, minimum, first, last, out, out_row); \
        else key_scores_run<BITS>(q, rows, dim, group, codes, scale, minimum, first, last, out, out_row); \
    }                                                                                            \
    void weighted_##BITS(const float* p, int64_t p_row, int rows, int dim, int vgroup,           \
                         const uint8_t* codes, const float* scale, const float* minimum,         \
                         int64_t first, int64_t last, float* acc, float* zacc) {                 \
        const bool whole = (vgroup / (8 / BITS)) % 16 == 0;                                      \
        if (dim == 64 && whole) weighted_rows<BITS, 4>(p, p_row, rows, vgroup, codes, scale, minimum, first, last, acc, zacc); \
        else if (dim == 128 && whole) weighted_rows<BITS, 8>(p, p_row, rows, vgroup, codes, scale, minimum, first, last, acc, zacc); \
        else weighted_run<BITS>(p, p_row, rows, dim, vgroup, codes, scale, minimum, first, last, acc, zacc); \
    }                                                                                            \
    void token_scores_##BITS(const float* q, int rows, int dim, int group, const uint8_t* codes, \
                             const float* scale, const float* minimum, int first, int last,      \
                             float* out, int64_t out_row) {                                      \
        const bool whole = (group / (8 / BITS)) % 16 == 0;                                       \
        if (dim == 64 && whole) token_scores_rows<BITS, 4>(q, rows, group, codes, scale, minimum, first, last, out, out_row); \
        else if (dim == 128 && whole) token_scores_rows<BITS, 8>(q, rows, group, codes, scale, minimum, first, last, out, out_row); \
        else token_scores_run<BITS>(q, rows, dim, group, codes, scale, minimum, first, last, out, out_row); \
    }
KV_WRAP(8)
#if !defined(KV_FP8)
KV_WRAP(4)
KV_WRAP(2)
#endif

// ---- the whole decode step in one pass ("flash decoding"): per (batch row, KV head, chunk of key
// blocks) task, a tile of blocks is scored with the helpers above, folded into a running softmax
// per query row, and its values summed with the same weights; the chunks of each (batch, head) are
// merged at the end. The scores never leave a small per-thread buffer.

constexpr int64_t kTileTokens = 512;  // tokens scored before their values are summed (rows x 512 scores: L1/L2)

using ScoresFn = void (*)(const float*, int, int, int, const uint8_t*, const float*, const float*, int, int, float*,
                          int64_t);
using WeightedFn = void (*)(const float*, int64_t, int, int, int, const uint8_t*, const float*, const float*,
                            int64_t, int64_t, float*, float*);

struct CodedKernels {
    ScoresFn scores;        // keys per channel
    WeightedFn weighted;    // values per token
    ScoresFn token_scores;  // keys per token
};

CodedKernels kernels_for(int bits) {
#if defined(KV_FP8)
    (void)bits;  // the entry points check bits == 8
    return {key_scores_8, weighted_8, token_scores_8};
#else
    if (bits == 8) return {key_scores_8, weighted_8, token_scores_8};
    if (bits == 4) return {key_scores_4, weighted_4, token_scores_4};
    return {key_scores_2, weighted_2, token_scores_2};
#endif
}

// How a call's keys are coded, for the one pass: `scores` is handed `group` and a key block's codes,
// scales and minimums, each block having scale_floats of them. Per channel over blocks of G tokens:
// (scores, G, D); per token in groups of Gk channels, a "block" being one token: (token_scores, Gk, D / Gk).
struct KeyLayout {
    ScoresFn scores;
    int group;
    int64_t scale_floats;
};

// Sizes of one call. Key codes take kpacked bytes a token, value codes vpacked; values have
// vgroups (scale, minimum) pairs a token; a key block has `group` tokens (1 for per-token keys).
struct Dims {
    int rows, dim, vdim, group, vgroup, bits;
    int64_t kpacked, vpacked, vgroups;
};

// One (batch row, KV head)'s codes, scales and minimums.
struct HeadCodes {
    const uint8_t* kcodes;
    const float* kscale;
    const float* kmin;
    const uint8_t* vcodes;
    const float* vscale;
    const float* vmin;
};

// A chunk's running softmax, per query row: the largest score so far, the sum of exp(score - max),
// and the weighted values relative to that max, split as the value helpers leave them: acc [rows, vdim]
// in split channel order and zacc [rows, vgroups] (the minimums' share).
struct ChunkState {
    float* max;
    float* sum;
    float* acc;
    float* zacc;

    static int64_t floats(const Dims& d) { return d.rows * (2 + d.vdim + d.vgroups); }

    static ChunkState at(float* base, const Dims& d) {
        return {base, base + d.rows, base + 2 * d.rows, base + 2 * d.rows + static_cast<int64_t>(d.rows) * d.vdim};
    }

    void clear(const Dims& d) {
        for (int r = 0; r < d.rows; ++r) {
            max[r] = -INFINITY;
            sum[r] = 0.f;
        }
        std::memset(acc, 0, sizeof(float) * d.rows * d.vdim);
        std::memset(zacc, 0, sizeof(float) * d.rows * d.vgroups);
    }
};

// The tokens after the coded key blocks of one (batch, head): keys exact (float32 rows k_t floats
// apart); the first `vcoded` of them have coded values (value codes from token `from` on), the rest
// exact values (float32 rows v_t floats apart). A layer codes its values before its keys, so this
// is its usual tail: the keys of the last partial block and its exact residual.
struct ExactTail {
    const float* keys;
    int64_t k_t;
    const float* values;
    int64_t v_t;
    int64_t from, len, vcoded;
};

// softcap * tanh(score / softcap) over the first n scores of each row (row stride width).
inline void cap_scores(float* scores, int rows, int64_t width, int n, float softcap) {
    for (int r = 0; r < rows; ++r) {
        float* s = scores + r * width;
        for (int j = 0; j < n; ++j) s[j] = softcap * std::tanh(s[j] / softcap);
    }
}

// Fold a tile's scores (rows x n, row stride width) into the running softmax: a row whose maximum
// rises rescales what it has summed, and its scores become their weights exp(score - max).
inline void online_softmax_tile(float* scores, int64_t width, int n, const Dims& d, ChunkState& st) {
    for (int r = 0; r < d.rows; ++r) {
        float* __restrict s = scores + r * width;
        float m = st.max[r];
#pragma omp simd reduction(max : m)
        for (int j = 0; j < n; ++j) m = s[j] > m ? s[j] : m;
        if (m > st.max[r]) {
            const float c = std::exp(st.max[r] - m);  // 0 on the first tile (max -inf, nothing summed)
            st.sum[r] *= c;
            float* __restrict a = st.acc + static_cast<int64_t>(r) * d.vdim;
#pragma omp simd
            for (int i = 0; i < d.vdim; ++i) a[i] *= c;
            for (int g = 0; g < d.vgroups; ++g) st.zacc[r * d.vgroups + g] *= c;
            st.max[r] = m;
        }
        st.sum[r] += exp_and_sum(s, n, m);
    }
}

// Key blocks [first, last) of one (batch, head), or of one (sequence, head)'s block table, tile_blocks
// at a time, folded into st. score(blk, blocks, out, width) writes the scores of blocks [blk, blk + blocks)
// into out (row stride width); weigh(blk, blocks, p, width) adds their values, weighted by p, into st.
template <class Score, class Weigh>
KV_INLINE void attend_tiles(const Dims& d, int64_t first, int64_t last, int64_t tile_blocks, float softcap,
                            float* scores, ChunkState& st, Score score, Weigh weigh) {
    const int64_t width = tile_blocks * d.group;
    for (int64_t blk = first; blk < last; blk += tile_blocks) {
        const int blocks = static_cast<int>(std::min(tile_blocks, last - blk));
        const int n = blocks * d.group;
        score(blk, blocks, scores, width);
        if (softcap > 0.f) cap_scores(scores, d.rows, width, n, softcap);
        online_softmax_tile(scores, width, n, d, st);
        weigh(blk, blocks, scores, width);
    }
}

// Key blocks [first_block, last_block) of one (batch, head), coded as `keys` says, tile_blocks at a
// time, into st. q: the rows already scaled; scores: a buffer of rows x (tile_blocks * group) floats.
void attend_chunk(const CodedKernels& kern, const KeyLayout& keys, const float* q, const HeadCodes& h, const Dims& d,
                  int64_t first_block, int64_t last_block, int64_t tile_blocks, float softcap, float* scores,
                  ChunkState& st) {
    attend_tiles(
        d, first_block, last_block, tile_blocks, softcap, scores, st,
        [&](int64_t blk, int blocks, float* out, int64_t width) {
            const int64_t s0 = blk * keys.scale_floats;
            keys.scores(q, d.rows, d.dim, keys.group, h.kcodes + blk * d.group * d.kpacked, h.kscale + s0, h.kmin + s0,
                        0, blocks, out, width);
        },
        [&](int64_t blk, int blocks, const float* p, int64_t width) {
            const int64_t t0 = blk * d.group;
            kern.weighted(p, width, d.rows, d.vdim, d.vgroup, h.vcodes + t0 * d.vpacked, h.vscale + t0 * d.vgroups,
                          h.vmin + t0 * d.vgroups, 0, blocks * d.group, st.acc, st.zacc);
        });
}

// Coded keys and values [N, Hkv, ...], inner dims contiguous, with strides in elements for the first
// dim and the head (scale and minimum share theirs): a batch's rows (the one pass over a store), or a
// pool of coded blocks (kvcache.engine.paged): keys codes [NB, Hkv, G, D'], scale / minimum
// [NB, Hkv, D]; values codes [NB, Hkv, G, Dv'], scale / minimum [NB, Hkv, G, Dv / Gv].
struct CodedTensors {
    const uint8_t* kcodes;
    const float* kscale;
    const float* kmin;
    const uint8_t* vcodes;
    const float* vscale;
    const float* vmin;
    int64_t kcodes_blk, kcodes_h, kscale_blk, kscale_h, vcodes_blk, vcodes_h, vscale_blk, vscale_h;

    HeadCodes at(int64_t id, int64_t h) const {
        const int64_t k = id * kscale_blk + h * kscale_h, v = id * vscale_blk + h * vscale_h;
        return {kcodes + id * kcodes_blk + h * kcodes_h, kscale + k, kmin + k,
                vcodes + id * vcodes_blk + h * vcodes_h, vscale + v, vmin + v};
    }
};

// Table entries [first, last) of one (sequence, head) (table: the sequence's block ids), as attend_chunk;
// the blocks lie anywhere in the pool, so each is scored and weighted on its own.
void attend_paged(const CodedKernels& kern, const float* q, const CodedTensors& pool, const int32_t* table, int64_t h,
                  const Dims& d, int64_t first, int64_t last, int64_t tile_blocks, float softcap, float* scores,
                  ChunkState& st) {
    attend_tiles(
        d, first, last, tile_blocks, softcap, scores, st,
        [&](int64_t blk, int blocks, float* out, int64_t width) {
            for (int i = 0; i < blocks; ++i) {
                const HeadCodes b = pool.at(table[blk + i], h);
                kern.scores(q, d.rows, d.dim, d.group, b.kcodes, b.kscale, b.kmin, 0, 1, out + i * d.group, width);
            }
        },
        [&](int64_t blk, int blocks, const float* p, int64_t width) {
            for (int i = 0; i < blocks; ++i) {
                const HeadCodes b = pool.at(table[blk + i], h);
                kern.weighted(p + i * d.group, width, d.rows, d.vdim, d.vgroup, b.vcodes, b.vscale, b.vmin, 0, d.group,
                              st.acc, st.zacc);
            }
        });
}

// The exact tail (see ExactTail) folded into st, a tile of `width` tokens at a time.
void attend_tail(const CodedKernels& kern, const float* q, const HeadCodes& h, const ExactTail& tail, const Dims& d,
                 int64_t width, float softcap, float* scores, ChunkState& st) {
    const int per_byte = 8 / d.bits;
    float v_split[kMaxDim];
    for (int64_t t0 = 0; t0 < tail.len; t0 += width) {
        const int n = static_cast<int>(std::min(width, tail.len - t0));
        for (int r = 0; r < d.rows; ++r) {
            const float* __restrict qr = q + static_cast<int64_t>(r) * d.dim;
            for (int j = 0; j < n; ++j) {
                const float* __restrict k = tail.keys + (t0 + j) * tail.k_t;
                float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                for (int i = 0; i < d.dim; ++i) dot += qr[i] * k[i];
                scores[r * width + j] = dot;
            }
        }
        if (softcap > 0.f) cap_scores(scores, d.rows, width, n, softcap);
        online_softmax_tile(scores, width, n, d, st);
        const int64_t coded_end = std::min<int64_t>(t0 + n, tail.vcoded);
        if (coded_end > t0) {
            const int64_t tok = tail.from + t0;
            kern.weighted(scores, width, d.rows, d.vdim, d.vgroup, h.vcodes + tok * d.vpacked, h.vscale + tok * d.vgroups,
                          h.vmin + tok * d.vgroups, 0, coded_end - t0, st.acc, st.zacc);
        }
        for (int64_t t = std::max(t0, tail.vcoded); t < t0 + n; ++t) {
            const float* __restrict v = tail.values + (t - tail.vcoded) * tail.v_t;
            const float* __restrict vs = v;  // the value in split order, as the accumulators hold it
            if (per_byte > 1) {
                to_split(v, d.vdim, per_byte, v_split);
                vs = v_split;
            }
            for (int r = 0; r < d.rows; ++r) {
                const float p = scores[r * width + (t - t0)];
                float* __restrict a = st.acc + static_cast<int64_t>(r) * d.vdim;
#pragma omp simd
                for (int e = 0; e < d.vdim; ++e) a[e] += p * vs[e];
            }
        }
    }
}

// One (batch, head)'s chunks merged into its normalised output out [rows, vdim] (channels back in
// order) and each row's log-sum-exp lse [rows].
void merge_chunks(float* states, int64_t chunks, const Dims& d, float* out, float* lse) {
    const int64_t part = ChunkState::floats(d);
    const int per_byte = 8 / d.bits, n = d.vdim / per_byte;
    for (int r = 0; r < d.rows; ++r) {
        float top = -INFINITY;
        for (int64_t c = 0; c < chunks; ++c) {
            const ChunkState st = ChunkState::at(states + c * part, d);
            if (st.sum[r] > 0.f && st.max[r] > top) top = st.max[r];
        }
        float* o = out + static_cast<int64_t>(r) * d.vdim;
        std::memset(o, 0, sizeof(float) * d.vdim);
        float total = 0.f;
        for (int64_t c = 0; c < chunks; ++c) {
            const ChunkState st = ChunkState::at(states + c * part, d);
            if (!(st.sum[r] > 0.f)) continue;
            const float w = std::exp(st.max[r] - top);
            total += w * st.sum[r];
            const float* a = st.acc + static_cast<int64_t>(r) * d.vdim;
            const float* z = st.zacc + static_cast<int64_t>(r) * d.vgroups;
            for (int i = 0; i < d.vdim; ++i) o[i] += w * (a[(i % per_byte) * n + i / per_byte] + z[i / d.vgroup]);
        }
        const float inv = total > 0.f ? 1.f / total : 0.f;
        for (int i = 0; i < d.vdim; ++i) o[i] *= inv;
        lse[r] = total > 0.f ? top + std::log(total) : -INFINITY;
    }
}

// The code widths this build reads: 8, 4 and 2 bits; the fp8 build (KV_FP8) bytes only.
bool width_ok(int bits) {
#if defined(KV_FP8)
    return bits == 8;
#else
    return bits == 8 || bits == 4 || bits == 2;
#endif
}

// Whether the library takes a one-pass decode of these sizes (per-token values in groups of vgroup).
bool decode_sizes_ok(int rows, int dim, int vdim, int vgroup, int bits) {
    if (!width_ok(bits)) return false;
    const int per_byte = 8 / bits;
    return rows >= 1 && rows <= kMaxRows && dim >= 1 && dim <= kMaxDim && vdim >= 1 && vdim <= kMaxDim &&
           dim % per_byte == 0 && vgroup >= 1 && vdim % vgroup == 0 && vgroup % per_byte == 0;
}

// Whether keys of dim channels coded per token in groups of `group` have sizes the library takes.
bool token_keys_ok(int dim, int group, int bits) {
    return width_ok(bits) && dim >= 1 && dim <= kMaxDim && group >= 1 && dim % group == 0 &&
           group % (8 / bits) == 0;
}

// Scores of every (batch row, KV head)'s rows of q (float32 contiguous [B, H, rows, D]) against its
// `units` key blocks (per-channel keys: scores = key_scores_*) or tokens (per-token keys:
// token_scores_*), in tasks of `chunk` units spread over the threads.
void scores_in_chunks(ScoresFn scores, const float* q, const uint8_t* codes, const float* scale, const float* minimum,
                      float* out, int64_t batch, int64_t heads, int rows, int dim, int group, int64_t units,
                      int64_t codes_b, int64_t codes_h, int64_t scale_b, int64_t scale_h, int64_t out_b, int64_t out_h,
                      int64_t out_row, int64_t chunk, int threads) {
    const int64_t chunks = (units + chunk - 1) / chunk, tasks = batch * heads * chunks;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t task = 0; task < tasks; ++task) {
        const int64_t bh = task / chunks, c = task % chunks, b = bh / heads, h = bh % heads;
        const int first = static_cast<int>(c * chunk), last = static_cast<int>(std::min(units, c * chunk + chunk));
        const int64_t sh = b * scale_b + h * scale_h;
        scores(q + bh * rows * dim, rows, dim, group, codes + b * codes_b + h * codes_h, scale + sh, minimum + sh, first,
               last, out + b * out_b + h * out_h, out_row);
    }
}

// The frame of a one-pass decode: `chunks` tasks per (batch row, KV head), each folding its share of
// the keys into a ChunkState of its own through work(b, h, chunk, q, scores, st) (q: the head's rows
// already scaled; scores: a per-thread buffer of score_floats), then each head's chunks merged into
// out [B, H, rows, vdim] and lse [B, H, rows] (q float32 contiguous [B, H, rows, dim]).
template <class Work>
void decode_in_chunks(const float* q, float scale, int64_t batch, int64_t heads, int64_t chunks, const Dims& d,
                      int64_t score_floats, int threads, float* out, float* lse, Work work) {
    const int64_t tasks = batch * heads * chunks, part = ChunkState::floats(d);
    const int64_t q_rows = static_cast<int64_t>(d.rows) * d.dim;
    std::vector<float> states(static_cast<size_t>(tasks * part));
    // The scaled queries are few floats: made before the parallel region, so the region has one
    // barrier (tasks, then the merge) -- each barrier can cost a scheduler quantum on a busy machine.
    std::vector<float> scaled(static_cast<size_t>(batch * heads * q_rows));
    for (int64_t i = 0; i < batch * heads * q_rows; ++i) scaled[i] = q[i] * scale;
#pragma omp parallel num_threads(threads)
    {
        std::vector<float> scores(static_cast<size_t>(score_floats));
#pragma omp for schedule(static)
        for (int64_t task = 0; task < tasks; ++task) {
            const int64_t bh = task / chunks;
            ChunkState st = ChunkState::at(states.data() + task * part, d);
            st.clear(d);
            work(bh / heads, bh % heads, task % chunks, scaled.data() + bh * q_rows, scores.data(), st);
        }
#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < batch * heads; ++bh)
            merge_chunks(states.data() + bh * chunks * part, chunks, d, out + bh * d.rows * d.vdim, lse + bh * d.rows);
    }
}

}  // namespace

extern "C" {

// scores[b, h, r, blk * G + t] = q[b, h, r] . key(b, h, blk * G + t) for blocks [0, nblk).
// q float32 contiguous [B, H, rows, D]; out float32 with the given strides (row stride out_row).
int kv_coded_key_scores(const float* q, const uint8_t* codes, const float* scale, const float* minimum, float* out,
                        int64_t batch, int64_t heads, int rows, int dim, int group, int bits, int64_t nblk,
                        int64_t codes_b, int64_t codes_h, int64_t scale_b, int64_t scale_h, int64_t out_b,
                        int64_t out_h, int64_t out_row, int64_t chunk_blocks, int threads) {
    if (!width_ok(bits) || rows < 1 || rows > kMaxRows || dim < 1 || dim > kMaxDim || dim % (8 / bits)) return 1;
    scores_in_chunks(kernels_for(bits).scores, q, codes, scale, minimum, out, batch, heads, rows, dim, group, nblk,
                     codes_b, codes_h, scale_b, scale_h, out_b, out_h, out_row, chunk_blocks, threads);
    return 0;
}

// scores[b, h, r, t] = q[b, h, r] . key(b, h, t) for tokens [0, tokens), keys coded per token in
// groups of `group` channels: codes [B, H, T, D'], scale / minimum float32 [B, H, T, D / group] (inner
// dims contiguous). q float32 contiguous [B, H, rows, D]; out float32 with the given strides.
int kv_token_coded_key_scores(const float* q, const uint8_t* codes, const float* scale, const float* minimum,
                              float* out, int64_t batch, int64_t heads, int rows, int dim, int group, int bits,
                              int64_t tokens, int64_t codes_b, int64_t codes_h, int64_t scale_b, int64_t scale_h,
                              int64_t out_b, int64_t out_h, int64_t out_row, int64_t chunk_tokens, int threads) {
    if (rows < 1 || rows > kMaxRows || !token_keys_ok(dim, group, bits) || tokens < 0 || chunk_tokens < 1) return 1;
    scores_in_chunks(kernels_for(bits).token_scores, q, codes, scale, minimum, out, batch, heads, rows, dim, group,
                     tokens, codes_b, codes_h, scale_b, scale_h, out_b, out_h, out_row, chunk_tokens, threads);
    return 0;
}

// out[b, h, r] = sum_t p[b, h, r, t] * value(b, h, t) over tokens [0, tokens).
// p float32 with strides (p_b, p_h, p_row, 1); out float32 contiguous [B, H, rows, Dv];
// scratch float32 [B * H * chunks, rows, Dv + Dv / Gv] (chunks = ceil(tokens / chunk_tokens)).
int kv_coded_weighted(const float* p, const uint8_t* codes, const float* scale, const float* minimum, float* out,
                      float* scratch, int64_t batch, int64_t heads, int rows, int dim, int vgroup, int bits,
                      int64_t tokens, int64_t p_b, int64_t p_h, int64_t p_row, int64_t codes_b, int64_t codes_h,
                      int64_t scale_b, int64_t scale_h, int64_t chunk_tokens, int threads) {
    if (!width_ok(bits)) return 1;
    const int per_byte = 8 / bits;
    if (rows < 1 || rows > kMaxRows || dim < 1 || dim > kMaxDim || vgroup < 1 || dim % vgroup ||
        vgroup % per_byte)
        return 1;
    const WeightedFn weighted = kernels_for(bits).weighted;
    const int groups = dim / vgroup, n = dim / per_byte;
    const int64_t chunks = tokens > 0 ? (tokens + chunk_tokens - 1) / chunk_tokens : 1;
    const int64_t tasks = batch * heads * chunks, part = static_cast<int64_t>(rows) * (dim + groups);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t task = 0; task < tasks; ++task) {
        const int64_t bh = task / chunks, c = task % chunks, b = bh / heads, h = bh % heads;
        float* acc = scratch + task * part;
        float* zacc = acc + static_cast<int64_t>(rows) * dim;
        std::memset(acc, 0, sizeof(float) * part);
        const int64_t first = c * chunk_tokens, last = first + chunk_tokens < tokens ? first + chunk_tokens : tokens;
        const float* pb = p + b * p_b + h * p_h;
        const uint8_t* cb = codes + b * codes_b + h * codes_h;
        const float* sb = scale + b * scale_b + h * scale_h;
        const float* zb = minimum + b * scale_b + h * scale_h;
        weighted(pb, p_row, rows, dim, vgroup, cb, sb, zb, first, last, acc, zacc);
    }
    // Sum the chunks, and put the channels back in order: element per_byte * i + j sits at j * n + i.
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t bh = 0; bh < batch * heads; ++bh) {
        for (int r = 0; r < rows; ++r) {
            float* o = out + (bh * rows + r) * dim;
            for (int d = 0; d < dim; ++d) {
                const int pos = (d % per_byte) * n + d / per_byte, g = d / vgroup;
                float sum = 0.f;
                for (int64_t c = 0; c < chunks; ++c) {
                    const float* acc = scratch + (bh * chunks + c) * part;
                    sum += acc[r * dim + pos] + acc[static_cast<int64_t>(rows) * dim + r * groups + g];
                }
                o[d] = sum;
            }
        }
    }
    return 0;
}

// The whole attention of query rows q over the first nblk key blocks (nblk * G tokens, values
// coded as far): out[b, h, r] = sum_t softmax_t(score) value(b, h, t), normalised, and
// lse[b, h, r] = log sum_t exp(score_t), where score = softcap * tanh(scale * q . k / softcap)
// (no cap when softcap <= 0), so that the caller can merge further keys in.
// q float32 contiguous [B, H, rows, D]; out float32 contiguous [B, H, rows, Dv]; lse float32
// contiguous [B, H, rows]. Codes, scales and minimums as for the two functions above (inner dims
// contiguous), each with its own (batch, head) strides. Tasks: (batch, head, chunk_blocks blocks).
// tail_len > 0 adds that many tokens after the coded blocks (ExactTail): exact keys tail_k
// [B, H, tail_len, D] and, after the first tail_vcoded (whose values are coded), exact values
// tail_v [B, H, tail_len - tail_vcoded, Dv], float32 with the given strides (last dim contiguous);
// out and lse then cover them too.
int kv_coded_decode_attention(const float* q, const uint8_t* kcodes, const float* kscale, const float* kmin,
                              const uint8_t* vcodes, const float* vscale, const float* vmin, float* out, float* lse,
                              int64_t batch, int64_t heads, int rows, int dim, int vdim, int group, int vgroup,
                              int bits, int64_t nblk, int64_t kcodes_b, int64_t kcodes_h, int64_t kscale_b,
                              int64_t kscale_h, int64_t vcodes_b, int64_t vcodes_h, int64_t vscale_b,
                              int64_t vscale_h, int64_t chunk_blocks, float scale, float softcap, int threads,
                              const float* tail_k, int64_t tk_b, int64_t tk_h, int64_t tk_t, const float* tail_v,
                              int64_t tv_b, int64_t tv_h, int64_t tv_t, int64_t tail_len, int64_t tail_vcoded) {
    if (!decode_sizes_ok(rows, dim, vdim, vgroup, bits) || group < 1 || nblk < 1 || chunk_blocks < 1) return 1;
    if (tail_len < 0 || tail_vcoded < 0 || tail_vcoded > tail_len || (tail_len > 0 && tail_k == nullptr) ||
        (tail_len > tail_vcoded && tail_v == nullptr))
        return 1;
    const int per_byte = 8 / bits;
    const Dims d{rows, dim, vdim, group, vgroup, bits, dim / per_byte, vdim / per_byte, vdim / vgroup};
    const CodedKernels kern = kernels_for(bits);
    const KeyLayout keys{kern.scores, group, dim};
    const CodedTensors store{kcodes,   kscale,   kmin,     vcodes,   vscale,   vmin,     kcodes_b, kcodes_h,
                             kscale_b, kscale_h, vcodes_b, vcodes_h, vscale_b, vscale_h};
    const int64_t coded_chunks = (nblk + chunk_blocks - 1) / chunk_blocks;
    const int64_t tile_blocks = std::max<int64_t>(1, kTileTokens / group);
    decode_in_chunks(q, scale, batch, heads, coded_chunks + (tail_len > 0 ? 1 : 0), d, rows * tile_blocks * group,
                     threads, out, lse,
                     [&](int64_t b, int64_t h, int64_t c, const float* qs, float* scores, ChunkState& st) {
                         const HeadCodes codes = store.at(b, h);
                         if (c == coded_chunks) {  // the exact tail: one more chunk
                             const ExactTail tail{tail_k + b * tk_b + h * tk_h, tk_t,
                                                  tail_v == nullptr ? nullptr : tail_v + b * tv_b + h * tv_h, tv_t,
                                                  nblk * group, tail_len, tail_vcoded};
                             attend_tail(kern, qs, codes, tail, d, tile_blocks * group, softcap, scores, st);
                             return;
                         }
                         const int64_t first = c * chunk_blocks, last = std::min(nblk, first + chunk_blocks);
                         attend_chunk(kern, keys, qs, codes, d, first, last, tile_blocks, softcap, scores, st);
                     });
    return 0;
}

// The whole attention, as kv_coded_decode_attention (out, lse; scale, softcap), of query rows q over
// the first `tokens` tokens of a store whose keys are coded per token like its values: keys codes
// [B, H, T, D'], scale / minimum float32 [B, H, T, D / group]; values as above. Tasks: (batch, head,
// chunk_tokens tokens).
int kv_token_coded_decode_attention(const float* q, const uint8_t* kcodes, const float* kscale, const float* kmin,
                                    const uint8_t* vcodes, const float* vscale, const float* vmin, float* out,
                                    float* lse, int64_t batch, int64_t heads, int rows, int dim, int vdim, int group,
                                    int vgroup, int bits, int64_t tokens, int64_t kcodes_b, int64_t kcodes_h,
                                    int64_t kscale_b, int64_t kscale_h, int64_t vcodes_b, int64_t vcodes_h,
                                    int64_t vscale_b, int64_t vscale_h, int64_t chunk_tokens, float scale,
                                    float softcap, int threads) {
    if (!decode_sizes_ok(rows, dim, vdim, vgroup, bits) || !token_keys_ok(dim, group, bits) || tokens < 1 ||
        chunk_tokens < 1)
        return 1;
    const int per_byte = 8 / bits;
    const Dims d{rows, dim, vdim, 1, vgroup, bits, dim / per_byte, vdim / per_byte, vdim / vgroup};
    const CodedKernels kern = kernels_for(bits);
    const KeyLayout keys{kern.token_scores, group, dim / group};
    const CodedTensors store{kcodes,   kscale,   kmin,     vcodes,   vscale,   vmin,     kcodes_b, kcodes_h,
                             kscale_b, kscale_h, vcodes_b, vcodes_h, vscale_b, vscale_h};
    decode_in_chunks(q, scale, batch, heads, (tokens + chunk_tokens - 1) / chunk_tokens, d, rows * kTileTokens, threads,
                     out, lse, [&](int64_t b, int64_t h, int64_t c, const float* qs, float* scores, ChunkState& st) {
                         const int64_t first = c * chunk_tokens, last = std::min(tokens, first + chunk_tokens);
                         attend_chunk(kern, keys, qs, store.at(b, h), d, first, last, kTileTokens, softcap, scores, st);
                     });
    return 0;
}

// Paged decode: sequence s attends its first coded[s] tokens from the pool blocks tables[s, 0],
// tables[s, 1], ... (CodedTensors; token t in block tables[s, t / G], slot t % G), then tail_lengths[s]
// exact tokens from block tail_blocks[s] of a float32 pool (keys tail_k [NT, Hkv, G, D], values
// tail_v [NT, Hkv, G, Dv], strides (block, head, token), last dim contiguous). q float32 contiguous
// [S, H, rows, D]; out float32 contiguous [S, H, rows, Dv], normalised (zeros for a sequence with no
// tokens). tables int32 [S, table_stride]; coded, tail_lengths int64 [S]; tail_blocks int32 [S].
// Tasks: (sequence, head, run of blocks_per_task table entries), a sequence's last run taking its tail.
// Returns 1 for shapes the library does not take, 2 for a length, block id or tail out of range
// (nothing is read then).
int kv_paged_coded_decode(const float* q, const uint8_t* kcodes, const float* kscale, const float* kmin,
                          const uint8_t* vcodes, const float* vscale, const float* vmin, const float* tail_k,
                          const float* tail_v, const int32_t* tables, const int64_t* coded, const int32_t* tail_blocks,
                          const int64_t* tail_lengths, float* out, int64_t seqs, int64_t heads, int rows, int dim,
                          int vdim, int group, int vgroup, int bits, int64_t pool_blocks, int64_t tail_pool_blocks,
                          int64_t table_stride, int64_t kcodes_blk, int64_t kcodes_h, int64_t kscale_blk,
                          int64_t kscale_h, int64_t vcodes_blk, int64_t vcodes_h, int64_t vscale_blk, int64_t vscale_h,
                          int64_t tk_blk, int64_t tk_h, int64_t tk_t, int64_t tv_blk, int64_t tv_h, int64_t tv_t,
                          int64_t blocks_per_task, float scale, float softcap, int threads) {
    if (!decode_sizes_ok(rows, dim, vdim, vgroup, bits) || group < 1 || blocks_per_task < 1 || seqs < 0 || heads < 1 ||
        table_stride < 0)
        return 1;
    const int per_byte = 8 / bits;
    // A sequence's first task; every sequence has at least one run per head (its tail, or nothing).
    std::vector<int64_t> first(seqs + 1, 0);
    for (int64_t s = 0; s < seqs; ++s) {
        const int64_t blocks = coded[s] / group, tail = tail_lengths[s];
        if (coded[s] < 0 || coded[s] % group || blocks > table_stride || tail < 0 || tail > group ||
            (tail > 0 && (tail_blocks[s] < 0 || tail_blocks[s] >= tail_pool_blocks)))
            return 2;
        for (int64_t i = 0; i < blocks; ++i)
            if (tables[s * table_stride + i] < 0 || tables[s * table_stride + i] >= pool_blocks) return 2;
        first[s + 1] = first[s] + heads * std::max<int64_t>(1, (blocks + blocks_per_task - 1) / blocks_per_task);
    }
    const Dims d{rows, dim, vdim, group, vgroup, bits, dim / per_byte, vdim / per_byte, vdim / vgroup};
    const CodedKernels kern = kernels_for(bits);
    const CodedTensors pool{kcodes,   kscale,   kmin,     vcodes,     vscale,     vmin,       kcodes_blk, kcodes_h,
                         kscale_blk, kscale_h, vcodes_blk, vcodes_h, vscale_blk, vscale_h};
    const int64_t tasks = first[seqs], tile_blocks = std::max<int64_t>(1, kTileTokens / group);
    const int64_t part = ChunkState::floats(d), q_rows = static_cast<int64_t>(rows) * dim;
    std::unique_ptr<float[]> states(new float[tasks * part]);  // every task clears its own
    std::vector<float> scaled(static_cast<size_t>(seqs * heads * q_rows)), lse(static_cast<size_t>(seqs * heads * rows));
    for (int64_t i = 0; i < seqs * heads * q_rows; ++i) scaled[i] = q[i] * scale;
#pragma omp parallel num_threads(threads)
    {
        std::vector<float> scores(static_cast<size_t>(rows * tile_blocks * group));
        // Dynamic: the runs of sequences of mixed lengths differ (a last run is partial, and takes the tail).
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; ++task) {
            const int64_t s = std::upper_bound(first.begin(), first.end(), task) - first.begin() - 1;
            const int64_t runs = (first[s + 1] - first[s]) / heads, local = task - first[s];
            const int64_t h = local / runs, run = local % runs, sh = s * heads + h;
            ChunkState st = ChunkState::at(states.get() + task * part, d);
            st.clear(d);
            const int64_t blocks = coded[s] / group, lo = run * blocks_per_task;
            attend_paged(kern, scaled.data() + sh * q_rows, pool, tables + s * table_stride, h, d, lo,
                         std::min(blocks, lo + blocks_per_task), tile_blocks, softcap, scores.data(), st);
            if (run == runs - 1 && tail_lengths[s] > 0) {
                const int64_t tb = tail_blocks[s];
                const ExactTail tail{tail_k + tb * tk_blk + h * tk_h, tk_t, tail_v + tb * tv_blk + h * tv_h, tv_t,
                                     0, tail_lengths[s], 0};
                attend_tail(kern, scaled.data() + sh * q_rows, HeadCodes{}, tail, d, tile_blocks * group, softcap,
                            scores.data(), st);
            }
        }
#pragma omp for schedule(static)
        for (int64_t sh = 0; sh < seqs * heads; ++sh) {
            const int64_t s = sh / heads, h = sh % heads, runs = (first[s + 1] - first[s]) / heads;
            merge_chunks(states.get() + (first[s] + h * runs) * part, runs, d, out + sh * rows * vdim,
                         lse.data() + sh * rows);
        }
    }
    return 0;
}

}  // extern "C"
