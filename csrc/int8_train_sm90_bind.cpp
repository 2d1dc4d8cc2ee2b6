// Torch binding of the sm90 SageBwd kernels (int8_train_sm90.cu: forward, dK / dV, dQ): checks the tensors, passes
// pointers, strides and the current stream to the plain C launchers. Built with the kernel by
// sage_compile/kernels/int8_train/cuda.py through torch.utils.cpp_extension at first use.
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

extern "C" int sage_int8_train_sm90_dkdv(const void* q8, const void* q8t, const float* qs, const void* k8,
                                         const float* ks, const void* v16, const float* lse2, const float* delta,
                                         const void* do16, const void* do8t, const float* sdo, void* dk, void* dv,
                                         int fp16, int b, int hq, int hkv, int lq, int lk, int d, long long sob,
                                         long long soh, long long son, float c, float sm, int causal, int coff,
                                         const int* gate, int want, const int* krange, void* stream);

extern "C" int sage_int8_train_sm90_dq(const void* q8, const float* qs, const void* k8, const void* k8t,
                                       const float* ks, const void* v16, const float* kmean, const float* lse2,
                                       const float* delta, const void* do16, void* dq, int fp16, int b, int hq,
                                       int hkv, int lq, int lk, int d, long long sob, long long soh, long long son,
                                       float c, float sm, int causal, int coff, const int* gate, int want,
                                       const int* krange, void* stream);

extern "C" int sage_int8_train_sm90_fwd(const void* q8, const float* qs, const void* k8, const float* ks,
                                        const void* v8t, const float* vs, void* out, float* lse, int out_fp16, int b,
                                        int hq, int hkv, int lq, int lk, int d, long long sob, long long soh,
                                        long long son, float c, int causal, int coff, const int* gate, int want,
                                        const int* krange, void* stream);

