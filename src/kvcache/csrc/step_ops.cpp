// A decode step's hot operators as C++ kernels of torch's dispatcher: the panel linear layer
// (`kvcache::panel_linear`) and paged decode attention (`kvcache::paged_decode`,
// `kvcache::paged_decode_lse`). Declared through torch's stable C ABI (no ATen headers: a second or
// two to build), so a compiled step, and an eager one, reaches the kernels without running Python:
// about 2 us a call against 20-25 us through a Python kernel on a 2-core Xeon, at some 270 calls a
// SmolLM2 step.
//
// The kernels themselves live in the other libraries (linear.cpp, float_decode.cpp,
// bf16_attention.cpp), each loaded once by Python; the kv_step_ops_bind_* calls hand their entry
// points here (the one way in: this file links none of them). Until then an operator raises.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

namespace {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

using LinearFn = void (*)(const void* x, int64_t count, int64_t k, int64_t x_stride, const void* panels, int64_t n,
                          const void* bias, void* out, int64_t out_stride, int threads);
using FloatDecodeFn = int (*)(const float* q, const void* k, const void* v, const int32_t* tables,
                              const int64_t* lengths, float* out, float* lse, int dtype, int64_t seqs, int64_t heads,
                              int rows, int dim, int vdim, int64_t block_size, int64_t table_stride, int64_t k_blk,
                              int64_t k_h, int64_t v_blk, int64_t v_h, int64_t blocks_per_task, float scale,
                              float softcap, int threads);
using Bf16DecodeFn = int (*)(const void* q, const void* k, const void* v, const int32_t* tables,
                             const int64_t* lengths, float* out, float* lse, int64_t seqs, int64_t heads, int rows,
                             int dim, int vdim, int64_t block_size, int64_t table_stride, int64_t k_blk, int64_t k_h,
                             int64_t v_blk, int64_t v_h, int64_t blocks_per_task, float scale, int threads);

struct Bound {
    LinearFn linear_f32 = nullptr, linear_bf16 = nullptr;
    FloatDecodeFn float_decode = nullptr;
    Bf16DecodeFn bf16_decode = nullptr;  // null where the bfloat16 library is absent or multiplies nothing
    int64_t max_rows = 0, max_dim = 0, min_chunk = 0;
};
Bound bound;

// x [..., K] times the weight packed as panels [P, K, 16] (panels.py's pack), plus bias [n]: [..., n],
// every tensor of the panels' dtype (float32 or bfloat16) on the CPU.
Tensor panel_linear(Tensor x, Tensor panels, int64_t n, std::optional<Tensor> bias) {
    STD_TORCH_CHECK(bound.linear_f32 != nullptr, "kvcache::panel_linear: the panel library is not bound");
    const ScalarType dtype = panels.scalar_type();
    STD_TORCH_CHECK(panels.dim() == 3 && panels.size(2) == 16 && panels.is_contiguous() &&
                        (dtype == ScalarType::Float || dtype == ScalarType::BFloat16),
                    "kvcache::panel_linear: panels must be contiguous float32 or bfloat16 [P, K, 16]");
    const int64_t k = panels.size(1);
    STD_TORCH_CHECK(x.is_cpu() && x.scalar_type() == dtype && x.dim() >= 1 && x.size(x.dim() - 1) == k &&
                        n > 0 && n <= panels.size(0) * 16,
                    "kvcache::panel_linear: expected x [..., ", k, "] of the panels' dtype on the CPU and 0 < n <= ",
                    panels.size(0) * 16);
    const LinearFn fn = dtype == ScalarType::Float ? bound.linear_f32 : bound.linear_bf16;
    STD_TORCH_CHECK(fn != nullptr, "kvcache::panel_linear: the panel library takes no bfloat16 here");
    const void* b = nullptr;
    std::optional<Tensor> held;  // a contiguous copy of the bias, when it was not
    if (bias.has_value()) {
        STD_TORCH_CHECK(bias->scalar_type() == dtype && bias->dim() == 1 && bias->size(0) == n,
                        "kvcache::panel_linear: bias must be [", n, "] of the panels' dtype");
        held = bias->is_contiguous() ? *bias : torch::stable::contiguous(*bias);
        b = held->data_ptr();
    }
    const int64_t count = x.numel() / k;
    Tensor rows = x;  // [count, K] with row stride K where x is contiguous (a call less)
    int64_t stride = k;
    if (!x.is_contiguous()) {
        rows = torch::stable::reshape(x, {count, k});
        if (rows.stride(1) != 1 || rows.stride(0) < k) rows = torch::stable::contiguous(rows);
        stride = rows.stride(0);
    }
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = n;
    Tensor out = torch::stable::empty(shape, dtype);
    if (count > 0)
        fn(rows.data_ptr(), count, k, stride, panels.data_ptr(), n, b, out.data_ptr(), n,
           static_cast<int>(torch::stable::get_num_threads()));
    return out;
}

// Whether pools [blocks, Hkv, block_size, D] fit the paged kernels for q [S, Hkv, R, D] (native.py's
// _pool_fits and its table checks).
void check_pools(const Tensor& q, const Tensor& keys, const Tensor& values, const Tensor& tables,
                 const Tensor& lengths) {
    STD_TORCH_CHECK(q.dim() == 4 && keys.dim() == 4 && values.dim() == 4, "kvcache::paged_decode: expected q ",
                    "[S, Hkv, R, D] and pools [blocks, Hkv, block_size, D]");
    const int64_t seqs = q.size(0), heads = q.size(1), rows = q.size(2), dim = q.size(3), vdim = values.size(3);
    const ScalarType dtype = keys.scalar_type();
    STD_TORCH_CHECK(keys.is_cpu() && (dtype == ScalarType::Float || dtype == ScalarType::BFloat16) &&
                        values.scalar_type() == dtype && keys.size(1) == heads && keys.size(3) == dim &&
                        values.size(0) == keys.size(0) && values.size(1) == heads && values.size(2) == keys.size(2) &&
                        keys.stride(3) == 1 && keys.stride(2) == dim && values.stride(3) == 1 &&
                        values.stride(2) == vdim && rows >= 1 && rows <= bound.max_rows && dim >= 1 &&
                        dim <= bound.max_dim && vdim >= 1 && vdim <= bound.max_dim,
                    "kvcache::paged_decode: the library cannot take queries [", seqs, ", ", heads, ", ", rows, ", ",
                    dim, "] over blocks [", keys.size(0), ", ", keys.size(1), ", ", keys.size(2), ", ", keys.size(3),
                    "] (CPU float32 or bfloat16, token rows contiguous, at most ", bound.max_rows, " rows and ",
                    bound.max_dim, " dims expected)");
    STD_TORCH_CHECK(tables.scalar_type() == ScalarType::Int && tables.dim() == 2 && tables.size(0) == seqs &&
                        tables.stride(1) == 1 && lengths.scalar_type() == ScalarType::Long && lengths.dim() == 1 &&
                        lengths.size(0) == seqs && lengths.is_contiguous(),
                    "kvcache::paged_decode: expected int32 tables [S, width] (rows contiguous) and int64 lengths [S]");
}

// Decode attention of q [S, Hkv, R, D] over pool blocks, as native.paged_decode: float32
// [S, Hkv, R, Dv], each row's log-sum-exp into lse (float32 [S, Hkv, R]) where it is not null.
Tensor decode(const Tensor& q, const Tensor& keys, const Tensor& values, const Tensor& tables, const Tensor& lengths,
              double scale, float* lse) {
    STD_TORCH_CHECK(bound.float_decode != nullptr, "kvcache::paged_decode: the decode library is not bound");
    const int64_t seqs = q.size(0), heads = q.size(1), block_size = keys.size(2);
    const int rows = static_cast<int>(q.size(2)), dim = static_cast<int>(q.size(3)),
              vdim = static_cast<int>(values.size(3));
    const int64_t per_task = std::max<int64_t>(1, bound.min_chunk / block_size);
    const int threads = static_cast<int>(torch::stable::get_num_threads());
    Tensor out = torch::stable::empty({seqs, heads, static_cast<int64_t>(rows), static_cast<int64_t>(vdim)},
                                      ScalarType::Float);
    float* o = static_cast<float*>(out.data_ptr());
    const int32_t* t = static_cast<const int32_t*>(tables.data_ptr());
    const int64_t* n = static_cast<const int64_t*>(lengths.data_ptr());
    const bool half = q.scalar_type() == ScalarType::BFloat16 && keys.scalar_type() == ScalarType::BFloat16;
    if (half && bound.bf16_decode != nullptr) {
        Tensor qc = q.is_contiguous() ? q : torch::stable::contiguous(q);
        if (bound.bf16_decode(qc.data_ptr(), keys.data_ptr(), values.data_ptr(), t, n, o, lse, seqs, heads, rows, dim,
                              vdim, block_size, tables.stride(0), keys.stride(0), keys.stride(1), values.stride(0),
                              values.stride(1), per_task, static_cast<float>(scale), threads) == 0)
            return out;
    }
    Tensor qf = torch::stable::contiguous(torch::stable::to(q, ScalarType::Float));
    const int failed = bound.float_decode(
        static_cast<const float*>(qf.data_ptr()), keys.data_ptr(), values.data_ptr(), t, n, o, lse,
        keys.scalar_type() == ScalarType::Float ? 0 : 1, seqs, heads, rows, dim, vdim, block_size, tables.stride(0),
        keys.stride(0), keys.stride(1), values.stride(0), values.stride(1), per_task, static_cast<float>(scale), 0.f,
        threads);
    STD_TORCH_CHECK(failed == 0, "kvcache::paged_decode: the library refused the call (a negative length, or one ",
                    "past the blocks its table row holds)");
    return out;
}

std::tuple<Tensor, Tensor> paged_decode_lse(Tensor q, Tensor keys, Tensor values, Tensor tables, Tensor lengths,
                                            double scale) {
    check_pools(q, keys, values, tables, lengths);
    Tensor lse = torch::stable::empty({q.size(0), q.size(1), q.size(2)}, ScalarType::Float);
    Tensor out = decode(q, keys, values, tables, lengths, scale, static_cast<float*>(lse.data_ptr()));
    return {out, lse};
}

Tensor paged_decode(Tensor q, Tensor keys, Tensor values, Tensor tables, Tensor lengths, double scale) {
    check_pools(q, keys, values, tables, lengths);
    return decode(q, keys, values, tables, lengths, scale, nullptr);  // no log-sum-exps computed
}

}  // namespace

