// Decode attention over float32 / bfloat16 keys and values read in place (kvcache.attention.native).
//
// One plain C entry point, called through ctypes with raw pointers (no Python or torch headers,
// so it builds in a second or two). For each (batch row, KV head) the R query rows that share the
// head (grouped-query heads times decode queries) are scored against every key, and the softmax-
// weighted values summed, in one pass over the keys and values ("flash decoding"): the tokens are
// split into chunks, each chunk keeps its own running maximum, sum and weighted sum for the R
// rows, and the chunks are merged at the end. Each key and value is read from memory once, and
// (batch, head, chunk) tasks spread over the OpenMP threads, so one long sequence uses every core.
//
//   q    float32 [B, Hkv, R, D]   contiguous; scores are q . k times `scale`
//   k    [B, Hkv, T, D]           any strides for B, Hkv, T; D contiguous
//   v    [B, Hkv, T, Dv]          likewise
//   keep uint8 [B, T] or null     0 = masked key (per batch row: padding)
//   out  float32 [B, Hkv, R, Dv]  contiguous; a row with every key masked gets zeros
//
// Scores are float32. One OpenMP region: the (batch, head, chunk) tasks, then (after the implicit
// barrier) the merge of each (batch, head)'s chunks. Masked keys are skipped (never turned into -inf), so the exponent never
// sees an infinity. softcap > 0 applies softcap * tanh(score / softcap) first.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#include "partials.h"
#include "simd.h"

