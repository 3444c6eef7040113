// A prompt store entry streamed into a cache's buffers (kvcache.prompts.stream).
//
// One plain C entry point, called through ctypes with raw pointers (no Python or torch headers).
// It walks an entry's bytes once, 4096-byte block by block: with a key, it folds each block into
// its two 64-bit sums (the entry checksum, kvcache.prompts.checksum: the Python reference there
// defines it and the tests hold this code to it), then copies the parts of the copy runs that lie
// in the block to their destinations while the block is still in L1. So each byte is read from
// memory once and written once, and the checksum costs next to nothing over the copy. The writes
// are non-temporal where the CPU has AVX2: a cache's buffers are far larger than the caches, and
// a plain store would first read every destination line from memory.
//
//   src      uint8 [n]             the entry's bytes
//   key      uint32 [1026] or null null: copy only (a signed store checks its HMAC itself)
//   sums     uint64 [ceil(n / 4096), 2]  written with a key: each block's two sums
//   runs     copy runs sorted by offset: bytes [offsets[j], offsets[j] + lengths[j]) of src go to
//            the address targets[j]; each must lie inside src (else -1 is returned, nothing done)
//
// A block's sums: its 1024 little-endian 32-bit words w, zero-padded past the end of src, taken
// in pairs, s_t = sum over pairs i of (w[2i] + key[2i + 2t]) * (w[2i + 1] + key[2i + 2t + 1]),
// the additions mod 2^32, the products and the sum mod 2^64, for t = 0 and 1.

#include <algorithm>
#include <cstdint>
#include <cstring>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 4096;
constexpr int64_t kWords = kBlock / 4;

// memcpy, with non-temporal stores for the 32-byte-aligned middle of the destination.
void put(uint8_t* dst, const uint8_t* src, int64_t n) {
#if defined(__AVX2__)
  const int64_t head = std::min<int64_t>(n, (32 - reinterpret_cast<uintptr_t>(dst) % 32) % 32);
  std::memcpy(dst, src, head);
  dst += head, src += head, n -= head;
  for (; n >= 32; n -= 32, dst += 32, src += 32) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
  }
#endif
  std::memcpy(dst, src, n);
}

// A lane of 64 bits holds a pair (w[2i] low, w[2i + 1] high); the key is added per 32-bit half,
// and the halves multiplied with the widening multiply of the low halves of 64-bit lanes.
#if defined(__AVX512F__)
inline __m512i products(__m512i words, const uint32_t* key) {
  const __m512i x = _mm512_add_epi32(words, _mm512_loadu_si512(key));
  return _mm512_mul_epu32(x, _mm512_srli_epi64(x, 32));
}

void fold(const uint8_t* block, const uint32_t* key, uint64_t* out) {
  __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
  for (int64_t i = 0; i < kWords; i += 16) {
    const __m512i w = _mm512_loadu_si512(block + 4 * i);
    s0 = _mm512_add_epi64(s0, products(w, key + i));
    s1 = _mm512_add_epi64(s1, products(w, key + i + 2));
  }
  out[0] = _mm512_reduce_add_epi64(s0);
  out[1] = _mm512_reduce_add_epi64(s1);
}
#else
void fold(const uint8_t* block, const uint32_t* key, uint64_t* out) {
  uint64_t s0 = 0, s1 = 0;
  for (int64_t i = 0; i < kWords; i += 2) {
    uint32_t a, b;  // little-endian hosts only (the Python side checks)
    std::memcpy(&a, block + 4 * i, 4);
    std::memcpy(&b, block + 4 * i + 4, 4);
    s0 += uint64_t(uint32_t(a + key[i])) * uint32_t(b + key[i + 1]);
    s1 += uint64_t(uint32_t(a + key[i + 2])) * uint32_t(b + key[i + 3]);
  }
  out[0] = s0;
  out[1] = s1;
}
#endif

// Non-temporal stores are weakly ordered: made visible before the caller reads the buffers.
inline void fence() {
#if defined(__AVX2__)
  _mm_sfence();
#endif
}

}  // namespace

extern "C" int kv_entry_stream(const uint8_t* src, int64_t n, const uint32_t* key, uint64_t* sums, int64_t runs,
                               const int64_t* offsets, const int64_t* lengths, const int64_t* targets) {
  for (int64_t j = 0; j < runs; ++j) {
    if (offsets[j] < 0 || lengths[j] < 0 || offsets[j] > n - lengths[j] || (j > 0 && offsets[j] < offsets[j - 1])) {
      return -1;
    }
  }
  alignas(64) uint8_t tail[kBlock];
  int64_t first = 0;  // runs before it ended before the current block
  for (int64_t start = 0; start < n; start += kBlock) {
    const int64_t end = std::min(start + kBlock, n);
    if (key != nullptr) {
      const uint8_t* block = src + start;
      if (end - start < kBlock) {
        std::memset(tail, 0, kBlock);
        std::memcpy(tail, block, end - start);
        block = tail;
      }
      fold(block, key, sums + 2 * (start / kBlock));
    }
    for (int64_t j = first; j < runs && offsets[j] < end; ++j) {
      const int64_t lo = std::max(offsets[j], start), hi = std::min(offsets[j] + lengths[j], end);
      if (lo < hi) {
        put(reinterpret_cast<uint8_t*>(targets[j]) + (lo - offsets[j]), src + lo, hi - lo);
      }
    }
    while (first < runs && offsets[first] + lengths[first] <= end) {
      ++first;
    }
  }
  fence();
  return 0;
}
