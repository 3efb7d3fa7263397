// The operator schemas of the CPU kernels (torch.ops.fused_transformer_cpu.*), the dropout keep-mask replay,
// and the Python module fused_transformer._C whose import loads them.
//
// Tensors in the accumulate dtype (float32, float64 for float64) unless said otherwise; the kernels live in
// attention.cpp, attention_kvcache.cpp, norm.cpp and bias_activation.cpp; norm.cpp's are registered here, beside
// their schemas.
#include <Python.h>
#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <ATen/ops/ones.h>
#include <torch/library.h>

#include <string>

#include "common.h"

namespace fused_transformer_cpu {

// The instruction set the float loops run on: the one ATen runs its own CPU kernels at (at::get_cpu_capability,
// which honours ATEN_CPU_CAPABILITY), read once.
CpuLevel cpu_level() {
  static const CpuLevel level = [] {
    const std::string capability = at::get_cpu_capability();
    if (capability == "AVX512") return CpuLevel::kAvx512;
    if (capability == "AVX2") return CpuLevel::kAvx2;
    return CpuLevel::kBaseline;
  }();
  return level;
}

const char* cpu_level_name(CpuLevel level) {
  switch (level) {
    case CpuLevel::kAvx512: return "AVX512";
    case CpuLevel::kAvx2: return "AVX2";
    default: return "baseline";
  }
}

std::string cpu_capability() {
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__)
  return cpu_level_name(cpu_level());
#else
  return "baseline";
#endif
}

const char* norm_op_name(bool rms_norm) { return rms_norm ? "rms_norm" : "layer_norm"; }

namespace {

FT_INLINE void keep_mask_range_body(const DropoutMask& dropout, bool* data, int64_t begin, int64_t end) {
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    const Int8 keep = keep8(dropout, i);
    for (int l = 0; l < 8; ++l) data[i + l] = keep[l] != 0;
  }
  for (; i < end; ++i) data[i] = dropout.keep(i);
}
FT_MULTIVERSIONED(void, keep_mask_range, (const DropoutMask& dropout, bool* data, int64_t begin, int64_t end),
                  (dropout, data, begin, end))

}  // namespace

// The keep-mask (True = kept) of elements 0 .. numel - 1 that a kernel drew with (seed, dropout_p).
at::Tensor dropout_keep_mask(int64_t seed, int64_t numel, double dropout_p) {
  TORCH_CHECK_VALUE(numel >= 0, "dropout_keep_mask: numel must be >= 0, got ", numel);
  const DropoutMask dropout(seed, dropout_p);
  if (!dropout.enabled()) return at::ones({numel}, at::TensorOptions().dtype(at::kBool));
  at::Tensor keep = at::empty({numel}, at::TensorOptions().dtype(at::kBool));
  bool* data = keep.data_ptr<bool>();
  at::parallel_for(0, numel, 65536, [&](int64_t begin, int64_t end) { keep_mask_range(dropout, data, begin, end); });
  return keep;
}