namespace {

using namespace kv;

constexpr int kMaxRows = 64;  // query rows of one task: a group's heads, or several sequences' (shared prefix)
constexpr int kMaxDim = 512;
constexpr int kTile = 64;  // tokens scored before their values are summed (scores stay in L1)
static_assert(kMaxRows <= kPartialRows, "a task's rows fit a Partial");

// ---- scores of 16 keys at a time for head dims that are a multiple of 16: each key's products
// summed in a vector of 16 lanes, and the 16 vectors folded together (simd.h's sums16) into one
// vector of 16 scores (GCC vector extensions; -march=native widens them to the CPU's registers).
#if defined(__AVX512F__)
// Query rows whose weighted value sums are kept in registers together (add_weighted_rows).
constexpr int kRowsTogether = 4;
// 16-float vectors per column block of the weighted value sums (64 columns).
constexpr int kColumnVectors = 4;
#else
// 16 registers of 8 floats: two query rows' running sums at a time, so they do not spill.
constexpr int kRowsTogether = 2;
constexpr int kColumnVectors = 2;  // 32 columns a block
#endif

// One key's products with the query, summed over the head dim into 16 lanes.
template <int NV, typename T>
inline __attribute__((always_inline)) v16 products(const float* __restrict q, const T* __restrict k) {
    v16 a = load16(q) * load16(k);
    for (int v = 1; v < NV; ++v) a += load16(q + 16 * v) * load16(k + 16 * v);
    return a;
}

template <int NV, typename T>
inline __attribute__((always_inline)) v16 scores16(const float* __restrict q, const T* __restrict keys, int64_t stride) {
    v16 part[16];
    for (int t = 0; t < 16; ++t) part[t] = products<NV>(q, keys + t * stride);
    return sums16(part);
}


// acc rows [0, RR) (each `acc_stride` floats apart; 16 * NV columns of them) += sum over the tile's
// live tokens j of p[r][j] * value row j (its same 16 * NV columns; p rows kTile floats apart).
// RR * NV <= 16 running sums stay in registers across the tile, and each value row is loaded once
// for all RR query rows (the grouped heads of one KV head), instead of once per query row.
// The same for 16 key rows given by pointer (a tile whose tokens lie in several pool blocks).
template <int NV, typename T>
inline __attribute__((always_inline)) v16 scores16_at(const float* __restrict q, const T* const* __restrict keys) {
    v16 part[16];
    for (int t = 0; t < 16; ++t) part[t] = products<NV>(q, keys[t]);
    return sums16(part);
}

template <int NV, int RR, typename T>
inline __attribute__((always_inline)) void add_weighted_rows(const float* __restrict p, const T* __restrict v,
                                                             int64_t v_t, int n, const bool* __restrict live,
                                                             float* __restrict acc, int acc_stride) {
    constexpr int N = NV * 16 / kW;
    vw a[RR][N];
    for (int r = 0; r < RR; ++r)
        for (int i = 0; i < N; ++i) a[r][i] = loadw(acc + r * acc_stride + kW * i);
    for (int j = 0; j < n; ++j) {
        if (!live[j]) continue;
        const T* __restrict row = v + j * v_t;
        vw x[N];
        for (int i = 0; i < N; ++i) x[i] = loadw(row + kW * i);
        for (int r = 0; r < RR; ++r) {
            const float w = p[r * kTile + j];
            for (int i = 0; i < N; ++i) a[r][i] += w * x[i];
        }
    }
    for (int r = 0; r < RR; ++r)
        for (int i = 0; i < N; ++i) __builtin_memcpy(acc + r * acc_stride + kW * i, &a[r][i], sizeof(vw));
}

// Every query row's weighted sum of the tile's values, for value dims 32, 64 and 128: columns in
// blocks of 16 * NV (NV = 2 for 32, else 4), query rows four at a time.
// add_weighted_rows with each token's value row given by pointer.
template <int NV, int RR, typename T>
inline __attribute__((always_inline)) void add_weighted_rows_at(const float* __restrict p, const T* const* __restrict v,
                                                                int n, float* __restrict acc, int acc_stride,
                                                                int p_row = kTile, int p_key = 1) {
    constexpr int N = NV * 16 / kW;
    vw a[RR][N];
    for (int r = 0; r < RR; ++r)
        for (int i = 0; i < N; ++i) a[r][i] = loadw(acc + r * acc_stride + kW * i);
    for (int j = 0; j < n; ++j) {
        const T* __restrict row = v[j];
        vw x[N];
        for (int i = 0; i < N; ++i) x[i] = loadw(row + kW * i);
        for (int r = 0; r < RR; ++r) {
            const float w = p[r * p_row + j * p_key];
            for (int i = 0; i < N; ++i) a[r][i] += w * x[i];
        }
    }
    for (int r = 0; r < RR; ++r)
        for (int i = 0; i < N; ++i) __builtin_memcpy(acc + r * acc_stride + kW * i, &a[r][i], sizeof(vw));
}

template <int NV, typename T>
// Weights of row r and token j at scores[r * p_row + j * p_key] (a tile scored row-major, or
// token-major by tile_rows).
inline void add_weighted_tile_at(const float* scores, const T* const* v, int n, float* acc, int rows, int vdim,
                                 int c, int p_row = kTile, int p_key = 1) {
    const T* vc[kTile];
    for (int j = 0; j < n; ++j) vc[j] = v[j] + c;
    int r = 0;
    for (; r + kRowsTogether <= rows; r += kRowsTogether)
        add_weighted_rows_at<NV, kRowsTogether>(scores + r * p_row, vc, n, acc + r * vdim + c, vdim, p_row, p_key);
    const float* p = scores + r * p_row;
    float* a = acc + r * vdim + c;
    switch (rows - r) {
        case 3: add_weighted_rows_at<NV, 3>(p, vc, n, a, vdim, p_row, p_key); break;
        case 2: add_weighted_rows_at<NV, 2>(p, vc, n, a, vdim, p_row, p_key); break;
        case 1: add_weighted_rows_at<NV, 1>(p, vc, n, a, vdim, p_row, p_key); break;
        default: break;
    }
}

template <int NV, typename T>
inline void add_weighted_tile(const float* scores, const T* v, int64_t v_t, int n, const bool* live, float* acc,
                              int rows, int vdim) {
    for (int c = 0; c < vdim; c += 16 * NV) {
        int r = 0;
        for (; r + kRowsTogether <= rows; r += kRowsTogether)
            add_weighted_rows<NV, kRowsTogether>(scores + r * kTile, v + c, v_t, n, live, acc + r * vdim + c, vdim);
        const float* p = scores + r * kTile;
        float* a = acc + r * vdim + c;
        switch (rows - r) {
            case 3: add_weighted_rows<NV, 3>(p, v + c, v_t, n, live, a, vdim); break;
            case 2: add_weighted_rows<NV, 2>(p, v + c, v_t, n, live, a, vdim); break;
            case 1: add_weighted_rows<NV, 1>(p, v + c, v_t, n, live, a, vdim); break;
            default: break;
        }
    }
}

// A row of keys or values as float32: float rows are read where they are, bfloat16 rows widened
// into `scratch` (simd.h's widen).
inline const float* widen_row(const float* row, int, float*) { return row; }
inline const float* widen_row(const uint16_t* __restrict row, int n, float* __restrict scratch) {
#pragma omp simd
    for (int d = 0; d < n; ++d) scratch[d] = widen(row[d]);
    return scratch;
}

// A scored tile of n tokens (raw q.k in scores [rows, kTile]) into the running softmax: scale (or
// cap) the scores, masked tokens (live false) out; rescale part and acc [rows, vdim] to a new
// maximum; scores become the tile's weights relative to it, their sums added to part.
// With `limit`, row r sees only the tile's first limit[r] tokens (causal rows of a prompt chunk).
inline __attribute__((always_inline)) void softmax_tile(float* __restrict scores, const bool* __restrict live, int n,
                                                        int rows, int vdim, float scale, float softcap, Partial& part,
                                                        float* __restrict acc, const int* limit = nullptr) {
    for (int r = 0; r < rows; ++r) {
        float* __restrict sr = scores + r * kTile;
        if (limit != nullptr) {
            const int upto = limit[r];
            if (softcap > 0.f) {
                for (int j = 0; j < n; ++j) sr[j] = j < upto ? softcap * std::tanh(sr[j] * scale / softcap) : kMasked;
            } else {
#pragma omp simd
                for (int j = 0; j < n; ++j) sr[j] = j < upto ? sr[j] * scale : kMasked;
            }
        } else if (softcap > 0.f) {
            for (int j = 0; j < n; ++j) sr[j] = live[j] ? softcap * std::tanh(sr[j] * scale / softcap) : kMasked;
        } else {
#pragma omp simd
            for (int j = 0; j < n; ++j) sr[j] = live[j] ? sr[j] * scale : kMasked;
        }
    }
    for (int r = 0; r < rows; ++r) {
        float m = part.max[r];
        const float* __restrict tile = scores + r * kTile;
#pragma omp simd reduction(max : m)
        for (int j = 0; j < n; ++j) m = tile[j] > m ? tile[j] : m;
        if (m > part.max[r]) {  // rescale what was summed under the old maximum
            const float c = std::exp(part.max[r] - m);
            part.sum[r] *= c;
            float* __restrict a = acc + r * vdim;
#pragma omp simd
            for (int d = 0; d < vdim; ++d) a[d] *= c;
            part.max[r] = m;
        }
        part.sum[r] += exp_and_sum<true>(scores + r * kTile, n, m, 0.5f * kMasked);
    }
}

// Every row's weighted sum of the tile's values (v[j] anywhere; weights as add_weighted_tile_at
// reads them), for the value dims of vector_dims: column blocks of 32 or 64.
template <typename T>
inline void add_weighted_values(const float* scores, const T* const* v, int n, float* acc, int rows, int vdim,
                                int p_row = kTile, int p_key = 1) {
    if (vdim == 32 || kColumnVectors == 2)
        for (int c = 0; c < vdim; c += 32) add_weighted_tile_at<2>(scores, v, n, acc, rows, vdim, c, p_row, p_key);
    else
        for (int c = 0; c < vdim; c += 64) add_weighted_tile_at<4>(scores, v, n, acc, rows, vdim, c, p_row, p_key);
}

// Head dims the vector paths serve (scores 16 keys at a time, weighted sums in registers).
inline bool vector_dims(int dim, int vdim) {
    return (dim == 64 || dim == 128 || dim == 32) && (vdim == 64 || vdim == 128 || vdim == 32);
}
constexpr int kVectorMaxDim = 128;

// ---- many query rows over one tile (a prompt chunk's rows, or several sequences' over a shared
// prefix), token-major: the rows' queries transposed once per task into qt [dim][rows_pad] (rows
// padded with zeros to a multiple of kW), so that a tile's scores st [n][rows_pad] are, for KB keys
// and NR vectors of kW rows at a time, each key element (a scalar) times a vector of the rows'
// query elements: every key element is loaded once for all the rows, nothing is transposed per
// tile and no horizontal sums are needed; the softmax then runs down the tokens with a vector of
// rows, and the weighted values read st by token.
#if defined(__AVX512F__)
constexpr int kKeysTogether = 4;  // 4 keys x 4 row vectors = 16 sums + 4 query vectors of 32 registers
#else
constexpr int kKeysTogether = 2;  // 2 keys x 4 row vectors = 8 sums (two FMA chains a port) + 4 query vectors of 16
#endif
constexpr int kRowVectors = 4;

inline int padded_rows(int rows) { return (rows + kW - 1) / kW * kW; }

// qt [dim][padded_rows(rows)] from q [rows, dim] where many rows read vector dims (the task then
// goes token-major, tile_rows), returned; else null. qt holds kVectorMaxDim * kMaxRows floats.
inline const float* queries_by_token(const float* __restrict q, int rows, int dim, int vdim, float* __restrict qt) {
    if (rows <= kRowsTogether || !vector_dims(dim, vdim)) return nullptr;
    const int rp = padded_rows(rows);
    for (int d = 0; d < dim; ++d)
        for (int r = 0; r < rp; ++r) qt[d * rp + r] = r < rows ? q[r * dim + d] : 0.f;
    return qt;
}

template <int KB, int NR, typename T>
inline __attribute__((always_inline)) void scores_by_token(const float* __restrict qt, int rp, int dim,
                                                           const T* const* k, float* __restrict st) {
    vw a[KB][NR];
    for (int b = 0; b < KB; ++b)
        for (int i = 0; i < NR; ++i) a[b][i] = vw{};
    for (int d = 0; d < dim; ++d) {
        vw x[NR];
        for (int i = 0; i < NR; ++i) x[i] = loadw(qt + d * rp + i * kW);
        for (int b = 0; b < KB; ++b) {
            const float kd = widen(k[b][d]);
            for (int i = 0; i < NR; ++i) a[b][i] += kd * x[i];
        }
    }
    for (int b = 0; b < KB; ++b)
        for (int i = 0; i < NR; ++i) __builtin_memcpy(st + b * rp + i * kW, &a[b][i], sizeof(vw));
}

template <int KB, typename T>
inline void scores_by_token_rows(const float* __restrict qt, int rp, int dim, const T* const* k, float* __restrict st) {
    const int vectors = rp / kW;
    int i = 0;
    for (; i + kRowVectors <= vectors; i += kRowVectors)
        scores_by_token<KB, kRowVectors>(qt + i * kW, rp, dim, k, st + i * kW);
    switch (vectors - i) {
        case 3: scores_by_token<KB, 3>(qt + i * kW, rp, dim, k, st + i * kW); break;
        case 2: scores_by_token<KB, 2>(qt + i * kW, rp, dim, k, st + i * kW); break;
        case 1: scores_by_token<KB, 1>(qt + i * kW, rp, dim, k, st + i * kW); break;
        default: break;
    }
}

// The running softmax of a token-major tile st [n][rp] (raw scores in, weights relative to each
// row's new maximum out), as softmax_tile does for a row-major one.
inline void softmax_by_token(float* __restrict st, int n, int rows, int rp, int vdim, float scale, float softcap,
                             const int* limit, Partial& part, float* __restrict acc) {
    alignas(64) float top[kMaxRows];
    alignas(64) float sums[kMaxRows];
    for (int r = 0; r < rp; ++r) top[r] = r < rows ? part.max[r] : kMasked, sums[r] = 0.f;
    for (int j = 0; j < n; ++j) {
        float* __restrict sj = st + j * rp;
        if (softcap > 0.f) {
            for (int r = 0; r < rp; ++r) sj[r] = softcap * std::tanh(sj[r] * scale / softcap);
        } else {
#pragma omp simd
            for (int r = 0; r < rp; ++r) sj[r] *= scale;
        }
        if (limit != nullptr) {
#pragma omp simd
            for (int r = 0; r < rp; ++r) sj[r] = (r < rows && j < limit[r]) ? sj[r] : kMasked;
        }
#pragma omp simd
        for (int r = 0; r < rp; ++r) top[r] = sj[r] > top[r] ? sj[r] : top[r];
    }
    for (int r = 0; r < rows; ++r) {
        if (top[r] > part.max[r]) {  // rescale what was summed under the old maximum
            const float c = std::exp(part.max[r] - top[r]);
            part.sum[r] *= c;
            float* __restrict a = acc + r * vdim;
#pragma omp simd
            for (int d = 0; d < vdim; ++d) a[d] *= c;
            part.max[r] = top[r];
        }
    }
    for (int j = 0; j < n; ++j) {
        float* __restrict sj = st + j * rp;
        for (int r = 0; r < rp; r += kW) {
            const vw x = loadw(sj + r);
            const vw e = exp_nonpositive(x - loadw(top + r));
            const vw p = x > 0.5f * kMasked ? e : vw{};
            __builtin_memcpy(sj + r, &p, sizeof p);
            const vw total = loadw(sums + r) + p;
            __builtin_memcpy(sums + r, &total, sizeof total);
        }
    }
    for (int r = 0; r < rows; ++r) part.sum[r] += sums[r];
}

// One tile of n tokens (k[j], v[j] anywhere) for many rows whose queries are qt (queries_by_token),
// continuing part and acc [rows, vdim]; `limit` as for tile_at. Head dims: vector_dims.
template <typename T>
inline void tile_rows(const float* __restrict qt, int rows, int dim, int vdim, const T* const* k, const T* const* v,
                      int n, float scale, float softcap, Partial& part, float* __restrict acc, const int* limit) {
    alignas(64) float st[kTile * kMaxRows];
    const int rp = padded_rows(rows);
    int j = 0;
    for (; j + kKeysTogether <= n; j += kKeysTogether) scores_by_token_rows<kKeysTogether>(qt, rp, dim, k + j, st + j * rp);
    for (; j < n; ++j) scores_by_token_rows<1>(qt, rp, dim, k + j, st + j * rp);
    softmax_by_token(st, n, rows, rp, vdim, scale, softcap, limit, part, acc);
    const float* vf[kTile];
    alignas(64) float vt[kTile * kVectorMaxDim];
    for (int t = 0; t < n; ++t) {
        if constexpr (std::is_same_v<T, float>) {
            vf[t] = v[t];
        } else {  // bfloat16 values widened once for every row
            vf[t] = widen_row(v[t], vdim, vt + t * vdim);
        }
    }
    add_weighted_values(st, vf, n, acc, rows, vdim, 1, rp);
}

// One tile of n <= kTile tokens whose key and value rows lie anywhere (k[j], v[j]: pool blocks),
// continuing the running softmax in part and acc [rows, vdim]. With `limit`, row r sees only the
// tile's first limit[r] tokens.
// With `qt` (queries_by_token's) the tile goes to tile_rows.
template <typename T>
inline void tile_at(const float* __restrict q, int rows, int dim, int vdim, const T* const* k, const T* const* v, int n,
                    float scale, float softcap, Partial& part, float* __restrict acc, const int* limit = nullptr,
                    const float* qt = nullptr) {
    if (qt != nullptr) {
        tile_rows(qt, rows, dim, vdim, k, v, n, scale, softcap, part, acc, limit);
        return;
    }
    alignas(64) float scores[kMaxRows * kTile];
    alignas(64) float krow[kMaxDim];
    alignas(64) float vrow[kMaxDim];
    bool live[kTile];
    const bool vector = vector_dims(dim, vdim);
    int first = 0;
    if (vector) {  // float32, or bfloat16 widened in registers
        for (; first + 16 <= n; first += 16) {
            for (int r = 0; r < rows; ++r) {
                const v16 sc = dim == 64    ? scores16_at<4>(q + r * dim, k + first)
                               : dim == 128 ? scores16_at<8>(q + r * dim, k + first)
                                            : scores16_at<2>(q + r * dim, k + first);
                __builtin_memcpy(scores + r * kTile + first, &sc, sizeof sc);
            }
        }
    }
    for (int j = first; j < n; ++j) {
        const float* kf = widen_row(k[j], dim, krow);
        for (int r = 0; r < rows; ++r) {
            const float* __restrict qr = q + r * dim;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int d = 0; d < dim; ++d) s += qr[d] * kf[d];
            scores[r * kTile + j] = s;
        }
    }
    for (int j = 0; j < n; ++j) live[j] = true;
    softmax_tile(scores, live, n, rows, vdim, scale, softcap, part, acc, limit);
    if (vector) {
        add_weighted_values(scores, v, n, acc, rows, vdim);
        return;
    }
    for (int j = 0; j < n; ++j) {
        const float* vf = widen_row(v[j], vdim, vrow);
        for (int r = 0; r < rows; ++r) {
            const float p = scores[r * kTile + j];
            float* __restrict a = acc + r * vdim;
#pragma omp simd
            for (int d = 0; d < vdim; ++d) a[d] += p * vf[d];
        }
    }
}

