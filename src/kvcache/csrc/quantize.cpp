// Per-token quantization of float32 keys and values (kvcache.formats.quant.quantize_per_token), in one call.
//
// A plain C entry point called through ctypes (kvcache.formats.quant_native). It computes exactly what the
// PyTorch path computes, bit for bit, so either may run: per group of `group` consecutive channels
// of a token, the minimum m and maximum M; the scale
//   s = (M - m) / levels * (1 + 2**-40)   in float64, rounded up to the next float32 (levels = 2**bits - 1),
// and the codes round((x - m) / s) clamped to [0, levels], in float32 (round half to even, as
// torch.round; a constant group divides by 1). 4- and 2-bit codes are packed lowest bits first:
// element per_byte * i + j in bits [bits * j, bits * (j + 1)) of byte i. The sources build without
// -ffast-math, so float32 arithmetic here is IEEE arithmetic, as torch's.
//
// Returns 0; 1 for a shape it does not take; 2 when a value is not finite or has magnitude 2**126
// or more (the caller then runs the PyTorch path, which says which).

#include <cmath>
#include <cstdint>

namespace {

constexpr double kLimit = 85070591730234615865843651857942052864.0;  // 2**126
constexpr int kMaxGroup = 4096;

// One token's `dim` channels: codes (unpacked, one a byte) and each group's scale and minimum.
// Returns false for a value out of range.
bool quantize_token(const float* __restrict x, int dim, int group, int levels, uint8_t* __restrict codes,
                    float* __restrict scale, float* __restrict minimum) {
    for (int g = 0; g * group < dim; ++g) {
        const float* xg = x + g * group;
        float lo = xg[0], hi = xg[0];
        bool ok = true;
        for (int i = 0; i < group; ++i) {
            const float v = xg[i];
            ok &= std::fabs(static_cast<double>(v)) < kLimit;  // false for nan too
            lo = v < lo ? v : lo;
            hi = v > hi ? v : hi;
        }
        if (!ok) return false;
        const double exact = (static_cast<double>(hi) - static_cast<double>(lo)) / levels * (1.0 + 0x1p-40);
        float s = static_cast<float>(exact);
        if (static_cast<double>(s) < exact) s = std::nextafter(s, INFINITY);
        const float divisor = s == 0.f ? 1.f : s, top = static_cast<float>(levels);
        uint8_t* cg = codes + g * group;
        for (int i = 0; i < group; ++i) {
            float c = std::nearbyint((xg[i] - lo) / divisor);
            c = c < 0.f ? 0.f : (c > top ? top : c);
            cg[i] = static_cast<uint8_t>(c);
        }
        scale[g] = s;
        minimum[g] = lo;
    }
    return true;
}

}  // namespace

extern "C" {

// x float32 contiguous [rows, dim] -> codes uint8 [rows, dim * bits / 8], scale and minimum float32
// [rows, dim / group], all contiguous. Rows are split across `threads` OpenMP threads when there are
// many (a prompt), not for a decode step's few.
int kv_quantize_per_token(const float* x, uint8_t* codes, float* scale, float* minimum, int64_t rows, int dim,
                          int group, int bits, int threads) {
    if ((bits != 2 && bits != 4 && bits != 8) || dim < 1 || group < 1 || group > kMaxGroup || dim % group ||
        dim % (8 / bits) || rows < 0)
        return 1;
    const int per_byte = 8 / bits, levels = (1 << bits) - 1, packed = dim / per_byte, groups = dim / group;
    int bad = 0;
#pragma omp parallel num_threads(threads) if (rows * dim >= (1 << 16)) reduction(| : bad)
    {
        uint8_t* unpacked = new uint8_t[dim];
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r) {
            if (!quantize_token(x + r * dim, dim, group, levels, unpacked, scale + r * groups, minimum + r * groups)) {
                bad |= 1;
                continue;
            }
            uint8_t* out = codes + r * packed;
            for (int i = 0; i < packed; ++i) {
                uint8_t byte = 0;
                for (int j = 0; j < per_byte; ++j) byte |= static_cast<uint8_t>(unpacked[per_byte * i + j] << (bits * j));
                out[i] = byte;
            }
        }
        delete[] unpacked;
    }
    return bad ? 2 : 0;
}

}  // extern "C"