TORCH_LIBRARY(fused_transformer_cpu, m) {
  // The instruction set the kernels' float loops were chosen for: "AVX512", "AVX2" or "baseline".
  m.def("cpu_capability() -> str", &cpu_capability);
  // q [B, H, Lq, D], k, v [B, Hkv, Lk, D] in any float dtype and any strides; bias broadcastable to
  // [B, H, Lq, Lk]: float, added to the scaled scores (-inf = masked), or bool, true = may attend;
  // key_padding bool [B, Lk], true = padding (keys after a sequence's last real key are not even read);
  // query_padding bool [B, Lq], true = padding (a zero row, lse -inf; rows after the last real query are not
  // computed). Query i's diagonal key is i + o: o = 0, or with bottom_right Lk - Lq, or per sequence (key end -
  // query end) when query_padding is given. Query i sees keys i + o - window_left .. i + o + window_right (-1: no
  // limit on that side; is_causal: at most i + o). softcap: scaled scores s become softcap * tanh(s / softcap);
  // alibi_slopes [H] or [B, H]: then s -= slope * |i + o - j|, masked or not; sinks [H]: a logit per head in the
  // softmax denominator of every real query row, with no value (the lse holds it; a row with no visible key gets
  // out 0, lse = sink). Returns out (q's dtype, laid out in memory as [B, Lq, H, D]) and lse [B, H, Lq].
  m.def("attention_fwd(Tensor q, Tensor k, Tensor v, Tensor? bias, Tensor? key_padding, Tensor? query_padding, "
        "bool is_causal, bool bottom_right, int window_left, int window_right, float scale, float dropout_p, "
        "Tensor? seed, float? softcap=None, Tensor? alibi_slopes=None, Tensor? sinks=None) -> (Tensor, Tensor)");
  // Returns dq, dk, dv in the dtypes of q, k, v, laid out like out. No sinks: lse already holds them.
  m.def("attention_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? bias, "
        "Tensor? key_padding, Tensor? query_padding, bool is_causal, bool bottom_right, int window_left, "
        "int window_right, float scale, float dropout_p, Tensor? seed, float? softcap=None, "
        "Tensor? alibi_slopes=None) -> (Tensor, Tensor, Tensor)");
  // Packed sequences: q [Tq, H, D], k, v [Tk, Hkv, D], sequence b in rows cu_seqlens[b] .. cu_seqlens[b + 1]
  // (integer [B + 1]), no longer than max_seqlen; the options as above, per sequence. Dropout element
  // (b, h, i, j) is element ((b * H + h) * max_seqlen_q + i) * max_seqlen_k + j of the keep-mask stream; ALiBi
  // positions count within each sequence. Returns out [Tq, H, D] (q's dtype) and lse [H, Tq].
  m.def("attention_varlen_fwd(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
        "int max_seqlen_q, int max_seqlen_k, bool is_causal, bool bottom_right, int window_left, int window_right, "
        "float scale, float dropout_p, Tensor? seed, float? softcap=None, Tensor? alibi_slopes=None, "
        "Tensor? sinks=None) -> (Tensor, Tensor)");
  // Returns dq, dk, dv [T, heads, D] in the dtypes of q, k, v.
  m.def("attention_varlen_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
        "Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, bool is_causal, "
        "bool bottom_right, int window_left, int window_right, float scale, float dropout_p, Tensor? seed, "
        "float? softcap=None, Tensor? alibi_slopes=None) -> (Tensor, Tensor, Tensor)");
  // Attention of q [B, Lq, H, D] to a KV cache read in place: k_cache, v_cache [B, Lmax, Hkv, D] (q's dtype, any
  // strides but the last), or paged [num_blocks, block_size, Hkv, D] with block_table int32 [B, max_blocks] (key
  // position p of sequence b in block block_table[b, p // block_size], row p % block_size); cache_seqlens int32 [B]:
  // keys in each sequence's cache. k_new, v_new [B, Lnew, Hkv, D] (or None) are first written into the cache after
  // them, in place; sequence b then has n_b = cache_seqlens[b] + Lnew keys, and its query i sits at key position
  // n_b - Lq + i; causal, window, softcap, alibi_slopes and sinks as in attention_fwd around it. Returns out
  // [B, Lq, H, D] (q's dtype, contiguous) and lse [B, H, Lq].
  m.def("attention_with_kvcache_fwd(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor cache_seqlens, "
        "Tensor? block_table, Tensor? k_new, Tensor? v_new, bool is_causal, int window_left, int window_right, "
        "float scale, float? softcap, Tensor? alibi_slopes, Tensor? sinks) -> (Tensor, Tensor)");
  // x, residual [rows, N]. Returns y, z (empty unless store_z), mean, rstd [rows]. rms_norm: RMSNorm (the
  // rms_norm op shares these), with mean [0], empty.
  m.def("layer_norm_fwd(Tensor x, Tensor? weight, Tensor? bias, Tensor? residual, float eps, float dropout_p, "
        "Tensor? seed, bool store_z, bool rms_norm=False) -> (Tensor, Tensor, Tensor, Tensor)");
  // Returns dx, dresidual (empty unless has_residual), dweight, dbias (empty when absent). rms_norm: mean is not
  // read (it may be empty).
  m.def("layer_norm_bwd(Tensor dy, Tensor? dz, Tensor z, Tensor? weight, Tensor? bias, Tensor mean, Tensor rstd, "
        "float dropout_p, Tensor? seed, bool has_residual, bool rms_norm=False) -> (Tensor, Tensor, Tensor, Tensor)");
  // h [rows, F] = x @ w1^T. Returns dropout(act(h + bias)).
  m.def("bias_activation_fwd(Tensor h, Tensor? bias, str activation, float dropout_p, Tensor? seed) -> Tensor");
  // Returns the gradient of h + bias.
  m.def("bias_activation_bwd(Tensor grad, Tensor h, Tensor? bias, str activation, float dropout_p, Tensor? seed) "
        "-> Tensor");
  m.def("dropout_keep_mask(int seed, int numel, float dropout_p) -> Tensor", &dropout_keep_mask);
}

TORCH_LIBRARY_IMPL(fused_transformer_cpu, CPU, m) {
  m.impl("layer_norm_fwd", &norm_fwd);
  m.impl("layer_norm_bwd", &norm_bwd);
}

}  // namespace fused_transformer_cpu

// Importing fused_transformer._C runs the registrations above; the module itself has no Python functions.
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "fused_transformer._C",
                                      "C++ CPU kernels, registered as torch.ops.fused_transformer_cpu", -1, nullptr};
  return PyModule_Create(&module);
}