// One chunk [t0, t1) of one (batch, head): running max/sum per row and the unnormalised weighted
// values acc [R, Dv] relative to that max.
template <typename T>
inline __attribute__((always_inline)) void chunk_pass(const float* __restrict q, int rows, int dim, int vdim,
                                                      const T* __restrict k, int64_t k_t, const T* __restrict v,
                                                      int64_t v_t, const uint8_t* __restrict keep, int64_t t0,
                                                      int64_t t1, float scale, float softcap, Partial& part,
                                                      float* __restrict acc, bool fresh = true) {
    alignas(64) float scores[kMaxRows * kTile];
    alignas(64) float krow[kMaxDim];
    alignas(64) float vrow[kMaxDim];
    bool live[kTile];
    // bfloat16 read by many rows with no mask: token-major (tile_rows), each key and value widened
    // once for all the rows, not once per row or per few in registers
    alignas(64) float qt_rows[kVectorMaxDim * kMaxRows];
    const bool unmasked_bf16 = !std::is_same_v<T, float> && keep == nullptr;
    const float* qt = unmasked_bf16 ? queries_by_token(q, rows, dim, vdim, qt_rows) : nullptr;
    if (fresh) {  // else the tokens continue the running softmax already in part and acc
        for (int r = 0; r < rows; ++r) {
            part.max[r] = kMasked;
            part.sum[r] = 0.f;
        }
        std::memset(acc, 0, sizeof(float) * rows * vdim);
    }
    for (int64_t base = t0; base < t1; base += kTile) {
        const int n = static_cast<int>(std::min<int64_t>(kTile, t1 - base));
        if (qt != nullptr) {
            const T* kp[kTile];
            const T* vp[kTile];
            for (int j = 0; j < n; ++j) kp[j] = k + (base + j) * k_t, vp[j] = v + (base + j) * v_t;
            tile_rows(qt, rows, dim, vdim, kp, vp, n, scale, softcap, part, acc, nullptr);
            continue;
        }
        int first = 0;  // tokens [0, first) of the tile scored 16 at a time
        {  // float32, or bfloat16 widened in registers
            if (dim == 64 || dim == 128 || dim == 32) {
                for (; first + 16 <= n; first += 16) {
                    const T* keys = k + (base + first) * k_t;
                    for (int r = 0; r < rows; ++r) {
                        const v16 sc = dim == 64    ? scores16<4>(q + r * dim, keys, k_t)
                                       : dim == 128 ? scores16<8>(q + r * dim, keys, k_t)
                                                    : scores16<2>(q + r * dim, keys, k_t);
                        __builtin_memcpy(scores + r * kTile + first, &sc, sizeof sc);
                    }
                }
            }
        }
        for (int j = first; j < n; ++j) {
            const float* kf = widen_row(k + (base + j) * k_t, dim, krow);
            for (int r = 0; r < rows; ++r) {
                const float* __restrict qr = q + r * dim;
                float s = 0.f;
#pragma omp simd reduction(+ : s)
                for (int d = 0; d < dim; ++d) s += qr[d] * kf[d];
                scores[r * kTile + j] = s;
            }
        }
        for (int j = 0; j < n; ++j) live[j] = keep == nullptr || keep[base + j] != 0;
        softmax_tile(scores, live, n, rows, vdim, scale, softcap, part, acc);
        {  // float32, or bfloat16 widened in registers
            if (vdim == 64 || vdim == 128 || vdim == 32) {
                if (vdim == 32 || kColumnVectors == 2)
                    add_weighted_tile<2>(scores, v + base * v_t, v_t, n, live, acc, rows, vdim);
                else
                    add_weighted_tile<4>(scores, v + base * v_t, v_t, n, live, acc, rows, vdim);
                continue;
            }
        }
        for (int j = 0; j < n; ++j) {
            if (!live[j]) continue;
            const float* vf = widen_row(v + (base + j) * v_t, vdim, vrow);
            for (int r = 0; r < rows; ++r) {
                const float p = scores[r * kTile + j];
                float* __restrict a = acc + r * vdim;
#pragma omp simd
                for (int d = 0; d < vdim; ++d) a[d] += p * vf[d];
            }
        }
    }
}

