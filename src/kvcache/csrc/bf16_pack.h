// Pool blocks packed into bfloat16 pair layouts, for bf16_attention.cpp: the keys and values of
// every (block, head) a call reaches, packed once per call into buffers the calling thread keeps.
// The layouts are AMX tiles' operands, and equally vdpbf16ps's: a 64-byte row holds 16 lanes of
// two bfloat16 values each, the two that one lane's dot product adds.
//
//   keys    [bs/16][D/32] tiles of 16 dim pairs x 16 tokens x 2 (pack_keys)
//   values  [bs/32][Dv/16] tiles of 16 token pairs x 16 columns x 2 (pack_values)
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include <immintrin.h>

namespace kv {

constexpr int kPiece = 32;       // keys a weights tile multiplies (two 16-key score tiles), within one block
constexpr int kTileElems = 512;  // bfloat16 elements of a 1 KB operand tile

#if defined(__AVX512BF16__)

// One (block, head)'s keys [bs, D] as [bs/16][D/32] tiles: tile (g, c)'s row p holds dims
// 32c + 2p and 32c + 2p + 1 of tokens 16g .. 16g + 15, in pairs (a row gathered from 16 tokens).
inline void pack_keys(const uint16_t* k, int64_t bs, int dim, uint16_t* out) {
    const int pieces = dim / 32;
    const __m512i token = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                             _mm512_set1_epi32(dim / 2));  // each token's first pair
    for (int64_t g = 0; g < bs / 16; ++g)
        for (int c = 0; c < pieces; ++c) {
            uint16_t* tile = out + (g * pieces + c) * kTileElems;
            const uint16_t* first = k + g * 16 * dim + c * 32;
            for (int p = 0; p < 16; ++p)
                _mm512_storeu_si512(tile + p * 32, _mm512_i32gather_epi32(token, first + 2 * p, 4));
        }
}

// One (block, head)'s values [bs, Dv] as [bs/32][Dv/16] tiles: tile (s, c)'s row p holds columns
// 16c .. 16c + 15 of tokens 32s + 2p and 32s + 2p + 1, interleaved.
inline void pack_values(const uint16_t* v, int64_t bs, int vdim, uint16_t* out) {
    const int pieces = vdim / 16;
    for (int64_t s = 0; s < bs / kPiece; ++s)
        for (int c = 0; c < pieces; ++c) {
            uint16_t* tile = out + (s * pieces + c) * kTileElems;
            for (int p = 0; p < 16; ++p) {
                const uint16_t* a = v + (kPiece * s + 2 * p) * vdim + 16 * c;
                const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a));
                const __m256i y = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + vdim));
                // in-lane interleaves give columns 0-3 + 8-11 and 4-7 + 12-15
                const __m256i lo = _mm256_unpacklo_epi16(x, y), hi = _mm256_unpackhi_epi16(x, y);
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(tile + p * 32), _mm256_permute2x128_si256(lo, hi, 0x20));
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(tile + p * 32 + 16), _mm256_permute2x128_si256(lo, hi, 0x31));
            }
        }
}

// The blocks in use, packed once each per head: `slot[id]` is block id's place (-1: not reached),
// `keys` / `values` its packed tiles at (slot * heads + head) * the block's elements.
struct Packed {
    std::vector<int32_t> slot;
    const uint16_t* keys = nullptr;
    const uint16_t* values = nullptr;
};

// Whether the first reach[s] entries of every table row s are block ids: within the table's
// width and none negative.
inline bool tables_reach(const int32_t* tables, int64_t table_stride, const std::vector<int64_t>& reach) {
    for (size_t s = 0; s < reach.size(); ++s) {
        if (reach[s] > table_stride) return false;
        for (int64_t b = 0; b < reach[s]; ++b)
            if (tables[s * table_stride + b] < 0) return false;
    }
    return true;
}

// Packs the first reach[s] blocks of every table row s; false where tables_reach is.
inline bool pack(const int32_t* tables, int64_t table_stride, const std::vector<int64_t>& reach, const uint16_t* k,
          const uint16_t* v, int64_t heads, int dim, int vdim, int64_t block_size, int64_t k_blk, int64_t k_h,
          int64_t v_blk, int64_t v_h, int threads, Packed& packed) {
    if (!tables_reach(tables, table_stride, reach)) return false;
    const int64_t seqs = static_cast<int64_t>(reach.size());
    int32_t top = -1;
    for (int64_t s = 0; s < seqs; ++s)
        for (int64_t b = 0; b < reach[s]; ++b) top = std::max(top, tables[s * table_stride + b]);
    std::vector<int32_t>& slot = packed.slot;
    slot.assign(static_cast<size_t>(top) + 1, -1);
    std::vector<int32_t> used;
    for (int64_t s = 0; s < seqs; ++s)
        for (int64_t b = 0; b < reach[s]; ++b) {
            const int32_t id = tables[s * table_stride + b];
            if (slot[id] < 0) slot[id] = static_cast<int32_t>(used.size()), used.push_back(id);
        }
    const int64_t key_elems = block_size * dim, value_elems = block_size * vdim;
    // the calling thread's packing buffers, kept between calls (grown, never zeroed: every element
    // used is written below), so a long past is not mapped afresh at every layer
    thread_local std::unique_ptr<uint16_t[]> keys, values;
    thread_local size_t held = 0;
    const size_t need = used.size() * heads * std::max(key_elems, value_elems);
    if (need > held) keys.reset(new uint16_t[need]), values.reset(new uint16_t[need]), held = need;
    uint16_t* const packed_keys = keys.get();  // (thread_local: read here, not in the OpenMP workers)
    uint16_t* const packed_values = values.get();
    const int64_t packs = static_cast<int64_t>(used.size()) * heads;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < packs; ++i) {
        const int64_t block = used[i / heads], h = i % heads;
        pack_keys(k + block * k_blk + h * k_h, block_size, dim, packed_keys + i * key_elems);
        pack_values(v + block * v_blk + h * v_h, block_size, vdim, packed_values + i * value_elems);
    }
    packed.keys = packed_keys;
    packed.values = packed_values;
    return true;
}

#endif

}  // namespace kv
