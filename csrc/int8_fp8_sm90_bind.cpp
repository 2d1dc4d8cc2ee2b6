// Torch binding of the sm90 int8_fp8 core (int8_fp8_sm90.cu): checks the tensors, passes pointers,
// strides and the current stream to the plain C launcher. Built with the kernel by
// sage_compile/kernels/int8_fp8/cuda.py through torch.utils.cpp_extension at first use.
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

extern "C" int sage_int8_fp8_sm90_fwd(const void* q8, const float* qs, const void* k8, long long ldk, const float* ks,
                                      long long ldks, const void* v8, const float* vs, void* out, int out_fp16,
                                      int b, int hq, int hkv, int lq, int lk, int d, long long ldv, long long sob,
                                      long long soh, long long son, float c, int causal, int coff,
                                      const int* krange, const int* flag, int want, void* stream);

namespace {

void check(const at::Tensor& t, at::ScalarType dtype, int64_t dim, const char* name) {
  TORCH_CHECK(t.is_cuda(), "sage_compile sm90 int8_fp8: ", name, " must be a CUDA tensor");
  TORCH_CHECK(t.scalar_type() == dtype, "sage_compile sm90 int8_fp8: ", name, " has dtype ", t.scalar_type());
  TORCH_CHECK(t.dim() == dim, "sage_compile sm90 int8_fp8: ", name, " must be ", dim, "-D");
  TORCH_CHECK(t.is_contiguous(), "sage_compile sm90 int8_fp8: ", name, " must be contiguous");
}

// q8 (B, Hq, Lq, D) int8, qs (B, Hq, Lq), k8 (B, Hkv, ldk, D) int8 (ldk >= Lk a multiple of 4, zero rows past Lk), ks (B, Hkv, ldks) with ldks >= Lk a
// multiple of 4, v8 (B, Hkv, D, ldv) e4m3 with ldv >= Lk a multiple of 16, vs (B, Hkv, D); out: (B, Hq, Lq, D) values at strides
// (sob, soh, son, 1), bf16 or fp16. c = softmax scale * log2(e); causal: key n seen by query m iff
// n <= m + coff. Key-range masks (both or neither): krange (B, 2) int32, each batch's visible keys
// [first, end); flag int32[1]: the kernel runs only where flag[0] == want (read on the device).
void fwd(const at::Tensor& q8, const at::Tensor& qs, const at::Tensor& k8, const at::Tensor& ks,
         const at::Tensor& v8, const at::Tensor& vs, at::Tensor& out, int64_t lk, double c, bool causal,
         int64_t coff, int64_t sob, int64_t soh, int64_t son, const c10::optional<at::Tensor>& krange,
         const c10::optional<at::Tensor>& flag, int64_t want) {
  check(q8, at::kChar, 4, "q8");
  check(k8, at::kChar, 4, "k8");
  check(v8, at::kFloat8_e4m3fn, 4, "v8");
  check(qs, at::kFloat, 3, "qs");
  check(ks, at::kFloat, 3, "ks");
  check(vs, at::kFloat, 3, "vs");
  TORCH_CHECK(out.is_cuda() && (out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kHalf),
              "sage_compile sm90 int8_fp8: out must be CUDA bf16/fp16");
  TORCH_CHECK(out.stride(-1) == 1, "sage_compile sm90 int8_fp8: out's channel stride must be 1");
  const int64_t b = q8.size(0), hq = q8.size(1), lq = q8.size(2), d = q8.size(3);
  const int64_t hkv = k8.size(1);
  TORCH_CHECK(k8.size(2) >= lk && k8.size(2) % 4 == 0 && v8.size(2) == d && v8.size(3) >= lk && ks.size(2) >= lk,
              "sage_compile sm90 int8_fp8: shapes");
  TORCH_CHECK(krange.has_value() == flag.has_value(), "sage_compile sm90 int8_fp8: krange and flag go together");
  const int* kr = nullptr;
  const int* fl = nullptr;
  if (krange.has_value()) {
    check(*krange, at::kInt, 2, "krange");
    check(*flag, at::kInt, 1, "flag");
    TORCH_CHECK(krange->size(0) == q8.size(0) && krange->size(1) == 2 && flag->numel() == 1,
                "sage_compile sm90 int8_fp8: krange must be (B, 2), flag one element");
    kr = krange->data_ptr<int>();
    fl = flag->data_ptr<int>();
  }
  const c10::cuda::CUDAGuard guard(q8.device());
  const int rc = sage_int8_fp8_sm90_fwd(
      q8.data_ptr(), qs.data_ptr<float>(), k8.data_ptr(), k8.size(2), ks.data_ptr<float>(), ks.size(2), v8.data_ptr(),
      vs.data_ptr<float>(),
      out.data_ptr(), out.scalar_type() == at::kHalf, static_cast<int>(b), static_cast<int>(hq),
      static_cast<int>(hkv), static_cast<int>(lq), static_cast<int>(lk), static_cast<int>(d), v8.size(3), sob, soh,
      son, static_cast<float>(c), causal ? 1 : 0, static_cast<int>(coff), kr, fl, static_cast<int>(want),
      at::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(rc == 0, "sage_compile sm90 int8_fp8 kernel failed (code ", rc,
              ": 1 unsupported shape, 10 no cuTensorMapEncodeTiled, 11 tensor map, 12-13 launch)");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("fwd", &fwd, "sage_compile int8_fp8 sm90 forward"); }

// The same function as a torch op, torch.ops.<extension name>.fwd (the namespace is the build's name, so that builds
// of other knobs load beside it): the traced int8_fp8 core op calls it, which torch.compile's graph holds and its
// generated code calls through the dispatcher, without Python in between. It writes only `out`; the fake
// implementation (nothing to compute) is registered from Python at load. Sizes and strides are SymInt (the kernel
// takes them as int64_t), so a traced call under dynamic shapes does not make them constants.
TORCH_LIBRARY(TORCH_EXTENSION_NAME, m) {
  m.def("fwd(Tensor q8, Tensor qs, Tensor k8, Tensor ks, Tensor v8, Tensor vs, Tensor(a!) out, SymInt lk, float c, "
        "bool causal, SymInt coff, SymInt sob, SymInt soh, SymInt son, Tensor? krange, Tensor? flag, int want) -> ()");
}

TORCH_LIBRARY_IMPL(TORCH_EXTENSION_NAME, CUDA, m) { m.impl("fwd", &fwd); }