template <typename T>
int decode(const float* q, const T* k, const T* v, const uint8_t* keep, float* out, int64_t batch, int64_t heads,
           int rows, int dim, int vdim, int64_t len, int64_t k_b, int64_t k_h, int64_t k_t, int64_t v_b,
           int64_t v_h, int64_t v_t, int64_t chunk, float scale, float softcap, int threads) {
    if (rows < 1 || rows > kMaxRows || dim < 1 || dim > kMaxDim || vdim < 1 || vdim > kMaxDim || chunk < 1)
        return 1;
    const int64_t chunks = len == 0 ? 1 : (len + chunk - 1) / chunk;
    const int64_t tasks = batch * heads * chunks;
    std::vector<Partial> parts(tasks);
    std::vector<float> accs(static_cast<size_t>(tasks) * rows * vdim);
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; ++task) {
            const int64_t c = task % chunks, bh = task / chunks, h = bh % heads, b = bh / heads;
            const int64_t t0 = c * chunk, t1 = std::min(len, t0 + chunk);
            chunk_pass(q + (b * heads + h) * rows * dim, rows, dim, vdim, k + b * k_b + h * k_h, k_t,
                       v + b * v_b + h * v_h, v_t, keep == nullptr ? nullptr : keep + b * len, t0, t1, scale,
                       softcap, parts[task], accs.data() + task * rows * vdim);
        }
