// Softmax attention over parts of a sequence's keys, and their merge (float_decode.cpp's tasks,
// bf16_attention.cpp's runs of blocks): a part keeps, per query row, the maximum its weights are taken
// against, their sum, and the weighted values relative to that maximum (acc [rows, Dv]); merged, every
// part is weighted by exp(its maximum - the largest).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace kv {

// The score of a masked key: finite (so no infinity meets the exponent), below any real score.
constexpr float kMasked = -1.0e30f;
// Query rows a Partial holds.
constexpr int kPartialRows = 64;

struct Partial {
    float max[kPartialRows];
    float sum[kPartialRows];
};

// The normalised output [rows, vdim] of `count` partials of one (batch, head) (consecutive, each
// with its acc [rows, vdim] relative to its own max): every partial weighted by exp(its max - the
// largest); a row no partial saw gets zeros.
// With `lse`, each row's log of its summed weights (max + log sum; -inf for a row no partial saw),
// so that attention over another part of the keys can be merged with this one.
inline void merge_partials(const Partial* parts, const float* accs, int64_t count, int rows, int vdim, float* out,
                           float* lse = nullptr) {
    for (int r = 0; r < rows; ++r) {
        float m = kMasked;
        for (int64_t c = 0; c < count; ++c)
            if (parts[c].sum[r] > 0.f && parts[c].max[r] > m) m = parts[c].max[r];
        float total = 0.f;
        float* o = out + static_cast<int64_t>(r) * vdim;
        std::memset(o, 0, sizeof(float) * vdim);
        for (int64_t c = 0; c < count; ++c) {
            if (!(parts[c].sum[r] > 0.f)) continue;
            const float w = std::exp(parts[c].max[r] - m);
            total += parts[c].sum[r] * w;
            const float* a = accs + (c * rows + r) * vdim;
            for (int d = 0; d < vdim; ++d) o[d] += w * a[d];
        }
        if (total > 0.f)
            for (int d = 0; d < vdim; ++d) o[d] /= total;
        if (lse != nullptr) lse[r] = total > 0.f ? m + std::log(total) : -INFINITY;
    }
}

}  // namespace kv
