// Paged attention in bfloat16 (kvcache.attention.native.paged_prefill and paged_decode with
// bfloat16 queries over bfloat16 blocks): the queries of prompt chunks over their past and
// themselves, causal, as float_decode.cpp's paged_prefill takes them, and many decode rows over a
// sequence's whole length (a shared prefix's pass). Both products run in bfloat16 with float32 sums:
// scores = q k^T, and the weighted values = p v with the weights p rounded to bfloat16 (as a
// bfloat16 attention rounds them). The running softmax and the output are float32. The products
// run on AMX tiles where this process may use them (amx.h), else on AVX-512 BF16's vdpbf16ps; both
// read the same packed operands (bf16_pack.h) and add the same pairs of products.
//
//   q       bfloat16 [Hkv, N, R, D]   contiguous; chunk s's queries are N = starts[s] .. starts[s + 1],
//                                     query i at position pasts[s] + i sees positions 0 .. pasts[s] + i
//   k, v    bfloat16 pools [blocks, Hkv, bs, D] (Dv): block strides k_blk / v_blk, head strides
//           k_h / v_h (elements), token rows contiguous; they hold each chunk's past and the chunk
//   tables  int32 [seqs, table_stride]; starts int64 [seqs + 1]; pasts int64 [seqs]
//   out     float32 [Hkv, N, R, Dv]
//
// Two passes. First every (block, head) the chunks reach is packed once (bf16_pack.h) into the
// operand layouts (a shared prefix's blocks once for all the chunks that read them): keys as
// [bs/16][D/32] tiles of 16 dim pairs x 16 tokens x 2, values as [bs/32][Dv/16] tiles of 16 token
// pairs x 16 columns x 2 (1 KB each), in buffers the calling thread keeps between calls. Then tasks
// (chunk, head, a block of query positions whose grouped heads fill at most 64 rows, a chunk's tasks
// taking equal shares) walk their visible keys 128 at a time, in pieces of 32 (a piece lies in one
// block): the scores of every 16 rows (as up to four independent 16-key tile products, or in
// registers 8 rows at a time), the running softmax row by row in vectors against a lazy maximum
// (kSlack), the weights rounded to bfloat16, and the weighted values into float32 sums, which stay
// in memory (a tile cannot scale its rows by the softmax's correction) and are loaded and stored once
// a step. Rows past a task's own are padded to 16 with zeros. A chunk of one query position with
// fewer rows than a tile (a decode row in a prompt step) is not packed: it reads its blocks in
// place, as decode rows do (steps_direct below), at about twice the speed.
//
// Returns 0, 1 for inputs out of range, 2 where this build or CPU has neither AMX tiles nor AVX-512
// BF16 or the shapes do not fit (D a multiple of 32 and Dv of 16, both <= 256; bs a multiple of 32):
// the caller then takes float_decode's kernel.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "bf16_pack.h"
#include "partials.h"
#include "simd.h"