#pragma omp for
        for (int64_t bh = 0; bh < batch * heads; ++bh)
            merge_partials(parts.data() + bh * chunks, accs.data() + bh * chunks * rows * vdim, chunks, rows, vdim,
                           out + bh * rows * vdim);
    }
    return 0;
}

// The token rows [t0, t1) of a sequence whose blocks are table[0], table[1], ... (t0 a multiple of
// block_size; k / v: one head's rows in block 0, blocks k_blk / v_blk apart), handed to
// tile(kp, vp, n) kTile at a time: a tile gathered across blocks, so small blocks do not pay a
// tile's fixed cost each.
template <typename T, typename F>
inline void for_each_tile(const int32_t* table, int64_t t0, int64_t t1, int64_t block_size, const T* k, const T* v,
                          int64_t k_blk, int64_t v_blk, int dim, int vdim, F&& tile) {
    const T* kp[kTile];
    const T* vp[kTile];
    int n = 0;
    for (int64_t b = t0 / block_size; b * block_size < t1; ++b) {
        const T* kb = k + table[b] * k_blk;
        const T* vb = v + table[b] * v_blk;
        const int64_t count = std::min(block_size, t1 - b * block_size);
        for (int64_t t = 0; t < count; ++t) {
            kp[n] = kb + t * dim;
            vp[n] = vb + t * vdim;
            if (++n == kTile) {
                tile(kp, vp, n);
                n = 0;
            }
        }
    }
    if (n > 0) tile(kp, vp, n);
}