extern "C" {

// The panel library's entry points (linear.cpp's kv_linear and kv_linear_bf16; the second may be null).
void kv_step_ops_bind_linear(void* linear_f32, void* linear_bf16) {
    bound.linear_f32 = reinterpret_cast<LinearFn>(linear_f32);
    bound.linear_bf16 = reinterpret_cast<LinearFn>(linear_bf16);
}

// The decode libraries' entry points (float_decode.cpp's kv_paged_decode, bf16_attention.cpp's
// kv_bf16_decode or null) and the limits native.py states (PAGED_MAX_ROWS, MAX_DIM, _MIN_CHUNK).
void kv_step_ops_bind_decode(void* float_decode, void* bf16_decode, int64_t max_rows, int64_t max_dim,
                             int64_t min_chunk) {
    bound.float_decode = reinterpret_cast<FloatDecodeFn>(float_decode);
    bound.bf16_decode = reinterpret_cast<Bf16DecodeFn>(bf16_decode);
    bound.max_rows = max_rows, bound.max_dim = max_dim, bound.min_chunk = min_chunk;
}

}  // extern "C"

STABLE_TORCH_LIBRARY_FRAGMENT(kvcache, m) {
    m.def("panel_linear(Tensor x, Tensor panels, int n, Tensor? bias) -> Tensor");
}

STABLE_TORCH_LIBRARY_IMPL(kvcache, CPU, m) {
    m.impl("panel_linear", TORCH_BOX(&panel_linear));
    m.impl("paged_decode_lse", TORCH_BOX(&paged_decode_lse));
    m.impl("paged_decode", TORCH_BOX(&paged_decode));
}