namespace {

using namespace kv;

constexpr int kMaxRows = 64;    // query rows a task (four 16-row tiles)
constexpr int kMaxDim = 256;
constexpr int kStep = 128;      // keys a step: up to four pieces, the sums loaded and stored once
static_assert(kMaxRows <= kPartialRows, "a task's rows fit a Partial");

#if defined(__AVX512BF16__)
constexpr bool kDots = true;  // this build has vdpbf16ps (and AVX-512: the softmax's vectors)
#else
constexpr bool kDots = false;
#endif

bool fits(int rows, int dim, int vdim, int64_t block_size) {
    return kDots && rows >= 1 && rows <= kMaxRows && dim % 32 == 0 && dim >= 32 && dim <= kMaxDim && vdim % 16 == 0 &&
           vdim >= 16 && vdim <= kMaxDim && block_size % kPiece == 0 && block_size > 0;
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)

// The scores [16 RT rows, 32 pieces keys] of a step into s (row stride kStep): q [16 RT, D] (row
// stride D) times each piece's key tiles [2][D/32]. For each 16 rows, up to four 16-key tiles of
// scores (tiles 0-3) sum over the head dim as four independent chains (query rows in tile 4, keys
// in 5-7 and 5 again).
inline void score_tiles(const uint16_t* q, int dim, const uint16_t* const* keys, int pieces, int row_tiles, float* s) {
    const int parts = dim / 32, columns = 2 * pieces;
    const int64_t q_stride = dim * 2, s_stride = kStep * 4;
    for (int rt = 0; rt < row_tiles; ++rt) {
        const uint16_t* qr = q + rt * 16 * dim;
        for (int c0 = 0; c0 < columns; c0 += 4) {
            const int n = std::min(4, columns - c0);
            const uint16_t* k[4];
            for (int i = 0; i < n; ++i) k[i] = keys[(c0 + i) / 2] + ((c0 + i) % 2) * parts * kTileElems;
            _tile_zero(0);
            if (n > 1) _tile_zero(1);
            if (n > 2) _tile_zero(2);
            if (n > 3) _tile_zero(3);
            for (int c = 0; c < parts; ++c) {
                _tile_loadd(4, qr + c * 32, q_stride);
                _tile_loadd(5, k[0] + c * kTileElems, 64);
                _tile_dpbf16ps(0, 4, 5);
                if (n > 1) { _tile_loadd(6, k[1] + c * kTileElems, 64); _tile_dpbf16ps(1, 4, 6); }
                if (n > 2) { _tile_loadd(7, k[2] + c * kTileElems, 64); _tile_dpbf16ps(2, 4, 7); }
                if (n > 3) { _tile_loadd(5, k[3] + c * kTileElems, 64); _tile_dpbf16ps(3, 4, 5); }
            }
            float* out = s + rt * 16 * kStep + c0 * 16;
            _tile_stored(0, out, s_stride);
            if (n > 1) _tile_stored(1, out + 16, s_stride);
            if (n > 2) _tile_stored(2, out + 32, s_stride);
            if (n > 3) _tile_stored(3, out + 48, s_stride);
        }
    }
}

// The sums [16 RT rows, Dv] (row stride Dv) += the weights [16 RT, 32 pieces keys] (bfloat16, row
// stride kStep) times each piece's value tiles [Dv/16]. For each 16 rows, up to four 16-column
// tiles of sums (tiles 0-3) are loaded, take every piece's products (weights in tile 4, values in
// 5-7 and 5 again) as four independent chains, and are stored once a step.
inline void value_tiles(const uint16_t* p, const uint16_t* const* values, int pieces, int vdim, int row_tiles,
                        float* sums) {
    const int64_t stride = vdim * 4;
    const int columns = vdim / 16;
    for (int rt = 0; rt < row_tiles; ++rt) {
        const uint16_t* w = p + rt * 16 * kStep;
        for (int c0 = 0; c0 < columns; c0 += 4) {
            const int n = std::min(4, columns - c0);
            float* o = sums + rt * 16 * vdim + c0 * 16;
            _tile_loadd(0, o, stride);
            if (n > 1) _tile_loadd(1, o + 16, stride);
            if (n > 2) _tile_loadd(2, o + 32, stride);
            if (n > 3) _tile_loadd(3, o + 48, stride);
            for (int j = 0; j < pieces; ++j) {
                const uint16_t* v = values[j] + c0 * kTileElems;
                _tile_loadd(4, w + j * kPiece, kStep * 2);
                _tile_loadd(5, v, 64);
                _tile_dpbf16ps(0, 4, 5);
                if (n > 1) { _tile_loadd(6, v + kTileElems, 64); _tile_dpbf16ps(1, 4, 6); }
                if (n > 2) { _tile_loadd(7, v + 2 * kTileElems, 64); _tile_dpbf16ps(2, 4, 7); }
                if (n > 3) { _tile_loadd(5, v + 3 * kTileElems, 64); _tile_dpbf16ps(3, 4, 5); }
            }
            _tile_stored(0, o, stride);
            if (n > 1) _tile_stored(1, o + 16, stride);
            if (n > 2) _tile_stored(2, o + 32, stride);
            if (n > 3) _tile_stored(3, o + 48, stride);
        }
    }
}

#endif

#if defined(__AVX512BF16__)

// score_tiles' products on vdpbf16ps: for each piece, the scores of 8 rows x its 32 keys sum over
// the head dim's pairs in 16 registers (each pair row of the two key tiles loaded once for the 8
// rows, each row's query pair broadcast once for the 32 keys).
inline void score_dots(const uint16_t* q, int dim, const uint16_t* const* keys, int pieces, int row_tiles, float* s) {
    const int parts = dim / 32, rows = row_tiles * 16;
    for (int j = 0; j < pieces; ++j) {
        const uint16_t* low = keys[j];                       // keys 0-15 of the piece, tiles (0, c)
        const uint16_t* high = keys[j] + parts * kTileElems;  // keys 16-31
        for (int r0 = 0; r0 < rows; r0 += 8) {
            __m512 a[8], b[8];
            for (int r = 0; r < 8; ++r) a[r] = b[r] = _mm512_setzero_ps();
            for (int c = 0; c < parts; ++c)
                for (int p = 0; p < 16; ++p) {
                    const __m512bh x = (__m512bh)_mm512_loadu_si512(low + c * kTileElems + p * 32);
                    const __m512bh y = (__m512bh)_mm512_loadu_si512(high + c * kTileElems + p * 32);
                    const uint16_t* qp = q + r0 * dim + c * 32 + 2 * p;
                    for (int r = 0; r < 8; ++r) {
                        const __m512bh w = pair_at(qp + r * dim);
                        a[r] = _mm512_dpbf16_ps(a[r], x, w);
                        b[r] = _mm512_dpbf16_ps(b[r], y, w);
                    }
                }
            for (int r = 0; r < 8; ++r) {
                float* out = s + (r0 + r) * kStep + j * kPiece;
                _mm512_storeu_ps(out, a[r]);
                _mm512_storeu_ps(out + 16, b[r]);
            }
        }
    }
}

// body(N) with N = n as a constant, n held to [1, Most]: the column groups, rows or head-dim parts a
// kernel keeps in registers.
template <int Most, int N = 1, typename F>
inline void as_constant(int n, F&& body) {
    if constexpr (N < Most) {
        if (n > N) return as_constant<Most, N + 1>(n, body);
    }
    body(std::integral_constant<int, N>{});
}

// value_dots for 4 rows x N groups of 16 columns: their sums in registers over the step's token pairs.
template <int N>
inline void value_dots_block(const uint16_t* p, const uint16_t* const* values, int pieces, int vdim, float* sums) {
    __m512 a[4][N];
    for (int r = 0; r < 4; ++r)
        for (int c = 0; c < N; ++c) a[r][c] = _mm512_loadu_ps(sums + r * vdim + c * 16);
    for (int j = 0; j < pieces; ++j)
        for (int t = 0; t < 16; ++t) {  // the piece's token pairs
            __m512bh x[N];
            for (int c = 0; c < N; ++c) x[c] = (__m512bh)_mm512_loadu_si512(values[j] + c * kTileElems + t * 32);
            for (int r = 0; r < 4; ++r) {
                const __m512bh w = pair_at(p + r * kStep + j * kPiece + 2 * t);
                for (int c = 0; c < N; ++c) a[r][c] = _mm512_dpbf16_ps(a[r][c], x[c], w);
            }
        }
    for (int r = 0; r < 4; ++r)
        for (int c = 0; c < N; ++c) _mm512_storeu_ps(sums + r * vdim + c * 16, a[r][c]);
}

// value_tiles' products on vdpbf16ps, 4 rows and up to 64 columns at a time.
inline void value_dots(const uint16_t* p, const uint16_t* const* values, int pieces, int vdim, int row_tiles,
                       float* sums) {
    const int groups = vdim / 16;
    for (int r0 = 0; r0 < row_tiles * 16; r0 += 4)
        for (int c0 = 0; c0 < groups; c0 += 4) {
            const uint16_t* v[kStep / kPiece];
            for (int j = 0; j < pieces; ++j) v[j] = values[j] + c0 * kTileElems;
            const uint16_t* w = p + r0 * kStep;
            float* o = sums + r0 * vdim + c0 * 16;
            as_constant<4>(groups - c0, [&](auto n) { value_dots_block<n()>(w, v, pieces, vdim, o); });
        }
}

// A thread's scratch for one task at a time.
struct Scratch {
    bool tiles = false;  // the products on AMX tiles, else on vdpbf16ps
    std::vector<uint16_t> q = std::vector<uint16_t>(kMaxRows * kMaxDim);  // the task's rows, padded
    std::vector<float> sums = std::vector<float>(kMaxRows * kMaxDim);     // weighted values
    std::vector<float> scores = std::vector<float>(kMaxRows * kStep);
    std::vector<uint16_t> weights = std::vector<uint16_t>(kMaxRows * kStep);
    std::vector<uint16_t> tail = std::vector<uint16_t>(kMaxDim / 16 * kTileElems);  // a short piece's values (packed, or rows)
    float max[kMaxRows];
    __m512 total[kMaxRows];  // each row's summed weights, 16 lanes of partial sums