// ---- paged decode: the keys and values of each sequence lie in blocks of a pool, in the order of
// the sequence's block table (kvcache.engine.paged). Pool layout [blocks, Hkv, block_size, D].

template <typename T>
int paged_decode(const float* q, const T* k, const T* v, const int32_t* tables, const int64_t* lengths, float* out,
                 float* lse, int64_t seqs, int64_t heads, int rows, int dim, int vdim, int64_t block_size, int64_t table_stride,
                 int64_t k_blk, int64_t k_h, int64_t v_blk, int64_t v_h, int64_t blocks_per_task, float scale,
                 float softcap, int threads) {
    if (rows < 1 || rows > kMaxRows || dim < 1 || dim > kMaxDim || vdim < 1 || vdim > kMaxDim || block_size < 1 ||
        blocks_per_task < 1)
        return 1;
    // Tasks: (sequence, head, run of blocks_per_task blocks); a sequence's first task index.
    std::vector<int64_t> first(seqs + 1, 0);
    for (int64_t s = 0; s < seqs; ++s) {
        if (lengths[s] < 0 || (lengths[s] + block_size - 1) / block_size > table_stride) return 1;
        const int64_t blocks = (lengths[s] + block_size - 1) / block_size;
        first[s + 1] = first[s] + heads * std::max<int64_t>(1, (blocks + blocks_per_task - 1) / blocks_per_task);
    }
    const int64_t tasks = first[seqs];
    std::vector<Partial> parts(tasks);
    std::vector<float> accs(static_cast<size_t>(tasks) * rows * vdim);
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; ++task) {
            const int64_t s = std::upper_bound(first.begin(), first.end(), task) - first.begin() - 1;
            const int64_t per_head = (first[s + 1] - first[s]) / heads, local = task - first[s];
            const int64_t h = local / per_head, run = local % per_head;
            Partial& part = parts[task];
            float* acc = accs.data() + task * rows * vdim;
            for (int r = 0; r < rows; ++r) part.max[r] = kMasked, part.sum[r] = 0.f;
            std::memset(acc, 0, sizeof(float) * rows * vdim);
            const float* qs = q + (s * heads + h) * rows * dim;
            const int64_t len = lengths[s];
            alignas(64) float qt_rows[kVectorMaxDim * kMaxRows];  // many rows (a shared prefix's pass)
            const float* qt = queries_by_token(qs, rows, dim, vdim, qt_rows);
            // The task's blocks continue one running softmax, a tile at a time.
            const int64_t t0 = run * blocks_per_task * block_size;
            const int64_t t1 = std::min(len, (run + 1) * blocks_per_task * block_size);
            for_each_tile(tables + s * table_stride, t0, t1, block_size, k + h * k_h, v + h * v_h, k_blk, v_blk, dim,
                          vdim, [&](const T* const* kp, const T* const* vp, int n) {
                              tile_at(qs, rows, dim, vdim, kp, vp, n, scale, softcap, part, acc, nullptr, qt);
                          });
        }