namespace {

// The launch's gate and key ranges (a bool mask's structure decided on the device, no host sync; gate int32 on the
// device, contiguous): want >= 0, the kernel computes only where the device-side gate[0] == want, or with keyrange
// where gate[1] == want, and then batch i sees keys [gate[2 + 2i], gate[3 + 2i]) only (the layout of attention.py's
// mask_gate); want < 0: no gate (gate not read)
struct Gate {
  const int* word;    // null: no gate
  const int* krange;  // null: every key
};
Gate gate_args(const at::Tensor& gate, int64_t want, bool keyrange, int64_t b) {
  if (want < 0) {
    TORCH_CHECK(!keyrange, "sage_compile sm90 int8_train: key ranges come with a gate");
    return {nullptr, nullptr};
  }
  TORCH_CHECK(gate.is_cuda() && gate.scalar_type() == at::kInt && gate.is_contiguous() &&
                  gate.numel() >= (keyrange ? 2 + 2 * b : 1),
              "sage_compile sm90 int8_train: gate must be a contiguous CUDA int32 tensor of ", keyrange ? 2 + 2 * b : 1,
              " elements at least");
  const int* g = gate.data_ptr<int>();
  return keyrange ? Gate{g + 1, g + 2} : Gate{g, nullptr};
}

void check(const at::Tensor& t, at::ScalarType dtype, int64_t dim, const char* name) {
  TORCH_CHECK(t.is_cuda(), "sage_compile sm90 int8_train: ", name, " must be a CUDA tensor");
  TORCH_CHECK(t.scalar_type() == dtype, "sage_compile sm90 int8_train: ", name, " has dtype ", t.scalar_type());
  TORCH_CHECK(t.dim() == dim, "sage_compile sm90 int8_train: ", name, " must be ", dim, "-D");
  TORCH_CHECK(t.is_contiguous(), "sage_compile sm90 int8_train: ", name, " must be contiguous");
}

// per-block scales: (b, h, ceil(n / block)) (the kernels index them from the lengths)
void check_scales(const at::Tensor& s, int64_t b, int64_t h, int64_t n, int64_t block, const char* name) {
  const int64_t nb = (n + block - 1) / block;
  TORCH_CHECK(s.size(0) == b && s.size(1) == h && s.size(2) == nb, "sage_compile sm90 int8_train: ", name,
              " must be (", b, ", ", h, ", ", nb, "), got ", s.sizes());
}

// An output the kernels write (b, h, n, d) values of at element strides (sob, soh, son, 1) from its data pointer, in
// either token layout (B, H, N, D) or (B, N, H, D): CUDA, of type t16, channel stride 1, b * h * n * d elements
// and every written element inside them
void check_out(const at::Tensor& o, at::ScalarType t16, int64_t b, int64_t h, int64_t n, int64_t d, int64_t sob,
               int64_t soh, int64_t son, const char* name) {
  TORCH_CHECK(o.is_cuda() && o.scalar_type() == t16 && o.stride(-1) == 1, "sage_compile sm90 int8_train: ", name,
              " must be CUDA ", t16, " with channel stride 1");
  TORCH_CHECK(o.numel() == b * h * n * d && sob >= 0 && soh >= 0 && son >= 0 &&
                  (b - 1) * sob + (h - 1) * soh + (n - 1) * son + d <= o.numel(),
              "sage_compile sm90 int8_train: ", name, " must hold (", b, ", ", h, ", ", n, ", ", d,
              ") at the strides given");
}

// v16 and do16: the 16-bit operands, bf16 or fp16 alike; returns their type (the outputs' type)
at::ScalarType check16(const at::Tensor& v16, const at::Tensor& do16) {
  const auto t16 = v16.scalar_type();
  TORCH_CHECK(t16 == at::kBFloat16 || t16 == at::kHalf, "sage_compile sm90 int8_train: v16 must be bf16/fp16");
  check(v16, t16, 4, "v16");
  check(do16, t16, 4, "do16");
  return t16;
}

// q8 (B, Hq, Lq, D) int8 and q8t (B, Hq, D, Lq); qs (B, Hq, ceil(Lq/128)); k8 (B, Hkv, Lk, D) int8; ks (B, Hkv,
// ceil(Lk/64)); v16 (B, Hkv, Lk, D) bf16/fp16; lse2, delta (B, Hq, Lq) fp32; do16 (B, Hq, Lq, D) as v16; do8t
// (B, Hq, D, Lq) int8; sdo as qs; dk, dv (B, Hkv, Lk, D) values at strides (sob, soh, son, 1) in v16's dtype.
// Lq a multiple of 16. c = softmax scale * log2(e), sm = softmax scale; causal: key n seen by query m iff
// n <= m + coff. gate, want, keyrange: see gate_args (every function takes them last).
void dkdv(const at::Tensor& q8, const at::Tensor& q8t, const at::Tensor& qs, const at::Tensor& k8,
          const at::Tensor& ks, const at::Tensor& v16, const at::Tensor& lse2, const at::Tensor& delta,
          const at::Tensor& do16, const at::Tensor& do8t, const at::Tensor& sdo, at::Tensor& dk, at::Tensor& dv,
          double c, double sm, bool causal, int64_t coff, int64_t sob, int64_t soh, int64_t son,
          const at::Tensor& gate, int64_t want, bool keyrange) {
  check(q8, at::kChar, 4, "q8");
  check(q8t, at::kChar, 4, "q8t");
  check(k8, at::kChar, 4, "k8");
  check(do8t, at::kChar, 4, "do8t");
  check(qs, at::kFloat, 3, "qs");
  check(ks, at::kFloat, 3, "ks");
  check(sdo, at::kFloat, 3, "sdo");
  check(lse2, at::kFloat, 3, "lse2");
  check(delta, at::kFloat, 3, "delta");
  const auto t16 = check16(v16, do16);
  TORCH_CHECK(dk.strides() == dv.strides(), "sage_compile sm90 int8_train: dk and dv must share strides");
  const int64_t b = q8.size(0), hq = q8.size(1), lq = q8.size(2), d = q8.size(3);
  const int64_t hkv = k8.size(1), lk = k8.size(2);
  TORCH_CHECK(q8t.size(2) == d && q8t.size(3) == lq && do8t.sizes() == q8t.sizes() && do16.sizes() == q8.sizes() &&
                  v16.sizes() == k8.sizes() && lse2.size(2) == lq && delta.sizes() == lse2.sizes() &&
                  k8.size(0) == b && k8.size(3) == d,
              "sage_compile sm90 int8_train: shapes");
  check_scales(qs, b, hq, lq, 128, "qs");
  check_scales(sdo, b, hq, lq, 128, "sdo");
  check_scales(ks, b, hkv, lk, 64, "ks");
  TORCH_CHECK(lse2.size(0) == b && lse2.size(1) == hq, "sage_compile sm90 int8_train: lse2 must be (", b, ", ", hq,
              ", ", lq, ")");
  check_out(dk, t16, b, hkv, lk, d, sob, soh, son, "dk");
  check_out(dv, t16, b, hkv, lk, d, sob, soh, son, "dv");
  const Gate g = gate_args(gate, want, keyrange, b);
  const c10::cuda::CUDAGuard guard(q8.device());
  const int rc = sage_int8_train_sm90_dkdv(
      q8.data_ptr(), q8t.data_ptr(), qs.data_ptr<float>(), k8.data_ptr(), ks.data_ptr<float>(), v16.data_ptr(),
      lse2.data_ptr<float>(), delta.data_ptr<float>(), do16.data_ptr(), do8t.data_ptr(), sdo.data_ptr<float>(),
      dk.data_ptr(), dv.data_ptr(), t16 == at::kHalf, static_cast<int>(b), static_cast<int>(hq),
      static_cast<int>(hkv), static_cast<int>(lq), static_cast<int>(lk), static_cast<int>(d), sob, soh, son,
      static_cast<float>(c), static_cast<float>(sm), causal ? 1 : 0, static_cast<int>(coff), g.word,
      static_cast<int>(want), g.krange, at::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(rc == 0, "sage_compile sm90 int8_train kernel failed (code ", rc,
              ": 1 unsupported shape, 10 no cuTensorMapEncodeTiled, 11 tensor map, 12-13 launch)");
}

// dQ: q8, qs, k8, ks, v16, lse2, delta, do16 as in dkdv; k8t (B, Hkv, D, Lk) int8, kmean (B, Hkv, D) fp32; dq
// (B, Hq, Lq, D) values at strides (sob, soh, son, 1) in v16's dtype. Lk a multiple of 16.
void dq(const at::Tensor& q8, const at::Tensor& qs, const at::Tensor& k8, const at::Tensor& k8t,
        const at::Tensor& ks, const at::Tensor& v16, const at::Tensor& kmean, const at::Tensor& lse2,
        const at::Tensor& delta, const at::Tensor& do16, at::Tensor& dq, double c, double sm, bool causal,
        int64_t coff, int64_t sob, int64_t soh, int64_t son, const at::Tensor& gate, int64_t want, bool keyrange) {
  check(q8, at::kChar, 4, "q8");
  check(k8, at::kChar, 4, "k8");
  check(k8t, at::kChar, 4, "k8t");
  check(qs, at::kFloat, 3, "qs");
  check(ks, at::kFloat, 3, "ks");
  check(kmean, at::kFloat, 3, "kmean");
  check(lse2, at::kFloat, 3, "lse2");
  check(delta, at::kFloat, 3, "delta");
  const auto t16 = check16(v16, do16);
  const int64_t b = q8.size(0), hq = q8.size(1), lq = q8.size(2), d = q8.size(3);
  const int64_t hkv = k8.size(1), lk = k8.size(2);
  TORCH_CHECK(k8t.size(2) == d && k8t.size(3) == lk && v16.sizes() == k8.sizes() && do16.sizes() == q8.sizes() &&
                  lse2.size(2) == lq && delta.sizes() == lse2.sizes() && kmean.size(1) == hkv && kmean.size(2) == d &&
                  k8.size(0) == b && k8.size(3) == d,
              "sage_compile sm90 int8_train: shapes");
  check_scales(qs, b, hq, lq, 128, "qs");
  check_scales(ks, b, hkv, lk, 64, "ks");
  TORCH_CHECK(kmean.size(0) == b && lse2.size(0) == b && lse2.size(1) == hq,
              "sage_compile sm90 int8_train: kmean / lse2 batch or heads");
  check_out(dq, t16, b, hq, lq, d, sob, soh, son, "dq");
  const Gate g = gate_args(gate, want, keyrange, b);
  const c10::cuda::CUDAGuard guard(q8.device());
  const int rc = sage_int8_train_sm90_dq(
      q8.data_ptr(), qs.data_ptr<float>(), k8.data_ptr(), k8t.data_ptr(), ks.data_ptr<float>(), v16.data_ptr(),
      kmean.data_ptr<float>(), lse2.data_ptr<float>(), delta.data_ptr<float>(), do16.data_ptr(), dq.data_ptr(),
      t16 == at::kHalf, static_cast<int>(b), static_cast<int>(hq), static_cast<int>(hkv), static_cast<int>(lq),
      static_cast<int>(lk), static_cast<int>(d), sob, soh, son, static_cast<float>(c), static_cast<float>(sm),
      causal ? 1 : 0, static_cast<int>(coff), g.word, static_cast<int>(want), g.krange,
      at::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(rc == 0, "sage_compile sm90 int8_train dQ kernel failed (code ", rc,
              ": 1 unsupported shape, 10 no cuTensorMapEncodeTiled, 11 tensor map, 12-13 launch)");
}

// forward: q8 (B, Hq, Lq, D) int8, qs (B, Hq, ceil(Lq/128)), k8 (B, Hkv, Lk, D) int8, ks / vs (B, Hkv, ceil(Lk/64)),
// v8t (B, Hkv, D, Lk) int8; out (B, Hq, Lq, D) values at strides (sob, soh, son, 1), bf16/fp16; lse (B, Hq, Lq)
// fp32 contiguous. Lk a multiple of 16.
void fwd(const at::Tensor& q8, const at::Tensor& qs, const at::Tensor& k8, const at::Tensor& ks,
         const at::Tensor& v8t, const at::Tensor& vs, at::Tensor& out, at::Tensor& lse, double c, bool causal,
         int64_t coff, int64_t sob, int64_t soh, int64_t son, const at::Tensor& gate, int64_t want, bool keyrange) {
  check(q8, at::kChar, 4, "q8");
  check(k8, at::kChar, 4, "k8");
  check(v8t, at::kChar, 4, "v8t");
  check(qs, at::kFloat, 3, "qs");
  check(ks, at::kFloat, 3, "ks");
  check(vs, at::kFloat, 3, "vs");
  check(lse, at::kFloat, 3, "lse");
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kHalf,
              "sage_compile sm90 int8_train: out must be bf16/fp16");
  const int64_t b = q8.size(0), hq = q8.size(1), lq = q8.size(2), d = q8.size(3);
  const int64_t hkv = k8.size(1), lk = k8.size(2);
  TORCH_CHECK(k8.size(0) == b && k8.size(3) == d && v8t.size(1) == hkv && v8t.size(2) == d && v8t.size(3) == lk &&
                  lse.size(0) == b && lse.size(1) == hq && lse.size(2) == lq && ks.sizes() == vs.sizes(),
              "sage_compile sm90 int8_train: shapes");
  check_scales(qs, b, hq, lq, 128, "qs");
  check_scales(ks, b, hkv, lk, 64, "ks");
  check_out(out, out.scalar_type(), b, hq, lq, d, sob, soh, son, "out");
  const Gate g = gate_args(gate, want, keyrange, b);
  const c10::cuda::CUDAGuard guard(q8.device());
  const int rc = sage_int8_train_sm90_fwd(
      q8.data_ptr(), qs.data_ptr<float>(), k8.data_ptr(), ks.data_ptr<float>(), v8t.data_ptr(), vs.data_ptr<float>(),
      out.data_ptr(), lse.data_ptr<float>(), out.scalar_type() == at::kHalf, static_cast<int>(b),
      static_cast<int>(hq), static_cast<int>(hkv), static_cast<int>(lq), static_cast<int>(lk), static_cast<int>(d),
      sob, soh, son, static_cast<float>(c), causal ? 1 : 0, static_cast<int>(coff), g.word, static_cast<int>(want),
      g.krange, at::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(rc == 0, "sage_compile sm90 int8_train forward kernel failed (code ", rc,
              ": 1 unsupported shape, 10 no cuTensorMapEncodeTiled, 11 tensor map, 12-13 launch)");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("dkdv", &dkdv, "sage_compile int8_train sm90 dK / dV");
  m.def("dq", &dq, "sage_compile int8_train sm90 dQ");
  m.def("fwd", &fwd, "sage_compile int8_train sm90 forward");
}

// The same functions as torch ops, torch.ops.<extension name>.{fwd,dkdv,dq} (the namespace is the build's name, so
// that builds of other knobs load beside it): the traced int8_train ops call these, which torch.compile's graph
// holds and its generated code calls through the dispatcher, without Python in between. Their outputs are the
// written (mutated) tensors; the fake implementations (nothing to compute) are registered from Python at load. The
// causal offset and the output strides are SymInt (the kernels take them as int64_t): with int a traced call under
// dynamic shapes made them constants, one compile per sequence length (tests/test_traced_train.py).
TORCH_LIBRARY(TORCH_EXTENSION_NAME, m) {
  m.def("fwd(Tensor q8, Tensor qs, Tensor k8, Tensor ks, Tensor v8t, Tensor vs, Tensor(a!) out, Tensor(b!) lse, "
        "float c, bool causal, SymInt coff, SymInt sob, SymInt soh, SymInt son, Tensor gate, int want, "
        "bool keyrange) -> ()");
  m.def("dkdv(Tensor q8, Tensor q8t, Tensor qs, Tensor k8, Tensor ks, Tensor v16, Tensor lse2, Tensor delta, "
        "Tensor do16, Tensor do8t, Tensor sdo, Tensor(a!) dk, Tensor(b!) dv, float c, float sm, bool causal, "
        "SymInt coff, SymInt sob, SymInt soh, SymInt son, Tensor gate, int want, bool keyrange) -> ()");
  m.def("dq(Tensor q8, Tensor qs, Tensor k8, Tensor k8t, Tensor ks, Tensor v16, Tensor kmean, Tensor lse2, "
        "Tensor delta, Tensor do16, Tensor(a!) dq, float c, float sm, bool causal, SymInt coff, SymInt sob, "
        "SymInt soh, SymInt son, Tensor gate, int want, bool keyrange) -> ()");
}

TORCH_LIBRARY_IMPL(TORCH_EXTENSION_NAME, CUDA, m) {
  m.impl("fwd", &fwd);
  m.impl("dkdv", &dkdv);
  m.impl("dq", &dq);
}