    // A task's m query rows (rows [m, D]) in, padded with zero rows to whole tiles, and its sums,
    // weights and running softmax fresh; returns the padded row count.
    int begin(const uint16_t* rows, int m, int dim, int vdim) {
        const int padded = (m + 15) / 16 * 16;
        std::memcpy(q.data(), rows, sizeof(uint16_t) * m * dim);
        std::memset(q.data() + m * dim, 0, sizeof(uint16_t) * (padded - m) * dim);
        std::memset(sums.data(), 0, sizeof(float) * padded * vdim);
        std::memset(weights.data(), 0, sizeof(uint16_t) * padded * kStep);  // padded rows weigh nothing
        for (int r = 0; r < m; ++r) max[r] = kMasked, total[r] = _mm512_setzero_ps();
        return padded;
    }

    // Row r's weighted values over its summed weights into y [Dv] (divided, as merge_partials divides:
    // a row has the same bits whichever of the two finishes it).
    void finish(int r, int vdim, float* y) const {
        const __m512 total_r = _mm512_set1_ps(_mm512_reduce_add_ps(total[r]));
        for (int d = 0; d < vdim; d += 16)
            _mm512_storeu_ps(y + d, _mm512_div_ps(_mm512_loadu_ps(sums.data() + r * vdim + d), total_r));
    }
};

// The sequence whose tasks include `task` (first[s]: sequence s's first task, rising).
inline int64_t owner(const std::vector<int64_t>& first, int64_t task) {
    return std::upper_bound(first.begin(), first.end(), task) - first.begin() - 1;
}

// body(x, task) for tasks [0, tasks) on the OpenMP threads, each thread with its own scratch x and,
// where this process may use AMX tiles, its tiles configured as 16 rows of 64 bytes.
template <typename F>
void run_tasks(int64_t tasks, int threads, F&& body) {
    const bool tiles = amx_usable();
#pragma omp parallel num_threads(threads)
    {
        // kept per thread (a fresh one faults its pages in every call), on the heap: a dlopen'd
        // library's thread-local storage need not keep Scratch's 64-byte alignment
        static thread_local std::unique_ptr<Scratch> kept;
        if (!kept) kept = std::make_unique<Scratch>();
        Scratch& x = *kept;
        x.tiles = tiles;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
        TileConfig config;
        for (int t = 0; t < 8; ++t) config.rows[t] = 16, config.colsb[t] = 64;
        if (tiles) _tile_loadconfig(&config);
#endif
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; ++task) body(x, task);
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
        if (tiles) _tile_release();
#endif
    }
}