#pragma omp for
        for (int64_t sh = 0; sh < seqs * heads; ++sh) {
            const int64_t s = sh / heads, h = sh % heads;
            const int64_t per_head = (first[s + 1] - first[s]) / heads, base = first[s] + h * per_head;
            merge_partials(parts.data() + base, accs.data() + base * rows * vdim, per_head, rows, vdim,
                           out + sh * rows * vdim, lse == nullptr ? nullptr : lse + sh * rows);
        }
    }
    return 0;
}

// ---- paged prefill: the queries of prompt chunks over their keys and values in pool blocks (the
// past and the chunk itself, already written), causal: query i of a row, at position past + i, sees
// positions [0, past + i]. Tasks: (row, head, a block of query positions whose grouped heads fill
// at most kMaxRows rows); each runs one softmax over its visible tiles, its rows token-major
// (tile_rows), and writes its normalised rows.

template <typename T>
int paged_prefill(const float* q, const T* k, const T* v, const int32_t* tables, const int64_t* starts,
                  const int64_t* pasts, float* out, int64_t seqs, int64_t heads, int rows, int dim, int vdim,
                  int64_t block_size, int64_t table_stride, int64_t k_blk, int64_t k_h, int64_t v_blk, int64_t v_h,
                  float scale, float softcap, int threads) {
    if (rows < 1 || rows > kMaxRows || dim < 1 || dim > kMaxDim || vdim < 1 || vdim > kMaxDim || block_size < 1)
        return 1;
    const int64_t per_task = kMaxRows / rows;  // query positions a task
    const int64_t total = starts[seqs];
    std::vector<int64_t> first(seqs + 1, 0);
    for (int64_t s = 0; s < seqs; ++s) {
        const int64_t n = starts[s + 1] - starts[s];
        if (n < 0 || pasts[s] < 0 || (pasts[s] + n + block_size - 1) / block_size > table_stride) return 1;
        first[s + 1] = first[s] + heads * ((n + per_task - 1) / per_task);
    }
    const int64_t tasks = first[seqs];
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t task = 0; task < tasks; ++task) {
        const int64_t s = std::upper_bound(first.begin(), first.end(), task) - first.begin() - 1;
        const int64_t n = starts[s + 1] - starts[s], blocks_of_queries = (n + per_task - 1) / per_task;
        const int64_t local = task - first[s], h = local / blocks_of_queries;
        const int64_t i0 = (local % blocks_of_queries) * per_task, i1 = std::min(n, i0 + per_task);
        const int m = static_cast<int>((i1 - i0) * rows);
        const int64_t offset = (h * total + starts[s] + i0) * rows;  // the task's first row in q and out
        const float* qs = q + offset * dim;
        std::vector<float> acc(static_cast<size_t>(m) * vdim, 0.f);
        alignas(64) float qt_rows[kVectorMaxDim * kMaxRows];
        const float* qt = queries_by_token(qs, m, dim, vdim, qt_rows);
        Partial part;
        for (int r = 0; r < m; ++r) part.max[r] = kMasked, part.sum[r] = 0.f;
        const int64_t past = pasts[s], seen = past + i1;  // keys the task's last query sees
        int limit[kMaxRows];
        int64_t tile_start = 0;
        for_each_tile(tables + s * table_stride, 0, seen, block_size, k + h * k_h, v + h * v_h, k_blk, v_blk, dim, vdim,
                      [&](const T* const* kp, const T* const* vp, int count) {
                          // rows see keys up to their own position: a limit only on tiles that
                          // reach past the first query
                          const bool causal = tile_start + count > past + i0 + 1;
                          if (causal)
                              for (int r = 0; r < m; ++r) {
                                  const int64_t sees = past + i0 + r / rows + 1 - tile_start;
                                  limit[r] = static_cast<int>(std::clamp<int64_t>(sees, 0, count));
                              }
                          tile_at(qs, m, dim, vdim, kp, vp, count, scale, softcap, part, acc.data(),
                                  causal ? limit : nullptr, qt);
                          tile_start += count;
                      });
        merge_partials(&part, acc.data(), 1, m, vdim, out + offset * vdim);
    }
    return 0;
}

}  // namespace

