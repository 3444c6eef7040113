// Decode attention over int8/int4/int2 codes, dequantized in registers (kvcache.attention.fused).
//
// Two plain C entry points, called through ctypes with raw pointers (no Python or torch headers,
// so the library builds in a second or two). Layouts are those of kvcache.layers.codes:
//
//   keys:   codes [B, Hkv, nblk, G, D'] (per channel over blocks of G tokens),
//           scale / minimum float32 [B, Hkv, nblk, D]
//   values: codes [B, Hkv, T, Dv'], scale / minimum float32 [B, Hkv, T, Dv / Gv] (per token)
//
// D' = D * bits / 8: 4- and 2-bit codes are packed lowest bits first, element per_byte * i + j in
// bits [bits * j, bits * (j + 1)) of byte i. Both kernels work in a "split" channel order,
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

#include <cstdint>
#include <cstring>

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define KV_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define KV_CLONES
#endif

namespace {

constexpr int kMaxRows = 16;
constexpr int kMaxDim = 512;

template <int BITS>
inline __attribute__((always_inline)) void unpack_split(const uint8_t* __restrict bytes, int dim, float* __restrict out) {
    constexpr int per_byte = 8 / BITS;
    constexpr int mask = (1 << BITS) - 1;
    const int n = dim / per_byte;
    for (int j = 0; j < per_byte; ++j) {
        float* __restrict o = out + j * n;
#pragma omp simd
        for (int i = 0; i < n; ++i) o[i] = static_cast<float>((bytes[i] >> (BITS * j)) & mask);
    }
}

// Scores of rows query rows against keys [first_block, last_block) of one (batch, head).
template <int BITS>
inline __attribute__((always_inline)) void key_scores_run(const float* __restrict q, int rows, int dim, int group, const uint8_t* __restrict codes,
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

// Weighted values of tokens [first, last) of one (batch, head), added into acc [rows, dim] (split
// order) and zacc [rows, groups].
template <int BITS>
inline __attribute__((always_inline)) void weighted_run(const float* __restrict p, int64_t p_row_stride, int rows, int dim, int vgroup,
                  const uint8_t* __restrict codes, const float* __restrict scale,
                  const float* __restrict minimum, int64_t first, int64_t last, float* __restrict acc,
                  float* __restrict zacc) {
    constexpr int per_byte = 8 / BITS;
    constexpr int mask = (1 << BITS) - 1;
    const int n = dim / per_byte, packed = dim * BITS / 8, groups = dim / vgroup;
    const int group_bytes = vgroup / per_byte;
    alignas(64) float scaled[kMaxDim];
    for (int64_t t = first; t < last; ++t) {
        const uint8_t* b = codes + t * packed;
        const float* s = scale + t * groups;
        const float* z = minimum + t * groups;
        for (int j = 0; j < per_byte; ++j)
            for (int g = 0; g < groups; ++g) {
                const float sg = s[g];
                float* __restrict o = scaled + j * n + g * group_bytes;
                const uint8_t* bg = b + g * group_bytes;
#pragma omp simd
                for (int i = 0; i < group_bytes; ++i) o[i] = static_cast<float>((bg[i] >> (BITS * j)) & mask) * sg;
            }
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

// One clone per instruction set for each width (the runtime picks the best the CPU has).
#define KV_WRAP(BITS)                                                                                   \
    KV_CLONES void key_scores_##BITS(const float* q, int rows, int dim, int group, const uint8_t* codes,   \
                                     const float* scale, const float* minimum, int first, int last,       \
                                     float* out, int64_t out_row) {                                       \
        key_scores_run<BITS>(q, rows, dim, group, codes, scale, minimum, first, last, out, out_row);      \
    }                                                                                                     \
    KV_CLONES void weighted_##BITS(const float* p, int64_t p_row, int rows, int dim, int vgroup,          \
                                   const uint8_t* codes, const float* scale, const float* minimum,        \
                                   int64_t first, int64_t last, float* acc, float* zacc) {                \
        weighted_run<BITS>(p, p_row, rows, dim, vgroup, codes, scale, minimum, first, last, acc, zacc);   \
    }
KV_WRAP(8)
KV_WRAP(4)
KV_WRAP(2)

}  // namespace

extern "C" {

int kv_coded_max_rows() { return kMaxRows; }
int kv_coded_max_dim() { return kMaxDim; }

// scores[b, h, r, blk * G + t] = q[b, h, r] . key(b, h, blk * G + t) for blocks [0, nblk).
// q float32 contiguous [B, H, rows, D]; out float32 with the given strides (row stride out_row).
int kv_coded_key_scores(const float* q, const uint8_t* codes, const float* scale, const float* minimum, float* out,
                        int64_t batch, int64_t heads, int rows, int dim, int group, int bits, int64_t nblk,
                        int64_t codes_b, int64_t codes_h, int64_t scale_b, int64_t scale_h, int64_t out_b,
                        int64_t out_h, int64_t out_row, int64_t chunk_blocks, int threads) {
    if (rows < 1 || rows > kMaxRows || dim < 1 || dim > kMaxDim || dim % (8 / bits)) return 1;
    const int64_t chunks = (nblk + chunk_blocks - 1) / chunk_blocks;
    const int64_t tasks = batch * heads * chunks;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t task = 0; task < tasks; ++task) {
        const int64_t bh = task / chunks, c = task % chunks, b = bh / heads, h = bh % heads;
        const int first = static_cast<int>(c * chunk_blocks);
        const int last = static_cast<int>(c * chunk_blocks + chunk_blocks < nblk ? c * chunk_blocks + chunk_blocks : nblk);
        const float* qb = q + bh * rows * dim;
        const uint8_t* cb = codes + b * codes_b + h * codes_h;
        const float* sb = scale + b * scale_b + h * scale_h;
        const float* zb = minimum + b * scale_b + h * scale_h;
        float* ob = out + b * out_b + h * out_h;
        if (bits == 8) key_scores_8(qb, rows, dim, group, cb, sb, zb, first, last, ob, out_row);
        else if (bits == 4) key_scores_4(qb, rows, dim, group, cb, sb, zb, first, last, ob, out_row);
        else key_scores_2(qb, rows, dim, group, cb, sb, zb, first, last, ob, out_row);
    }
    return 0;
}

// out[b, h, r] = sum_t p[b, h, r, t] * value(b, h, t) over tokens [0, tokens).
// p float32 with strides (p_b, p_h, p_row, 1); out float32 contiguous [B, H, rows, Dv];
// scratch float32 [B * H * chunks, rows, Dv + Dv / Gv] (chunks = ceil(tokens / chunk_tokens)).
int kv_coded_weighted(const float* p, const uint8_t* codes, const float* scale, const float* minimum, float* out,
                      float* scratch, int64_t batch, int64_t heads, int rows, int dim, int vgroup, int bits,
                      int64_t tokens, int64_t p_b, int64_t p_h, int64_t p_row, int64_t codes_b, int64_t codes_h,
                      int64_t scale_b, int64_t scale_h, int64_t chunk_tokens, int threads) {
    const int per_byte = 8 / bits;
    if (rows < 1 || rows > kMaxRows || dim < 1 || dim > kMaxDim || vgroup < 1 || dim % vgroup ||
        vgroup % per_byte)
        return 1;
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
        if (bits == 8) weighted_8(pb, p_row, rows, dim, vgroup, cb, sb, zb, first, last, acc, zacc);
        else if (bits == 4) weighted_4(pb, p_row, rows, dim, vgroup, cb, sb, zb, first, last, acc, zacc);
        else weighted_2(pb, p_row, rows, dim, vgroup, cb, sb, zb, first, last, acc, zacc);
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

}  // extern "C"