// A step's scores and weighted values, on the tiles or on vdpbf16ps as the scratch says.
inline void scores(const Scratch& x, int dim, const uint16_t* const* keys, int pieces, int row_tiles, float* s) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
    if (x.tiles) return score_tiles(x.q.data(), dim, keys, pieces, row_tiles, s);
#endif
    score_dots(x.q.data(), dim, keys, pieces, row_tiles, s);
}

inline void weighted_values(const Scratch& x, const uint16_t* const* values, int pieces, int vdim, int row_tiles,
                            float* sums) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
    if (x.tiles) return value_tiles(x.weights.data(), values, pieces, vdim, row_tiles, sums);
#endif
    value_dots(x.weights.data(), values, pieces, vdim, row_tiles, sums);
}

// 2^x for the softmax's weights (rounded to bfloat16 after), x <= kSlack2: 2^n times 2^r's degree-4
// Taylor polynomial, n = round(x), |r| <= 1/2 (relative error below 5e-5). x is held at -126 and
// above, so that no weight is subnormal (each would cost a microcode assist).
inline __m512 exp2_weights(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_sub_ps(x, n);
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(9.61812911e-3f), r, _mm512_set1_ps(5.55041087e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(2.40226507e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(6.93147181e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

// How far a row's scores may rise above the maximum its weights are taken against before that
// maximum moves (and its sums are rescaled): weights up to e^8, so most steps rescale nothing.
constexpr float kSlack = 8.f;
// The softmax runs in base 2: scores times scale / ln 2, maxima and slack in those units.
constexpr float kLog2e = 1.44269504f, kLn2 = 0.693147181f, kSlack2 = kSlack * kLog2e;

// The keys of 16-key vector i that a row seeing `seen` of the step's keys sees.
inline __mmask16 visible(int seen, int i) {
    const int n = std::clamp(seen - 16 * i, 0, 16);
    return static_cast<__mmask16>((1u << n) - 1);
}

// The running softmax of one step's scores (`vectors` of 16 keys) for rows [0, m): with
// `diagonal`, row r sees the step's first limit(r) keys, else all. Each row's weights e^(scale s -
// max) (as 2^(scale s / ln 2 - max), the row's max kept in those units) rounded to bfloat16 into
// `weights`; where a score passes max + kSlack the row's max moves to its largest score and its
// sums are rescaled.
template <typename Limit>
void softmax_step(Scratch& x, int m, int vdim, int vectors, float scale, bool diagonal, Limit limit) {
    const __m512 masked = _mm512_set1_ps(kMasked), by = _mm512_set1_ps(scale * kLog2e);
    constexpr int kMost = kStep / 16;
    for (int r = 0; r < m; ++r) {
        const int seen = diagonal ? limit(r) : kStep;
        const float* s = x.scores.data() + r * kStep;
        __m512 v[kMost];
        __mmask16 keep[kMost];
        __m512 top = masked;
        for (int i = 0; i < vectors; ++i) {
            keep[i] = visible(seen, i);
            v[i] = _mm512_mask_blend_ps(keep[i], masked, _mm512_mul_ps(_mm512_loadu_ps(s + 16 * i), by));
            top = _mm512_max_ps(top, v[i]);
        }
        if (_mm512_cmp_ps_mask(top, _mm512_set1_ps(x.max[r] + kSlack2), _CMP_GT_OQ)) {
            const float moved = _mm512_reduce_max_ps(top);
            const float c = std::exp2(x.max[r] - moved);  // 0 on the first step (max = kMasked)
            x.total[r] = _mm512_mul_ps(x.total[r], _mm512_set1_ps(c));
            float* o = x.sums.data() + r * vdim;
            for (int d = 0; d < vdim; d += 16) _mm512_storeu_ps(o + d, _mm512_mul_ps(_mm512_loadu_ps(o + d), _mm512_set1_ps(c)));
            x.max[r] = moved;
        }
        const __m512 base = _mm512_set1_ps(x.max[r]);
        uint16_t* w = x.weights.data() + r * kStep;
        for (int i = 0; i < vectors; i += 2) {  // vectors is even: whole 32-key pieces
            const __m512 e0 = _mm512_maskz_mov_ps(keep[i], exp2_weights(_mm512_sub_ps(v[i], base)));
            const __m512 e1 = _mm512_maskz_mov_ps(keep[i + 1], exp2_weights(_mm512_sub_ps(v[i + 1], base)));
            x.total[r] = _mm512_add_ps(x.total[r], _mm512_add_ps(e0, e1));
            _mm512_storeu_si512(w + 16 * i, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));  // keys 16i.. low, 16(i+1).. high
        }
    }
}

// Keys [from, seen) (from a multiple of kPiece) into the task's running softmax and sums.
void steps(Scratch& x, int row_tiles, int m, int dim, int vdim, int64_t from, int64_t seen, const int32_t* table,
           int64_t block_size, const std::vector<int32_t>& slot, const uint16_t* keys, const uint16_t* values,
           int64_t head, int64_t heads, float scale, int64_t first_position, int rows) {
    const int64_t key_tiles = block_size / 16 * (dim / 32), value_tiles_ = block_size / kPiece * (vdim / 16);
    for (int64_t t = from; t < seen; t += kStep) {
        const int count = static_cast<int>(std::min<int64_t>(kStep, seen - t));
        const int pieces = (count + kPiece - 1) / kPiece;
        const uint16_t* k[kStep / kPiece];
        const uint16_t* v[kStep / kPiece];
        for (int j = 0; j < pieces; ++j) {  // a piece lies in one block
            const int64_t at = t + j * kPiece, within = at % block_size;
            const int64_t packed = static_cast<int64_t>(slot[table[at / block_size]]) * heads + head;
            k[j] = keys + (packed * key_tiles + within / 16 * (dim / 32)) * kTileElems;
            v[j] = values + (packed * value_tiles_ + within / kPiece * (vdim / 16)) * kTileElems;
        }
        if (count % kPiece != 0) {  // keys past the chunk may be unwritten: their values zeroed, not multiplied by 0
            const int last = pieces - 1, valid = count - last * kPiece;
            std::memcpy(x.tail.data(), v[last], vdim / 16 * kTileElems * sizeof(uint16_t));
            for (int c = 0; c < vdim / 16; ++c)
                for (int key = valid; key < kPiece; ++key)
                    for (int j = 0; j < 16; ++j) x.tail[c * kTileElems + (key / 2) * 32 + 2 * j + key % 2] = 0;
            v[last] = x.tail.data();
        }
        scores(x, dim, k, pieces, row_tiles, x.scores.data());
        // row r (position first_position + r / rows) sees keys up to its own position: all of a
        // step that ends before the first row's
        const bool diagonal = count < pieces * kPiece || t + pieces * kPiece > first_position + 1;
        softmax_step(x, m, vdim, 2 * pieces, scale, diagonal, [&](int r) {
            return static_cast<int>(std::clamp<int64_t>(first_position + r / rows + 1 - t, 0, count));
        });
        weighted_values(x, v, pieces, vdim, row_tiles, x.sums.data());
    }
}

// ---- few decode rows (fewer than a tile's 16: a sequence's own grouped heads), read in place:
// packing a block costs more than these rows' products over it, so keys and values are read where
// they lie. Scores: each key's dim pairs times a row's query pairs (vdpbf16ps, lanes = pairs), 16
// keys' lanes folded together (sums16); weighted values: two tokens' value rows interleaved into
// pairs in registers (vpermt2w) times each row's pair of weights. Both are compiled for the head
// dim and the rows a block of values takes, so that their sums stay in registers.

// The scores [m rows, count keys] of a step into s (row stride kStep): the step's keys lie in pieces
// of 32 consecutive rows (key[j]: piece j's first key row, P * 32 bfloat16 each; null past the
// step's keys, whose scores are left as they are: the softmax masks them).
template <int P>
inline void scores_direct(const uint16_t* q, int m, const uint16_t* const* key, int pieces, float* s,
                          const uint16_t* const* next_key, const uint16_t* const* next_value, int next_pieces,
                          int vdim) {
    for (int r = 0; r < m; ++r) {
        __m512bh qr[P];
        for (int c = 0; c < P; ++c) qr[c] = (__m512bh)_mm512_loadu_si512(q + r * P * 32 + 32 * c);
        for (int j = 0; j < pieces; ++j)
            for (int h = 0; h < kPiece; h += 16) {
                const uint16_t* k = key[j] + h * P * 32;
                v16 part[16];
                const bool fetch = r == 0 && j < next_pieces;
                for (int t = 0; t < 16; ++t) {
                    if (fetch) {
                        const char* nk = reinterpret_cast<const char*>(next_key[j] + (h + t) * P * 32);
                        const char* nv = reinterpret_cast<const char*>(next_value[j] + (h + t) * vdim);
                        for (int b = 0; b < P * 64; b += 64) _mm_prefetch(nk + b, _MM_HINT_T0);
                        for (int b = 0; b < vdim * 2; b += 64) _mm_prefetch(nv + b, _MM_HINT_T0);
                    }
                    __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_loadu_si512(k + t * P * 32), qr[0]);
                    for (int c = 1; c < P; ++c)
                        a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(k + t * P * 32 + 32 * c), qr[c]);
                    part[t] = (v16)a;
                }
                const v16 total = sums16(part);
                __builtin_memcpy(s + r * kStep + j * kPiece + h, &total, sizeof total);
            }
    }
}

// sums [R rows, 16 N columns] (row stride Dv) += the weights [R rows, the step's keys] (bfloat16,
// row stride kStep) times those keys' values (value[j]: piece j's first value row, from the block's
// column 0 + col; row stride Dv).
template <int R, int N>
inline void values_direct_block(const uint16_t* w, const uint16_t* const* value, int col, int pieces, int vdim,
                                float* sums) {
    // lane 2i takes the first token's column i, lane 2i + 1 the second's (index 32 + i: vpermt2w's second source)
    alignas(64) static constexpr uint16_t kInterleave[32] = {0, 32, 1, 33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
                                                             8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    const __m512i low = _mm512_load_si512(kInterleave), high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
    __m512 a[R][N];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < N; ++c) a[r][c] = _mm512_loadu_ps(sums + r * vdim + c * 16);
    for (int j = 0; j < pieces; ++j) {
        const uint16_t* v = value[j] + col;
        for (int t = 0; t < kPiece; t += 2, v += 2 * vdim) {
            __m512bh x[N];
            for (int c = 0; c < N; c += 2) {  // columns 16c .. 16c + 31 of both tokens (16 at the end of an odd N), in pairs
                const __mmask32 in = c + 1 < N ? ~0u : 0xFFFFu;
                const __m512i u = _mm512_maskz_loadu_epi16(in, v + 16 * c);
                const __m512i y = _mm512_maskz_loadu_epi16(in, v + vdim + 16 * c);
                x[c] = (__m512bh)_mm512_permutex2var_epi16(u, low, y);
                if (c + 1 < N) x[c + 1] = (__m512bh)_mm512_permutex2var_epi16(u, high, y);
            }
            for (int r = 0; r < R; ++r) {
                const __m512bh pair = pair_at(w + r * kStep + j * kPiece + t);
                for (int c = 0; c < N; ++c) a[r][c] = _mm512_dpbf16_ps(a[r][c], x[c], pair);
            }
        }
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < N; ++c) _mm512_storeu_ps(sums + r * vdim + c * 16, a[r][c]);
}

// values_direct_block over every 64 columns and 4 rows (the last block of rows as many as are left).
inline void values_direct(const uint16_t* w, const uint16_t* const* value, int pieces, int vdim, int m, float* sums) {
    const int groups = vdim / 16;
    for (int c0 = 0; c0 < groups; c0 += 4)
        for (int r0 = 0; r0 < m; r0 += 4) {
            const uint16_t* rows = w + r0 * kStep;
            float* o = sums + r0 * vdim + c0 * 16;
            as_constant<4>(m - r0, [&](auto r) {
                as_constant<4>(groups - c0, [&](auto g) { values_direct_block<r(), g()>(rows, value, 16 * c0, pieces, vdim, o); });
            });
        }
}

// Keys [t0, t1) of a sequence (its blocks `table`) into the task's running softmax and sums, for
// its m < 16 rows, all seeing every key. Each step's pieces are located once (a piece lies in one
// block) and the next step's rows are prefetched while this step's scores run. A short last piece
// reads its keys to the end of the block (the softmax masks their scores) and its values from the
// scratch's zero-padded copy: a block's unwritten rows may hold anything, NaN included.
void steps_direct(Scratch& x, int m, int dim, int vdim, int64_t t0, int64_t t1, const int32_t* table,
                  int64_t block_size, const uint16_t* k, const uint16_t* v, int64_t k_blk, int64_t v_blk,
                  float scale) {
    const uint16_t* key[2][kStep / kPiece];
    const uint16_t* value[2][kStep / kPiece];
    auto locate = [&](int64_t t, int i) {  // step t's pieces into key[i], value[i]; their count
        const int pieces = static_cast<int>((std::min<int64_t>(kStep, t1 - t) + kPiece - 1) / kPiece);
        for (int j = 0; j < pieces; ++j) {  // t - t0 is a multiple of kPiece, and t0 of the block size
            const int64_t at = t + j * kPiece, block = table[at / block_size], within = at % block_size;
            key[i][j] = k + block * k_blk + within * dim;
            value[i][j] = v + block * v_blk + within * vdim;
        }
        return pieces;
    };
    int next = locate(t0, 0);
    for (int64_t t = t0, i = 0; t < t1; t += kStep, i ^= 1) {
        const int count = static_cast<int>(std::min<int64_t>(kStep, t1 - t));
        const int pieces = next;
        next = t + kStep < t1 ? locate(t + kStep, i ^ 1) : 0;
        if (const int short_by = pieces * kPiece - count; short_by > 0) {
            const int kept = kPiece - short_by;
            std::memcpy(x.tail.data(), value[i][pieces - 1], sizeof(uint16_t) * kept * vdim);
            std::memset(x.tail.data() + kept * vdim, 0, sizeof(uint16_t) * short_by * vdim);
            value[i][pieces - 1] = x.tail.data();
        }
        as_constant<kMaxDim / 32>(dim / 32, [&](auto p) {
            scores_direct<p()>(x.q.data(), m, key[i], pieces, x.scores.data(), key[i ^ 1], value[i ^ 1], next, vdim);
        });
        softmax_step(x, m, vdim, 2 * pieces, scale, count < pieces * kPiece, [&](int) { return count; });
        values_direct(x.weights.data(), value[i], pieces, vdim, m, x.sums.data());
    }
}

int prefill(const uint16_t* q, const uint16_t* k, const uint16_t* v, const int32_t* tables, const int64_t* starts,
            const int64_t* pasts, float* out, int64_t seqs, int64_t heads, int rows, int dim, int vdim,
            int64_t block_size, int64_t table_stride, int64_t k_blk, int64_t k_h, int64_t v_blk, int64_t v_h,
            float scale, int threads) {
    // blocks each chunk reaches, and those packed: none for a chunk of one query position with fewer
    // rows than a tile (a decode row beside prompt chunks), which reads its blocks in place
    std::vector<int64_t> reach(seqs), packs(seqs);
    std::vector<char> direct(seqs);
    for (int64_t s = 0; s < seqs; ++s) {
        const int64_t n = starts[s + 1] - starts[s];
        if (n < 0 || pasts[s] < 0) return 1;
        reach[s] = (pasts[s] + n + block_size - 1) / block_size;
        direct[s] = n == 1 && rows < 16;
        packs[s] = direct[s] ? 0 : reach[s];
    }
    Packed packed;
    if (!tables_reach(tables, table_stride, reach) ||
        !pack(tables, table_stride, packs, k, v, heads, dim, vdim, block_size, k_blk, k_h, v_blk, v_h, threads, packed))
        return 1;
    const uint16_t* const packed_keys = packed.keys;
    const uint16_t* const packed_values = packed.values;
    const std::vector<int32_t>& slot = packed.slot;

    const int64_t most = kMaxRows / rows;  // query positions a task at most; a chunk's tasks take equal shares
    const int64_t total = starts[seqs];
    std::vector<int64_t> first(seqs + 1, 0);
    for (int64_t s = 0; s < seqs; ++s)
        first[s + 1] = first[s] + heads * ((starts[s + 1] - starts[s] + most - 1) / most);
    const int64_t tasks = first[seqs];
    run_tasks(tasks, threads, [&](Scratch& x, int64_t task) {
        const int64_t s = owner(first, task);
        const int64_t n = starts[s + 1] - starts[s], query_blocks = (n + most - 1) / most;
        const int64_t per_task = (n + query_blocks - 1) / query_blocks;
        const int64_t local = task - first[s], h = local / query_blocks;
        const int64_t i0 = (local % query_blocks) * per_task, i1 = std::min(n, i0 + per_task);
        const int m = static_cast<int>((i1 - i0) * rows);
        const int64_t offset = (h * total + starts[s] + i0) * rows;  // the task's first row in q and out
        const int padded = x.begin(q + offset * dim, m, dim, vdim);
        const int32_t* table = tables + s * table_stride;
        if (direct[s])  // its one position sees keys 0 .. pasts[s]
            steps_direct(x, m, dim, vdim, 0, pasts[s] + 1, table, block_size, k + h * k_h, v + h * v_h, k_blk, v_blk,
                         scale);
        else  // the task's last query sees keys 0 .. pasts[s] + i1 - 1
            steps(x, padded / 16, m, dim, vdim, 0, pasts[s] + i1, table, block_size, slot, packed_keys, packed_values,
                  h, heads, scale, pasts[s] + i0, rows);
        for (int r = 0; r < m; ++r) x.finish(r, vdim, out + (offset + r) * vdim);
    });
    return 0;
}

// Decode rows over their sequences' blocks, not causal: sequence s's `rows` rows (several
// sequences' grouped heads stacked, for a shared prefix's pass) all see its first lengths[s]
// tokens. Tasks (sequence, head, a run of blocks_per_task blocks) each take their run's keys as a
// prefill task takes a step's, into a Partial; the runs of a (sequence, head) are then merged
// (partials.h, as float_decode.cpp merges its tasks).
int decode(const uint16_t* q, const uint16_t* k, const uint16_t* v, const int32_t* tables, const int64_t* lengths,
           float* out, float* lse, int64_t seqs, int64_t heads, int rows, int dim, int vdim, int64_t block_size,
           int64_t table_stride, int64_t k_blk, int64_t k_h, int64_t v_blk, int64_t v_h, int64_t blocks_per_task,
           float scale, int threads) {
    if (blocks_per_task < 1) return 1;
    std::vector<int64_t> reach(seqs), first(seqs + 1, 0);  // blocks a sequence reaches; its first task
    for (int64_t s = 0; s < seqs; ++s) {
        if (lengths[s] < 0) return 1;
        reach[s] = (lengths[s] + block_size - 1) / block_size;
        first[s + 1] = first[s] + heads * std::max<int64_t>(1, (reach[s] + blocks_per_task - 1) / blocks_per_task);
    }
    const bool direct = rows < 16;  // fewer rows than a tile: read in place, not packed
    Packed packed;
    if (direct ? !tables_reach(tables, table_stride, reach)
               : !pack(tables, table_stride, reach, k, v, heads, dim, vdim, block_size, k_blk, k_h, v_blk, v_h,
                       threads, packed))
        return 1;
    const int64_t tasks = first[seqs], run = blocks_per_task * block_size;
    // the calling thread's, grown, not freed (fresh ones fault their pages in every call); named
    // through references, which the tasks' threads see (a thread_local's name there is their own)
    static thread_local std::vector<Partial> kept_parts;
    static thread_local std::vector<float> kept_accs;
    std::vector<Partial>& parts = kept_parts;
    std::vector<float>& accs = kept_accs;
    if (parts.size() < static_cast<size_t>(tasks)) parts.resize(tasks);
    if (accs.size() < static_cast<size_t>(tasks) * rows * vdim) accs.resize(static_cast<size_t>(tasks) * rows * vdim);
    run_tasks(tasks, threads, [&](Scratch& x, int64_t task) {
        const int64_t s = owner(first, task);
        const int64_t per_head = (first[s + 1] - first[s]) / heads, local = task - first[s];
        const int64_t h = local / per_head, t0 = (local % per_head) * run, t1 = std::min(lengths[s], t0 + run);
        Partial& part = parts[task];
        if (t1 <= t0) {  // an empty sequence: a part the merge skips
            for (int r = 0; r < rows; ++r) part.max[r] = kMasked, part.sum[r] = 0.f;
            return;
        }
        const int padded = x.begin(q + (s * heads + h) * rows * dim, rows, dim, vdim);
        if (direct)
            steps_direct(x, rows, dim, vdim, t0, t1, tables + s * table_stride, block_size, k + h * k_h,
                         v + h * v_h, k_blk, v_blk, scale);
        else  // every row at position t1 - 1: it sees all of the run
            steps(x, padded / 16, rows, dim, vdim, t0, t1, tables + s * table_stride, block_size, packed.slot,
                  packed.keys, packed.values, h, heads, scale, t1 - 1, rows);
        for (int r = 0; r < rows; ++r) part.max[r] = x.max[r] * kLn2, part.sum[r] = _mm512_reduce_add_ps(x.total[r]);
        std::memcpy(accs.data() + task * rows * vdim, x.sums.data(), sizeof(float) * rows * vdim);
    });
#pragma omp parallel for num_threads(threads)
    for (int64_t sh = 0; sh < seqs * heads; ++sh) {  // each (sequence, head)'s runs merged
        const int64_t s = sh / heads, per_head = (first[s + 1] - first[s]) / heads;
        const int64_t base = first[s] + (sh % heads) * per_head;
        merge_partials(parts.data() + base, accs.data() + base * rows * vdim, per_head, rows, vdim, out + sh * rows * vdim,
                       lse == nullptr ? nullptr : lse + sh * rows);
    }
    return 0;
}
#endif

}  // namespace