extern "C" {

// dtype: 0 = float32, 1 = bfloat16 (keys and values alike).
int kv_float_decode(const float* q, const void* k, const void* v, const uint8_t* keep, float* out,
                              int dtype, int64_t batch, int64_t heads, int rows, int dim, int vdim, int64_t len,
                              int64_t k_b, int64_t k_h, int64_t k_t, int64_t v_b, int64_t v_h, int64_t v_t,
                              int64_t chunk, float scale, float softcap, int threads) {
    if (dtype == 0)
        return decode(q, static_cast<const float*>(k), static_cast<const float*>(v), keep, out, batch, heads, rows,
                      dim, vdim, len, k_b, k_h, k_t, v_b, v_h, v_t, chunk, scale, softcap, threads);
    if (dtype == 1)
        return decode(q, static_cast<const uint16_t*>(k), static_cast<const uint16_t*>(v), keep, out, batch, heads,
                      rows, dim, vdim, len, k_b, k_h, k_t, v_b, v_h, v_t, chunk, scale, softcap, threads);
    return 2;
}

// Paged decode (see paged_decode): q float32 [S, Hkv, R, D] contiguous; k / v pools [blocks, Hkv, bs, D]
// with block strides k_blk / v_blk and head strides k_h / v_h (elements; token rows contiguous);
// tables int32 [S, table_stride]; lengths int64 [S]; out float32 [S, Hkv, R, Dv]; lse float32
// [S, Hkv, R] or null (each row's log-sum-exp of its scores). A sequence of length 0 gets zeros
// (and lse -inf).
int kv_paged_decode(const float* q, const void* k, const void* v, const int32_t* tables, const int64_t* lengths,
                    float* out, float* lse, int dtype, int64_t seqs, int64_t heads, int rows, int dim, int vdim, int64_t block_size,
                    int64_t table_stride, int64_t k_blk, int64_t k_h, int64_t v_blk, int64_t v_h,
                    int64_t blocks_per_task, float scale, float softcap, int threads) {
    if (dtype == 0)
        return paged_decode(q, static_cast<const float*>(k), static_cast<const float*>(v), tables, lengths, out, lse, seqs,
                            heads, rows, dim, vdim, block_size, table_stride, k_blk, k_h, v_blk, v_h, blocks_per_task,
                            scale, softcap, threads);
    if (dtype == 1)
        return paged_decode(q, static_cast<const uint16_t*>(k), static_cast<const uint16_t*>(v), tables, lengths, out,
                            lse, seqs, heads, rows, dim, vdim, block_size, table_stride, k_blk, k_h, v_blk, v_h,
                            blocks_per_task, scale, softcap, threads);
    return 2;
}

// Paged prefill (see paged_prefill): q float32 [Hkv, N, R, D] contiguous, the N queries of `seqs`
// prompt chunks one after the other (chunk s: starts[s] to starts[s + 1], int64 [seqs + 1], at
// positions pasts[s] + i); k / v pools [blocks, Hkv, bs, D] as for kv_paged_decode, holding each
// chunk's past and the chunk itself; tables int32 [seqs, table_stride]; out float32 [Hkv, N, R, Dv].
int kv_paged_prefill(const float* q, const void* k, const void* v, const int32_t* tables, const int64_t* starts,
                     const int64_t* pasts, float* out, int dtype, int64_t seqs, int64_t heads, int rows, int dim,
                     int vdim, int64_t block_size, int64_t table_stride, int64_t k_blk, int64_t k_h, int64_t v_blk,
                     int64_t v_h, float scale, float softcap, int threads) {
    if (dtype == 0)
        return paged_prefill(q, static_cast<const float*>(k), static_cast<const float*>(v), tables, starts, pasts, out,
                             seqs, heads, rows, dim, vdim, block_size, table_stride, k_blk, k_h, v_blk, v_h, scale,
                             softcap, threads);
    if (dtype == 1)
        return paged_prefill(q, static_cast<const uint16_t*>(k), static_cast<const uint16_t*>(v), tables, starts, pasts,
                             out, seqs, heads, rows, dim, vdim, block_size, table_stride, k_blk, k_h, v_blk, v_h, scale,
                             softcap, threads);
    return 2;
}
}