extern "C" {

// How this build and CPU multiply: 2 on AMX tiles (the process may use them, oneDNN not capped
// below them), 1 on AVX-512 BF16's vdpbf16ps, 0 neither (the entries below then return 2).
int kv_bf16_attention_kernel() { return !kDots ? 0 : amx_usable() ? 2 : 1; }

int kv_bf16_prefill(const uint16_t* q, const uint16_t* k, const uint16_t* v, const int32_t* tables,
                    const int64_t* starts, const int64_t* pasts, float* out, int64_t seqs, int64_t heads, int rows,
                    int dim, int vdim, int64_t block_size, int64_t table_stride, int64_t k_blk, int64_t k_h,
                    int64_t v_blk, int64_t v_h, float scale, int threads) {
    if (!fits(rows, dim, vdim, block_size)) return 2;
#if defined(__AVX512BF16__)
    return prefill(q, k, v, tables, starts, pasts, out, seqs, heads, rows, dim, vdim, block_size, table_stride, k_blk,
                   k_h, v_blk, v_h, scale, threads);
#else
    (void)q, (void)k, (void)v, (void)tables, (void)starts, (void)pasts, (void)out, (void)seqs, (void)heads;
    (void)table_stride, (void)k_blk, (void)k_h, (void)v_blk, (void)v_h, (void)scale, (void)threads;
    return 2;
#endif
}

// Decode rows of bfloat16 queries q [S, Hkv, R, D] over bfloat16 pool blocks, not causal: sequence
// s's R rows all see its first lengths[s] tokens, in blocks tables[s] (int32 [S, table_stride]).
// out float32 [S, Hkv, R, Dv]; lse (or null) float32 [S, Hkv, R], each row's log-sum-exp of its
// scaled scores (-inf for a sequence of length 0, whose rows get zeros). Returns as kv_bf16_prefill.
int kv_bf16_decode(const uint16_t* q, const uint16_t* k, const uint16_t* v, const int32_t* tables,
                   const int64_t* lengths, float* out, float* lse, int64_t seqs, int64_t heads, int rows, int dim,
                   int vdim, int64_t block_size, int64_t table_stride, int64_t k_blk, int64_t k_h, int64_t v_blk,
                   int64_t v_h, int64_t blocks_per_task, float scale, int threads) {
    if (!fits(rows, dim, vdim, block_size)) return 2;
#if defined(__AVX512BF16__)
    return decode(q, k, v, tables, lengths, out, lse, seqs, heads, rows, dim, vdim, block_size, table_stride, k_blk,
                  k_h, v_blk, v_h, blocks_per_task, scale, threads);
#else
    (void)q, (void)k, (void)v, (void)tables, (void)lengths, (void)out, (void)lse, (void)seqs, (void)heads;
    (void)table_stride, (void)k_blk, (void)k_h, (void)v_blk, (void)v_h, (void)blocks_per_task, (void)scale, (void)threads;
    return 2;
#endif
}

}  // extern "C"
