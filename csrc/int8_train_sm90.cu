// SageBwd for Hopper (sm_90a): the int8_train forward, and the dK / dV and dQ kernels with psi="split" numerics.
//
// dK / dV: same numerics as the Triton kernel `_bwd_dkdv_split` (sage_compile/kernels/int8_train/attention.py) and
// the reference (sage_compile/reference/int8_train.py, shared/docs/numerics.md §4): for each key block and each
// 64-query step, S^T = k̂·q̂^T in INT8 (exact int32) times the K (64 keys) and Q (128 queries) scales and the
// softmax scale, P^T = exp2(S^T - LSE2); ψ(P^T) with one scale per key over the 64 queries; dV += ψ(P^T)·ψ(dO)
// in INT8 (dO: one scale per 128 queries); dP^T = V̂·dO^T in 16 bits with fp32 accumulation; dS^T = P^T ∘
// (dP^T - delta); ψ(dS^T) per key over the 64 queries; dK += ψ(dS^T)·q̂ in INT8; dK times the softmax scale at
// the end. GQA: a CTA loops over the query heads of its key head's group.
//
// CTA: 128 keys, 12 warps: warps 0-7 are two consumer warpgroups (64 keys each, 240 registers per thread
// through setmaxnreg), warps 8-11 the producer warpgroup (24 registers), one lane of which issues the TMA
// loads: K (int8) and V (16-bit) of the block once, then per 64-query step q̂ and dO (16-bit) in the row order
// of perm_base (so that S^T's and dP^T's accumulator columns are the queries of the 8-bit A fragments of the
// dV and dK products: P^T and dS^T go from registers to the tensor cores without shuffles), dO8^T and q̂^T
// (channels x queries, the K-major B operands of those products) and the step's LSE2 and delta, into a
// STAGES-deep ring on mbarriers. Per step each consumer warpgroup issues S^T (s8, two operands in shared
// memory) and dP^T (bf16/fp16) as two commit groups, takes P^T while dP^T runs, then dS^T, then the two INT8
// products one after the other (one int32 accumulator, folded into the fp32 dV / dK with the row scales).
//
// Inputs (HND, contiguous): q8 (B, Hq, Lq, D) int8 and its transpose q8t (B, Hq, D, Lq); qs (B, Hq, ceil(Lq/128))
// fp32; k8 (B, Hkv, Lk, D) int8; ks (B, Hkv, ceil(Lk/64)) fp32 (times c = softmax scale * log2 e in the kernel);
// v16 (B, Hkv, Lk, D) bf16/fp16 (V̂ dequantized); lse2 (B, Hq, Lq) fp32, the LSE in log2 units with +inf for rows
// without keys; delta (B, Hq, Lq) fp32; do16 (B, Hq, Lq, D) 16-bit; do8t (B, Hq, D, Lq) int8 and sdo (B, Hq,
// ceil(Lq/128)) fp32. Lq a multiple of 16 (the transposed tiles' row stride for TMA). Outputs dK, dV (B, Hkv, Lk,
// D) at any (b, h, token) strides with channel stride 1, bf16 or fp16 (the 16-bit type of v16 / do16).
//
// dQ (dq_kernel, below): the mirror, 192 queries a CTA (three consumer warpgroups) in 64-key steps; the forward
// (fwd_kernel; 192 queries at hd64, 128 at hd128) has the same
// shape; see their comments.
// dQ fused into this kernel instead (FA2/FA3's way; built and dropped, code at 8ce5b48): per step each warpgroup
// quantized dS per query over its 64 keys (a reduce-scatter over the quad rows, an amax exchange and two barriers
// of the warpgroup), wrote ψ(dS) to a 64B-swizzled shared tile, took dQ's INT8 product against a k̂^T tile and added
// it into an fp32 dQ with red.global.add.v2.f32 (row sums by an n8 product with ones). Correct (GPU tests 34/34,
// dQ as close to the Triton kernels' as the dQ kernel's) but slower, H100 run 105, hd128 16K B=2 x 16 heads: the
// backward 25.2 ms with the dQ kernel, 42.4 fused, 33.7 with half the additions, 25.2 with none. The additions
// (69 GB: every key block adds all of dQ, twice: one per warpgroup) ran at about 4 TB/s; even with none the
// fused kernel only matched the two kernels, so the smallest traffic possible (one add per key block, 34 GB) could
// not pay for itself. (benchmarks/results/train_variants_run105_*, train_fused_run104_*.)
//
// sage_compile runs them wherever they support the call on sm90 (SAGE_COMPILE_INT8_TRAIN_CORE=auto, the default, or
// cuda: sage_compile/kernels/int8_train/cuda.py); first run on the H200 in run 82 (tests/test_kernel_int8_train_cuda_gpu.py).
// Each warpgroup waits for its own products; SAGE_TRAIN_DQPIPE (below; off: not faster) overlaps dQ's with the next
// step's S and dP.
//
// Plain C launchers (no torch headers) so the CPU CI can compile them with nvcc -c; the torch binding is
// int8_train_sm90_bind.cpp.

#include <type_traits>

#include "sm90_common.cuh"

// SAGE_TRAIN_STAGES: depth of the per-step ring (q̂, dO, dO8^T, q̂^T, LSE2, delta: 40 KB a stage at hd128)
#ifndef SAGE_TRAIN_STAGES
#define SAGE_TRAIN_STAGES 3
#endif
// SAGE_TRAIN_PARTS (bits: 1 the dV product, 2 the dK product) at hd128: in two column halves, each waited for and
// folded before the next (an int32 product of 32 registers instead of 64). Offline: with both whole, ptxas spills
// 20-52 bytes in each hd128 kernel (52-84 with SAGE_TRAIN_EDGELOOP); the dK product in halves (2, the default) spills nothing; 1 or 3 spill 16-304.
#ifndef SAGE_TRAIN_PARTS
#define SAGE_TRAIN_PARTS 2
#endif
// SAGE_TRAIN_DQ_STAGES: depth of the dQ kernel's ring (k̂, V̂ and k̂^T of a 64-key step: 32 KB at hd128);
// SAGE_TRAIN_DQ_PARTS 1: its dQ product at hd128 in two column halves
#ifndef SAGE_TRAIN_DQ_STAGES
#define SAGE_TRAIN_DQ_STAGES 3
#endif
#ifndef SAGE_TRAIN_DQ_PARTS
#define SAGE_TRAIN_DQ_PARTS 0
#endif
// SAGE_TRAIN_DQPIPE 1 (off: run 94's backward 1.5 % slower to 1.2 % faster): the dQ kernel's step ends by issuing its
// INT8 product and then S and dP of the next step (this step's stage again on the last: dropped), waits for the product
// alone (wait_group 2, all three groups issued in this step) and folds it into dQ while S and dP run; the next step
// starts by waiting for both. The exps then no longer overlap dP, the fold overlaps S and dP, and the tensor cores get
// the three back to back. The same products folded in the same order: outputs identical to 0's. (Leaving the product in
// flight into the next step instead, read after wait_group 2 there, makes ptxas 13.0 serialize every wgmma: C7514, it
// does not count commit groups across the loop's back edge.) Not with SAGE_TRAIN_DQ_PARTS; timed with two consumer
// warpgroups (SAGE_TRAIN_DQ_WG=2: with three it spills 1152 bytes at hd128).
#ifndef SAGE_TRAIN_DQPIPE
#define SAGE_TRAIN_DQPIPE 0
#endif
// SAGE_TRAIN_EDGELOOP 1 (default): the steps that need no mask (all but the causal diagonal and the ragged ends) run
// in a loop of their own, without the masking code that ptxas otherwise predicates into every step (~40-70
// instructions a step offline); 0: one loop with the mask under a runtime test. H200 run 82 (hd128, 16K, B=2 x 16
// heads, benchmarks/results/train_variants_run82_*): forward 9.42 -> 8.42 ms, backward 26.03 -> 25.52 ms; causal
// 5.31 -> 4.49 and 14.14 -> 12.81; hd64 7.92 -> 7.17 and 19.08 -> 18.10; the same outputs bit for bit
#ifndef SAGE_TRAIN_EDGELOOP
#define SAGE_TRAIN_EDGELOOP 1
#endif
// SAGE_TRAIN_EARLY 1: the latencies ncu found exposed at the top of the dK / dV and dQ steps (H100 run 106, hd128
// 16K: the wgmma fence waiting for S's accumulator fill, 5 % of dK / dV's stall samples; the logits' offset waiting
// for the step's Q scale, a global load issued just before it, and for the LSE loads, 4 %; dQ's K scale the same)
// taken off the path: the producer lane loads the step's scales (dK / dV: Q's and ψ(dO)'s; dQ: K's) into the stage
// with the TMA loads (plain loads and shared stores before its arrival on the stage's barrier), the consumers fill
// S's accumulator before waiting for the stage and load the step's LSE pairs before issuing S and dP. 0: as before
// H100 run 107 (benchmarks/results/train_variants_run107_*, each built twice, outputs identical): backward at hd128
// 16K 23.7 / 24.4 vs 24.8 / 25.1 ms, causal 12.1 / 12.5 vs 13.1 / 12.7, 4K 1.64 / 1.71 vs 1.76 / 1.72; hd64 16K 17.0 vs
// 17.5. The forward's K scale the same way (run 110): forward hd128 16K 8.01 / 7.97 vs 8.27 / 8.28 ms, hd64 16K 6.72 /
// 6.67 vs 7.02 / 7.02, hd64 4K 0.456 / 0.454 vs 0.480 / 0.480. Also tried and dropped: the dQ and PV products on the
// magic start, folded by FADD + FFMA instead of I2FP (run 107: forward 8.96 vs 8.09 ms, backward no faster; code at
// 1f3b421); the loads after issuing S and dP, so that the wgmma fence waits for the fill alone (run 109: hd64 16K
// 17.37 vs 17.18 ms, hd128 within the spread; code at 5f0a2a7).
#ifndef SAGE_TRAIN_EARLY
#define SAGE_TRAIN_EARLY 1
#endif
// SAGE_TRAIN_DFILL 1: dP's accumulator (dK / dV: dP^T's) starts at delta, the wgmma takes A negated (its scale-a -1),
// so that it ends as delta - dP = -(dP - delta) and dS is one FMUL (P * that), not an FADD and an FMUL: ψ is odd (its
// rounding is to nearest even, its scale an amax), so ψ(-dS) = -ψ(dS), and the sign goes into the products' row factor
// (and dQ's row sums). The fill: dQ 8 four-word shared loads a step from a 16-byte slot per quad ({delta, delta} of its
// two rows), dK / dV the stage's delta pairs. dP - delta rounds once inside the accumulation instead of after it.
// Offline: dQ's step 511 -> 487 instructions at hd128 (412 -> 394 at hd64), dK / dV's 779 -> 756 (620 -> 593). H100,
// backward ms, each built twice (train_variants_run11[34]_*; run 114 three rounds in rotated order, medians): hd128
// 16K 22.96 / 23.47 / 25.33 vs 23.67 / 23.68 / 24.46 (identical builds differ by up to 8 % there), causal 11.83 /
// 12.02 / 12.25 vs 12.34 / 12.35 / 12.36, 4K 1.609 / 1.618 / 1.613 vs 1.647 / 1.681 / 1.653; hd64 16K 17.05-17.16
// either way. Gradients vs fp32 the same errors to 4 digits (GPU tests 23/23, run 113).
// ψ(P)'s row max in dK / dV on the values' bits by three-input integer maxima (SAGE_TRAIN_PIMAX; code at e537761) was
// dropped: the same outputs bit for bit and 17 instructions fewer a step, but slower (H100 run 115, 3 rounds, each
// built twice: backward hd64 16K 17.39 / 17.39 vs 17.18 / 17.18 ms, hd128 16K 23.76 / 24.91 vs 22.99 / 23.60).
#ifndef SAGE_TRAIN_DFILL
#define SAGE_TRAIN_DFILL 1
#endif
// SAGE_TRAIN_MAXCHAINS64 / SAGE_TRAIN_MAXCHAINS128 k (2, 4 or 8; 0: one chain): ψ's row maxima (psi_rows: dK / dV's
// ψ(P^T) and ψ(dS^T), dQ's ψ(dS); the forward's without SAGE_TRAIN_FWDMAX) at that head dim as k independent chains
// over the 16 values, then a tree over the chains: the same maxima on a shorter dependency path. H100 run 116
// (train_variants_run116_*, 3 rounds, each built twice, outputs identical), backward with 4 chains vs one: hd64 16K
// 16.84 / 16.84 vs 17.14 / 17.14 ms; hd128 causal 16K 12.50 / 12.49 vs 12.11 / 12.10, 4K 1.646 / 1.686 vs 1.609 /
// 1.604 (16K within the builds' spread). So 4 at hd64, one chain at hd128.
#ifndef SAGE_TRAIN_MAXCHAINS64
#define SAGE_TRAIN_MAXCHAINS64 4
#endif
#ifndef SAGE_TRAIN_MAXCHAINS128
#define SAGE_TRAIN_MAXCHAINS128 0
#endif
template <int D>
__host__ __device__ constexpr int max_chains() { return D == 64 ? SAGE_TRAIN_MAXCHAINS64 : SAGE_TRAIN_MAXCHAINS128; }
// Dropped offline (code at 18801fe, SAGE_TRAIN_UNROLL): the steps that need no mask in groups of STAGES with constant
// stages, so that no step computes j % STAGES. Instructions a step (sm_90a, bf16): dQ 489 -> 462 at hd128 and 391 ->
// 375 at hd64, the forward 488 -> 478 at hd128, dK/dV 757 -> 758 at hd128 and 591 -> 575 at hd64; but dQ and dK/dV
// spill at hd128 (12-76 bytes) and the code grows 2.2x, for at most 3-5 % fewer instructions.
// SAGE_TRAIN_DQ_WG: consumer warpgroups of the dQ kernel (3, the default since run 145: 192 queries a CTA, 160
// registers a consumer thread, offline no spills at either head dim; a third warp per scheduler hides more of the
// step's latencies, and each stage's k̂, V̂ and k̂^T serve 1.5x the queries; 2: 128 queries, 240 registers).
// SAGE_TRAIN_FWD_WG64: the same for the hd64 forward (3 by default; at hd128 the forward spills 952 bytes at 160
// registers, and dK / dV spills 124-176 bytes at hd64, so they keep two). H100 run 145 (train_variants_run145_*, 3
// rounds, the old default built twice, outputs identical): backward hd64 16K 15.83 vs 17.00 ms, causal 8.22 vs 8.77,
// 4K 1.133 vs 1.168; hd128 16K 23.82 vs 25.07 / 25.10 (within the builds' spread there), causal 12.44 vs 12.67 /
// 12.73, 4K 1.623 vs 1.667 / 1.671; forward hd64 16K 5.41 vs 5.82 ms, causal 2.81 vs 2.89, 4K 0.402 vs 0.408
#ifndef SAGE_TRAIN_DQ_WG
#define SAGE_TRAIN_DQ_WG 3
#endif
#ifndef SAGE_TRAIN_FWD_WG64
#define SAGE_TRAIN_FWD_WG64 3
#endif
template <int D>
__host__ __device__ constexpr int fwd_wg() { return D == 64 ? SAGE_TRAIN_FWD_WG64 : 2; }
// SAGE_TRAIN_FWD_STAGES: depth of the forward's ring (k̂ and V̂^T of a 64-key step: 16 KB at hd128)
#ifndef SAGE_TRAIN_FWD_STAGES
#define SAGE_TRAIN_FWD_STAGES 4
#endif
// SAGE_TRAIN_SMAGIC 1: S (every kernel's q̂·k̂^T) accumulates onto 0x4B400000, the bits of the float 1.5 * 2^23, so
// that each accumulator read as a float is 1.5 * 2^23 + S exactly (|S| <= 127^2 * 128 < 2^22): no int32 -> fp32
// conversion (32 I2FP a step). The constant goes into the logits' offset, off - 1.5 * 2^23 * a rounded once (a per
// row, or in dK / dV per query, shift of a step's logits by at most half an ulp of that offset; the int8_fp8 core's
// SAGE_SMAGIC). The accumulator is filled by 8 four-word shared-memory loads a step in place of the zero start.
// Offline: the step loops 24 (forward, dQ) and 8 (dK / dV: 16 offsets a step, one per query of the lane) shorter.
#ifndef SAGE_TRAIN_SMAGIC
#define SAGE_TRAIN_SMAGIC 1
#endif
// SAGE_TRAIN_FWDMAX 1 (with SAGE_TRAIN_SMAGIC): the forward's step softmax by fwd_softmax (below): the row max on S's
// bits, each P~ by one FFMA and an exp, ψ's row max from the row max; 0: the row max over the logits, z - m a FADD
// each, ψ's max over the P~. Offline the full-step loop 570 -> 490 instructions at hd128 (468 -> 388 at hd64; the
// loop issues ~2x the tensor cores' time, so the count sets its speed). H100 run 112 (train_variants_run112_*, each
// built twice): forward hd128 16K 7.21 / 7.00 vs 7.84 / 7.90 ms, causal 3.67 / 3.77 vs 4.08 / 4.11, 4K 0.515 / 0.510 vs
// 0.567 / 0.577; hd64 16K 5.79 / 5.63 vs 6.57 / 6.57, 4K 0.396 / 0.391 vs 0.448 / 0.451; outputs vs the Triton
// forward 1e-5 rel-L1 as before, vs fp32 the same error to 4 digits (GPU tests 23/23). (Descriptors of each stage
// made by one addition to stage 0's instead: no shorter, ptxas rebuilds the loop-invariant ones every step.)
#ifndef SAGE_TRAIN_FWDMAX
#define SAGE_TRAIN_FWDMAX SAGE_TRAIN_SMAGIC
#endif
#if SAGE_TRAIN_FWDMAX && !SAGE_TRAIN_SMAGIC
#error "SAGE_TRAIN_FWDMAX needs SAGE_TRAIN_SMAGIC (the row max on the accumulator's float bits)"
#endif
// SAGE_TRAIN_LAZY 1: the forward rescales O by alpha only in a warp where some row raised its max in the step (else
// every alpha is exactly 1 and O * 1 is O: the same bits), the 32 or 64 FMULs a step skipped by a warp-uniform
// branch; the rescale comes before the wait for PV, beside the tensor cores' work
#ifndef SAGE_TRAIN_LAZY
#define SAGE_TRAIN_LAZY 1
#endif
// SAGE_TRAIN_PP (bits, 2 the default): the consumer warpgroups take turns at the tensor cores (ping-pong, as the
// int8_fp8 core at hd128): a warpgroup issues a turn's wgmmas only after the warpgroup before it (in a ring) issued
// its own, so that one warpgroup's products complete while the next one's exps and quantizers run, instead of all
// of them waiting for the same stage and the same products at once. 1: the forward at hd128 (its step's PV and the
// next S), 2: the same at hd64 (three warpgroups); 4: dK / dV's S^T and dP^T, 8: also each of its INT8 products; 16:
// the dQ kernel's S and dP, 32: also its product. Every warpgroup of a CTA takes the same number of turns. H100 runs
// 147 (train_variants_run147*_256894c_*, 3 rounds, medians, outputs identical): only the hd64 forward gains, 16K
// 5.07 vs 5.36 ms, causal 2.72 vs 2.79, 4K 0.398 vs 0.400 (causal 4K 0.251 vs 0.247); the hd128 forward within the
// spread (16K 7.45 vs 7.50, causal 3.82 vs 3.77); the backward slower with dK / dV's turns (hd128 16K 23.71, with
// the products' 23.77, vs 22.92 ms; 4K 1.651 / 1.710 vs 1.619; hd64 16K 15.81 / 16.89 vs 15.74) and no faster with
// dQ's (23.08, 1.621, 15.78) (not profiled; probably each warpgroup's wait for its own S and dP mid-step staggers them
// already, and a fixed order only adds the barrier's wait).
#ifndef SAGE_TRAIN_PP
#define SAGE_TRAIN_PP 2
#endif

namespace sage_sm90 {
namespace train {

constexpr int kBN = 128;  // keys per CTA (two consumer warpgroups of 64)
constexpr int kBM = 64;   // queries per step (SPLIT_M: one ψ scale per key over them)
constexpr int kCW = 8;    // consumer warps
constexpr int kThreads = 128 * 3;

// the 32 accumulator operands of an n64 wgmma, %0..%31
#define SAGE_D32                                                                                           \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, "     \
  "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"

// An n64 wgmma with both operands in shared memory (descriptors %32, %33; accumulate unless %34 is 0): SHAPE_TYPES is
// the instruction's "k<K>.<d>.<a>.<b>" part, EXTRA its operands after the predicate, OUT the 32 accumulators
#define SAGE_WGMMA_SS_N64(SHAPE_TYPES, EXTRA, OUT)                                                          \
  asm volatile(                                                                                            \
      "{\n"                                                                                                \
      ".reg .pred p;\n"                                                                                    \
      "setp.ne.b32 p, %34, 0;\n"                                                                           \
      "wgmma.mma_async.sync.aligned.m64n64" SHAPE_TYPES " " SAGE_D32 ", %32, %33, p" EXTRA ";\n"             \
      "}\n"                                                                                                \
      : OUT(d, 0), OUT(d, 8), OUT(d, 16), OUT(d, 24)                                                       \
      : "l"(da), "l"(db), "r"(accumulate))

// S^T (64 keys x 64 queries, s32) (+)= A (64 x 32 s8, smem) * B (64 x 32 s8, smem)^T
__device__ __forceinline__ void wgmma_s8_ss_n64(uint32_t (&d)[32], uint64_t da, uint64_t db, int accumulate) {
#if SAGE_SM90A
  SAGE_WGMMA_SS_N64("k32.s32.s8.s8", "", SAGE_R8);
#endif
}

// dP^T (64 keys x 64 queries, f32) (+)= A (64 x 16, smem) * B (64 x 16, smem)^T, bf16 or fp16 (both K-major)
// (NEG: A negated, the instruction's scale-a -1)
template <typename T, bool NEG = false>
__device__ __forceinline__ void wgmma_16_ss_n64(float (&d)[32], uint64_t da, uint64_t db, int accumulate) {
#if SAGE_SM90A
  if constexpr (std::is_same<T, __half>::value) {
    if constexpr (NEG) SAGE_WGMMA_SS_N64("k16.f32.f16.f16", ", -1, 1, 0, 0", SAGE_F8);
    else SAGE_WGMMA_SS_N64("k16.f32.f16.f16", ", 1, 1, 0, 0", SAGE_F8);
  } else {
    if constexpr (NEG) SAGE_WGMMA_SS_N64("k16.f32.bf16.bf16", ", -1, 1, 0, 0", SAGE_F8);
    else SAGE_WGMMA_SS_N64("k16.f32.bf16.bf16", ", 1, 1, 0, 0", SAGE_F8);
  }
#endif
}

// dV or dK product (64 keys x N channels, s32) (+)= A (64 keys x 32 queries s8, registers) * B (N x 32 s8, smem)^T
template <int N>
__device__ __forceinline__ void wgmma_s8_rs(uint32_t (&d)[N / 2], const uint32_t (&a)[4], uint64_t db,
                                            int accumulate) {
#if SAGE_SM90A
  if constexpr (N == 128) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8 " SAGE_D64 ", {%64, %65, %66, %67}, %68, p;\n"
        "}\n"
        : SAGE_R8(d, 0), SAGE_R8(d, 8), SAGE_R8(d, 16), SAGE_R8(d, 24), SAGE_R8(d, 32), SAGE_R8(d, 40),
          SAGE_R8(d, 48), SAGE_R8(d, 56)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate));
  } else {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8 " SAGE_D32 ", {%32, %33, %34, %35}, %36, p;\n"
        "}\n"
        : SAGE_R8(d, 0), SAGE_R8(d, 8), SAGE_R8(d, 16), SAGE_R8(d, 24)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate));
  }
#endif
}

// d (s32, 64 x N) = the A fragments of two 32-deep k-steps (64 x 64 s8, registers) · B^T, B the K-major (N x 64) s8
// tile at descriptor db (64-byte rows): the 8-bit products of every kernel (dK, dV, dQ, PV), not committed
template <int N>
__device__ __forceinline__ void wgmma_s8_rs2(uint32_t (&d)[N / 2], const uint32_t (&frag)[2][4], uint64_t db) {
  wgmma_s8_rs<N>(d, frag[0], db, 0);
  wgmma_s8_rs<N>(d, frag[1], db + 2, 1);
}

struct Params {
  const float* qs;   // (B*Hq, nqb): Q scales, 128 queries each
  const float* sdo;  // (B*Hq, nqb): ψ(dO) scales, 128 queries each
  const float* ks;   // (B*Hkv, nkb): K scales, 64 keys each
  void* dk;
  void* dv;
  int hq, group, lq, lk, nqb, nkb;
  float c;   // softmax scale * log2(e)
  float sm;  // softmax scale
  int coff;  // causal: key n visible from query m iff n <= m + coff
  long long sob, soh, son;  // dK / dV strides (elements)
  const int* gate;  // want >= 0: the kernel computes only where gate[0] == want (see gated_off)
  int want;
  const int* krange;  // null, or (B, 2) int32: each batch's visible keys [first, end) (see key_range)
};

// A gated launch that does not compute: one of a call's launches per answer of a device-side check (a bool mask that
// may be causal and / or key padding, decided without a host sync: attention.py's _mask_plan); every CTA leaves at
// its start
__device__ __forceinline__ bool gated_off(const int* gate, int want) { return want >= 0 && __ldg(gate) != want; }

// Batch b's visible keys [lo, hi): with krange (a bool mask's key padding, found on the device with its structure by
// the same check as the gate) that batch's range clamped to [0, lk), else all of them. Keys outside it get P = 0:
// the query-side kernels skip the 64-key steps wholly outside and mask the two at its ends; the dK / dV kernel
// skips its key block wholly outside (stores zeros) and masks the keys outside in a block that straddles an end.
struct KeyRange {
  int lo, hi;
};
template <typename P>
__device__ __forceinline__ KeyRange key_range(const P& p, int b) {
  if (p.krange == nullptr) return {0, p.lk};
  return {max(0, __ldg(p.krange + 2 * b)), min(p.lk, __ldg(p.krange + 2 * b + 1))};
}

// Shared memory of a kernel: its fixed tiles (FIXED bytes from 0), the ring's STAGES stages of STAGE bytes from
// kStage0, EXTRA bytes of per-stage vectors from kExtra, the ring's barriers from kBar; kBytes with alignment slack
template <int FIXED, int STAGE, int STAGES, int EXTRA = 0>
struct Frame {
  static constexpr int kStage0 = FIXED;
  static constexpr int kStageBytes = STAGE;
  static constexpr int kExtra = kStage0 + STAGES * STAGE;
  static constexpr int kBar = kExtra + EXTRA;
  static constexpr int kBytes = kBar + 8 * (1 + 2 * STAGES) + 1024;
};

template <int D, int STAGES>
struct Layout : Frame<3 * kBN * D, 5 * kBM * D, STAGES, STAGES * (2 * kBM * 4 + 8)> {
  static constexpr int kKBytes = kBN * D;      // k̂ (int8), one box
  static constexpr int kVBytes = kBN * D * 2;  // V̂ 16-bit, D / 64 chunks of (128 keys x 64 channels)
  static constexpr int kK = 0, kV = kKBytes;
  // a stage: q̂ + dO (16-bit) in perm_base's row order, dO8^T, q̂^T; the extra bytes: each stage's LSE2 (64 fp32)
  // and delta (64 fp32), then (SAGE_TRAIN_EARLY) each stage's Q scale and ψ(dO) scale (2 fp32) from kX
  static constexpr int kQ = 0, kDO = kBM * D, kDOT = 3 * kBM * D, kQT = 4 * kBM * D;
  static constexpr int kL = Frame<3 * kBN * D, 5 * kBM * D, STAGES, STAGES * (2 * kBM * 4 + 8)>::kExtra;
  static constexpr int kX = kL + STAGES * 2 * kBM * 4;
};

// 8-bit RNE of x * r (|x * r| <= 127 plus rounding) in the low byte: the bits of x * r + 1.5 * 2^23, not an F2I.
// SAGE_TRAIN_FMAROUND 1 (default): one FFMA, the exact product rounded once to an integer; 0: an FMUL and an FADD
// (__fmul_rn / __fadd_rn, never contracted), the product rounded to fp32 first, as the Triton kernels' _to_i8. The
// two differ only where x * r lies within ~2^-17 of a half-integer (one value in ~10^5), and then the FFMA's is the
// correctly rounded one; one instruction less per ψ value (64 a step in dK / dV, 32 in dQ and the forward).
#ifndef SAGE_TRAIN_FMAROUND
#define SAGE_TRAIN_FMAROUND 1
#endif
__device__ __forceinline__ uint32_t i8_bits(float x, float r) {
#if SAGE_TRAIN_FMAROUND
  return static_cast<uint32_t>(__float_as_int(__fmaf_rn(x, r, 12582912.0f)));
#else
  return static_cast<uint32_t>(__float_as_int(__fadd_rn(__fmul_rn(x, r), 12582912.0f)));
#endif
}
__device__ __forceinline__ uint32_t pack4(uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  return __byte_perm(__byte_perm(a, b, 0x0040), __byte_perm(c, d, 0x0040), 0x5410);
}

// SAGE_TRAIN_SMAGIC: S's start (four copies of 0x4B400000, set by Ring::init), its accumulator's fill, an accumulator
// as a float and the logits' offset that goes with it (z = fmaf(s_value(S), a, s_offset(off, a)) = S * a + off)
__shared__ __align__(16) uint32_t s_magic[4];
constexpr float kMagic = 12582912.0f;  // 1.5 * 2^23
__device__ __forceinline__ void s_fill(uint32_t (&d)[32]) {
#if SAGE_TRAIN_SMAGIC
#pragma unroll
  for (int i = 0; i < 32; i += 4)  // (volatile: one LDS.128 per four registers, not merged or hoisted)
    asm volatile("ld.volatile.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(d[i]), "=r"(d[i + 1]), "=r"(d[i + 2]), "=r"(d[i + 3])
                 : "r"(smem_u32(s_magic)));
#endif
}
__device__ __forceinline__ float s_value(uint32_t s) {
  return SAGE_TRAIN_SMAGIC ? __uint_as_float(s) : __int2float_rn(static_cast<int>(s));
}
__device__ __forceinline__ float s_offset(float off, float a) { return SAGE_TRAIN_SMAGIC ? fmaf(-kMagic, a, off) : off; }

// ψ of a (64 x 64) accumulator-layout tile x (element 4i + 2rh + e: row g + 8rh, column perm_base(i) + 4t + e of
// the step's operand order) with one scale per row, m[rh] / 127, m[rh] the row's amax (quad-uniform): the 8-bit A
// fragments of the two k-steps (frag[kk][2h + rh] = columns 32kk + 16h + 4t + {0..3} of row rh), the two row
// scales and, with SUMS, this lane's share of each row's sum of the INT8 values (16 of 64; exact int32)
template <bool SUMS = false>
__device__ __forceinline__ void psi_pack(const float (&x)[32], const float (&m)[2], uint32_t (&frag)[2][4],
                                         float (&scale)[2], int (*isum)[2] = nullptr) {
#pragma unroll
  for (int rh = 0; rh < 2; ++rh) {
    // (approximate divisions, as the Triton kernels' fp32 `/`: |x| * r stays within 127 * (1 + 2^-22), which
    // rounds to 127 at most; an IEEE division costs a slow-path call per row)
    const float r = m[rh] > 0.f ? __fdividef(127.f, m[rh]) : 0.f;
    scale[rh] = m[rh] * (1.f / 127.f);
    uint32_t bsum = 0;  // the bits' sum: each is 0x4B400000 + its value (wrapping: the values' sum, offset below)
#pragma unroll
    for (int kk = 0; kk < 2; ++kk)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int i0 = 4 * kk + 2 * h, i1 = i0 + 1;
        const uint32_t b0 = i8_bits(x[4 * i0 + 2 * rh], r), b1 = i8_bits(x[4 * i0 + 2 * rh + 1], r);
        const uint32_t b2 = i8_bits(x[4 * i1 + 2 * rh], r), b3 = i8_bits(x[4 * i1 + 2 * rh + 1], r);
        frag[kk][2 * h + rh] = pack4(b0, b1, b2, b3);
        if constexpr (SUMS) bsum += b0 + b1 + b2 + b3;
      }
    if constexpr (SUMS) (*isum)[rh] = static_cast<int>(bsum - 16u * 0x4B400000u);
  }
}

// psi_pack with each row's amax (|x| where ABS, else x, and 0) taken over the quad, over CHAINS chains (0: one)
template <bool ABS, int CHAINS, bool SUMS = false>
__device__ __forceinline__ void psi_rows(const float (&x)[32], uint32_t (&frag)[2][4], float (&scale)[2],
                                         int (*isum)[2] = nullptr) {
  float m[2];
#pragma unroll
  for (int rh = 0; rh < 2; ++rh) {
    if constexpr (CHAINS > 1) {
      // independent chains over the row's 16 values, then their maxima: the same maximum with a shorter dependency
      // path (16 FMNMX deep with one chain)
      static_assert(CHAINS == 2 || CHAINS == 4 || CHAINS == 8, "2, 4 or 8 chains");
      constexpr int kC = CHAINS;
      float c[kC];
#pragma unroll
      for (int v = 0; v < 16; ++v) {
        const float xv = ABS ? fabsf(x[4 * (v / 2) + 2 * rh + (v & 1)]) : x[4 * (v / 2) + 2 * rh + (v & 1)];
        c[v % kC] = v < kC ? xv : fmaxf(c[v % kC], xv);
      }
#pragma unroll
      for (int w = kC / 2; w >= 1; w /= 2)
#pragma unroll
        for (int k = 0; k < w; ++k) c[k] = fmaxf(c[k], c[k + w]);
      m[rh] = ABS ? c[0] : fmaxf(c[0], 0.f);  // (ψ(P): the max with 0, as the single chain starts)
    } else {
      m[rh] = 0.f;
#pragma unroll
      for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int e = 0; e < 2; ++e) m[rh] = fmaxf(m[rh], ABS ? fabsf(x[4 * i + 2 * rh + e]) : x[4 * i + 2 * rh + e]);
    }
    m[rh] = fmaxf(m[rh], __shfl_xor_sync(0xffffffffu, m[rh], 1));
    m[rh] = fmaxf(m[rh], __shfl_xor_sync(0xffffffffu, m[rh], 2));
  }
  psi_pack<SUMS>(x, m, frag, scale, isum);
}

__device__ __forceinline__ void wg_wait2() { asm volatile("wgmma.wait_group.sync.aligned 2;\n" ::: "memory"); }

// SAGE_TRAIN_PP's turns among NWG consumer warpgroups (ON false: none): warpgroup w's turn is named barrier 1 + w,
// passed on by warpgroup w - 1 (mod NWG) when it has issued its own; warpgroup 0 has the first (start), and takes
// the last warpgroup's final pass after its loop (finish), so that no barrier is left with an arrival
template <int NWG, bool ON>
struct Turns {
  int wg;
  __device__ __forceinline__ void start() const {
    if (ON && wg == NWG - 1) asm volatile("bar.arrive 1, 256;\n" ::: "memory");
  }
  __device__ __forceinline__ void take() const {
    if (ON) asm volatile("bar.sync %0, 256;\n" ::"r"(1 + wg) : "memory");
  }
  __device__ __forceinline__ void pass() const {
    if (ON) asm volatile("bar.arrive %0, 256;\n" ::"r"(1 + (wg + 1) % NWG) : "memory");
  }
  __device__ __forceinline__ void finish() const {
    if (ON && wg == 0) asm volatile("bar.sync 1, 256;\n" ::: "memory");
  }
};
using NoTurns = Turns<2, false>;

// acc[N / 2 * h ...] (fp32, N of the D channels) += prod (s32, 64 rows x N, landed) * f[row half]
template <int D, int N>
__device__ __forceinline__ void fold_int8_product(float (&acc)[D / 2], int h, const uint32_t (&prod)[N / 2],
                                                  const float (&f)[2]) {
#pragma unroll
  for (int i = 0; i < N / 8; ++i)
#pragma unroll
    for (int rh = 0; rh < 2; ++rh)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float& a = acc[N / 2 * h + 4 * i + 2 * rh + e];
        a = fmaf(__int2float_rn(static_cast<int>(prod[4 * i + 2 * rh + e])), f[rh], a);
      }
}

// acc (fp32, 64 rows x D channels) += (frag (64 rows x 64, s8, the A fragments of two k-steps) · B^T) * f[row half],
// B: the (D x 64) s8 tile at descriptor db (64-byte rows); in H column parts of D / H channels, each issued,
// waited for and folded before the next (H = 2: an int32 product of 32 registers, not 64), each part's issue a turn of tu
template <int D, int H, typename TU = NoTurns>
__device__ __forceinline__ void int8_product(float (&acc)[D / 2], const uint32_t (&frag)[2][4], uint64_t db,
                                             const float (&f)[2], const TU& tu = TU{}) {
  constexpr int N = D / H;
  static_assert(N == 64 || N == 128, "64 or 128 channels a part");
#pragma unroll
  for (int h = 0; h < H; ++h) {
    uint32_t prod[N / 2];
    const uint64_t dbh = db + h * (N * 64 / 16);  // channels N * h on: N * h rows of 64 bytes
    tu.take();
    wg_fence();
    wgmma_s8_rs2<N>(prod, frag, dbh);
    wg_commit();
    tu.pass();
    wg_wait0();
    reg_fence(prod);
    fold_int8_product<D, N>(acc, h, prod, f);
  }
}

// ------------------------------------------------------------------------------------------ the kernels' frame
// The dynamic shared memory, 1024-byte aligned (the 128B swizzle's atom)
__device__ __forceinline__ uint8_t* smem_base() {
  extern __shared__ uint8_t smem_raw[];
  return smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
}

// The barriers at `mem`: `first` (the CTA's fixed tiles: the producer's arrival + their bytes), then the STAGES-deep
// ring of steps: full[s] (the producer's arrival + the stage's bytes), empty[s] (one arrival per consumer warp).
// Step j uses stage j % STAGES in phase (j / STAGES) & 1.
template <int STAGES, int CW = kCW>
struct Ring {
  uint64_t* first;
  uint64_t* full;
  uint64_t* empty;
  __device__ explicit Ring(uint8_t* mem)
      : first(reinterpret_cast<uint64_t*>(mem)), full(first + 1), empty(first + 1 + STAGES) {}
  __device__ void init() const {  // by thread 0; every thread of the CTA calls it
    if (threadIdx.x == 0) {
      mbar_init(first, 1);
      for (int s = 0; s < STAGES; ++s) {
        mbar_init(&full[s], 1);
        mbar_init(&empty[s], CW);
      }
      if (SAGE_TRAIN_SMAGIC)
        for (int i = 0; i < 4; ++i) s_magic[i] = 0x4B400000u;
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
  }
  // the producer, before filling step j: the stage's previous step released by every consumer warp; its full barrier
  __device__ uint64_t* acquire(int j) const {
    const int s = j % STAGES;
    if (j >= STAGES) mbar_wait(&empty[s], ((j / STAGES) - 1) & 1);
    return &full[s];
  }
  __device__ void wait_full(int j) const { mbar_wait(&full[j % STAGES], (j / STAGES) & 1); }
  __device__ void release(int j) const { mbar_arrive_one(&empty[j % STAGES]); }  // this consumer warp is done
};

// The producer lane's loads of steps [0, n) (the dQ kernel and the forward): each step's stage once every consumer
// warp released it, pre(j) (plain stores into the stage, visible to the consumers with the arrival that follows),
// its full barrier expecting the stage's bytes; load(stage, bar, j) issues the TMA loads
template <int STAGES, int CW, typename Load, typename Pre>
__device__ __forceinline__ void produce_steps(const Ring<STAGES, CW>& ring, uint8_t* stage0, int stage_bytes, int n,
                                              Load&& load, Pre&& pre) {
  for (int j = 0; j < n; ++j) {
    uint64_t* bar = ring.acquire(j);
    uint8_t* st = stage0 + (j % STAGES) * stage_bytes;
    pre(j);
    mbar_expect_tx(bar, stage_bytes);
    load(st, bar, j);
  }
}

// SAGE_TRAIN_EARLY: the K scale of the CTA's step i (key step j) in its stage's slot of the (STAGES fp32) array at x:
// the dQ kernel's and the forward's producer lane writes it before arriving on the stage (GUARD: 0 past the scales,
// as the dQ kernel always read them), the consumers read it once they waited for the stage
template <int STAGES>
__device__ __forceinline__ float& stage_k_scale(uint8_t* x, int i) {
  return reinterpret_cast<float*>(x)[i % STAGES];
}
template <int STAGES, bool GUARD, typename P>
__device__ __forceinline__ void put_k_scale(uint8_t* x, const P& p, int bhk, int i, int j) {
  if (SAGE_TRAIN_EARLY)
    stage_k_scale<STAGES>(x, i) = !GUARD || j < p.nkb ? __ldg(p.ks + static_cast<size_t>(bhk) * p.nkb + j) : 0.f;
}

// The producer warpgroup gives its registers to the consumers; true in the one lane that issues the TMA loads.
// (NWG consumer warpgroups before it)
template <int NWG = 2>
__device__ __forceinline__ bool producer_lane() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n");
  return threadIdx.x == NWG * 128;
}

// A consumer thread (after taking the producer's registers): its warpgroup (through a shuffle: warp-uniform, so
// what derives from it lives in uniform registers), its warp in the warpgroup, its quad row g8 and lane t in it.
struct Lane {
  int wg, w, g8, t;
};
// (NWG consumer warpgroups: 240 registers a thread with two, 160 with three; the producer keeps 24)
template <int NWG = 2>
__device__ __forceinline__ Lane consumer_lane() {
  static_assert(NWG == 2 || NWG == 3, "two or three consumer warpgroups");
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(NWG == 2 ? 240 : 160));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  return Lane{__shfl_sync(0xffffffffu, warp / 4, 0), warp % 4, lane / 4, lane % 4};
}

// The 8 TMA boxes that load rows [n0, n0 + 64) of head bh, viewed as (c0..., row % 4, row / 4, head), in
// perm_base's order: row 8r + 2t + e of dst holds row n0 + perm_base(r) + 4t + e (row_bytes apart in dst)
__device__ __forceinline__ void tma_perm_rows(uint8_t* dst, const CUtensorMap* map, uint64_t* bar, int c0, int n0,
                                              int bh, int row_bytes) {
#pragma unroll
  for (int r = 0; r < 8; ++r)
    tma_load_4d(dst + r * 8 * row_bytes, map, bar, c0, perm_base(r) & 3, (n0 + (perm_base(r) & ~3)) / 4, bh);
}

// S (64 x 64, s32) = A (64 x D s8) · B (64 x D s8)^T, both K-major in shared memory at descriptors da, db; with
// SAGE_TRAIN_SMAGIC onto the accumulator's fill (s_fill, before the wgmma fence), else from zero
template <int D>
__device__ __forceinline__ void issue_s(uint32_t (&sacc)[32], uint64_t da, uint64_t db) {
#pragma unroll
  for (int kk = 0; kk < D / 32; ++kk) wgmma_s8_ss_n64(sacc, da + 2 * kk, db + 2 * kk, SAGE_TRAIN_SMAGIC ? 1 : kk);
}

// dP (64 x 64, f32) = A (64 x D, 16-bit) · B (64 x D, 16-bit)^T, each in D / 64 chunks of 64 channels (128-byte
// rows, 128B swizzle), a_chunk / b_chunk bytes apart; with SAGE_TRAIN_DFILL dP = its fill - A · B^T
template <int D, typename T>
__device__ __forceinline__ void issue_dp(float (&dp)[32], const uint8_t* a, int a_chunk, const uint8_t* b,
                                         int b_chunk) {
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const int c = kk / 4, j = kk % 4;  // 64-channel chunk, 16-channel step in it (32 bytes)
    wgmma_16_ss_n64<T, SAGE_TRAIN_DFILL>(dp, smem_desc<128>(a + c * a_chunk) + 2 * j,
                                         smem_desc<128>(b + c * b_chunk) + 2 * j, SAGE_TRAIN_DFILL ? 1 : kk);
  }
}

// A step's masking: Edge<0> never, Edge<1> always, Edge<2> a runtime test
template <int E>
struct Edge {
  static constexpr int value = E;
};
// step(j, Edge<...>) for j in [j0, j1): where SAGE_TRAIN_EDGELOOP, the steps [f0, f1) (clamped) that need no mask in a
// loop of their own and the others with the mask; else one loop with the runtime test
template <typename Step>
__device__ __forceinline__ void run_steps(int j0, int j1, int f0, int f1, Step&& step) {
#if SAGE_TRAIN_EDGELOOP
  f0 = min(max(f0, j0), j1);
  f1 = min(max(f1, f0), j1);
  int j = j0;
  for (; j < f0; ++j) step(j, Edge<1>{});
  for (; j < f1; ++j) step(j, Edge<0>{});
  for (; j < j1; ++j) step(j, Edge<1>{});
#else
  for (int j = j0; j < j1; ++j) step(j, Edge<2>{});
#endif
}

// The (128 rows x D) tile of a CTA on rows (queries) of one head: the dQ kernel and the forward. The CTA's steps
// i = 0 .. n_tiles - 1 (its ring's) are the 64-key steps j = j0 + i: those holding a key of the batch's range
// [klo, khi) that the CTA's last row sees
struct QueryBlock {
  int m0, bh, b, h, bhk, j0, n_tiles, klo, khi;  // first row, (batch, head), its kv head, its key steps, key range
};
template <bool CAUSAL, int ROWS = 2 * kBM, typename P>
__device__ __forceinline__ QueryBlock query_block(const P& p) {
  QueryBlock q;
  q.m0 = (CAUSAL ? gridDim.x - 1 - blockIdx.x : blockIdx.x) * ROWS;  // causal: the longest rows first
  q.bh = blockIdx.y;
  q.b = q.bh / p.hq;
  q.h = q.bh % p.hq;
  q.bhk = q.b * (p.hq / p.group) + q.h / p.group;
  const KeyRange kr = key_range(p, q.b);
  q.klo = kr.lo;
  q.khi = kr.hi;
  const int hi = CAUSAL ? min(kr.hi, q.m0 + ROWS + p.coff) : kr.hi;  // keys the CTA's last row sees
  q.j0 = kr.lo / kBM;
  q.n_tiles = hi > kr.lo ? (hi + kBM - 1) / kBM - q.j0 : 0;
  return q;
}
// The Q scale (times c) of warpgroup wg's 64 rows, which lie in one 128-query block of Q's scales; with three
// warpgroups the last CTA's third may lie wholly past Lq and past the scales (its rows compute nothing: 0)
template <int NWG, typename P>
__device__ __forceinline__ float wg_q_scale(const P& p, const QueryBlock& q, int wg) {
  const int blk = (q.m0 + wg * 64) / 128;
  return (NWG == 2 || blk < p.nqb ? __ldg(p.qs + static_cast<size_t>(q.bh) * p.nqb + blk) : 0.f) * p.c;
}
// The CTA's steps [f0, f1) that need no mask for warpgroup wg's rows: whole steps inside the key range that every
// row of the warpgroup sees (causal: its first row's reach); run_steps clamps them to the CTA's steps
template <bool CAUSAL, typename P>
__device__ __forceinline__ int2 full_steps(const QueryBlock& q, int wg, const P& p) {
  const int vis = CAUSAL ? min(q.khi, q.m0 + wg * 64 + p.coff + 1) : q.khi;
  return make_int2((q.klo + kBM - 1) / kBM - q.j0, (vis > 0 ? vis / kBM : 0) - q.j0);
}

// Whether element 4i + 2rh + e of a (64 rows x 64 keys) step in the rows' layout (row row0 + 8rh, key n0 + perm_base(i)
// + 4t + e) is masked: its key outside the key range [klo, khi) (past Lk, at least) or, causal, past the row's reach
// row + coff
template <bool CAUSAL>
__device__ __forceinline__ bool row_masked(int i, int rh, int e, int n0, int t, int row0, int klo, int khi, int coff) {
  const int key = n0 + perm_base(i) + 4 * t + e;
  return key >= khi || key < klo || (CAUSAL && key > row0 + 8 * rh + coff);
}

// The logits of a (64 rows x 64 keys) step in the rows' layout (element 4i + 2rh + e: row row0 + 8rh, key n0 +
// perm_base(i) + 4t + e): S * a + off[row half], -inf where masked (only under `edge`: keys outside [klo, khi) or,
// causal, past the row's reach row + coff)
template <bool CAUSAL>
__device__ __forceinline__ void row_logits(float (&z)[32], const uint32_t (&sacc)[32], float a, const float (&off)[2],
                                           bool edge, int n0, int t, int row0, int klo, int khi, int coff) {
  const float o[2] = {s_offset(off[0], a), s_offset(off[1], a)};
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int rh = 0; rh < 2; ++rh)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float v = fmaf(s_value(sacc[4 * i + 2 * rh + e]), a, o[rh]);
        z[4 * i + 2 * rh + e] = edge && row_masked<CAUSAL>(i, rh, e, n0, t, row0, klo, khi, coff) ? -INFINITY : v;
      }
}

// Rows row0 and row0 + 8 (below `limit`) of a thread's accumulator (64 rows x D, fp32) times scale[row half], as
// 16-bit pairs at out + row * son + column
template <int D, typename T>
__device__ __forceinline__ void store_rows(T* out, long long son, int row0, int limit, const float (&acc)[D / 2],
                                           const float (&scale)[2], int t) {
#pragma unroll
  for (int rh = 0; rh < 2; ++rh) {
    const int row = row0 + 8 * rh;
    if (row >= limit) continue;
#pragma unroll
    for (int i = 0; i < D / 8; ++i)
      store2<T>(out + row * son + 8 * i + 2 * t, acc[4 * i + 2 * rh] * scale[rh], acc[4 * i + 2 * rh + 1] * scale[rh]);
  }
}

template <int D, int STAGES, bool CAUSAL, typename T>
__global__ void __launch_bounds__(kThreads, 1)
    dkdv_kernel(const __grid_constant__ CUtensorMap tm_k, const __grid_constant__ CUtensorMap tm_v,
                const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_do,
                const __grid_constant__ CUtensorMap tm_dot, const __grid_constant__ CUtensorMap tm_qt,
                const __grid_constant__ CUtensorMap tm_lse, const __grid_constant__ CUtensorMap tm_dl,
                const Params p) {
#if SAGE_SM90A
  if (gated_off(p.gate, p.want)) return;
  using L = Layout<D, STAGES>;
  uint8_t* smem = smem_base();
  uint8_t* sk = smem + L::kK;
  uint8_t* sv = smem + L::kV;
  const Ring<STAGES> ring(smem + L::kBar);

  const int n0 = blockIdx.x * kBN;
  const int bhk = blockIdx.y;
  const int hkv = p.hq / p.group, b = bhk / hkv, hk = bhk % hkv;
  // the first query step that sees a key of the block (causal: key n visible from query m iff n <= m + coff)
  const int lo = CAUSAL ? max(0, n0 - p.coff) / kBM * kBM : 0;
  // past the last query the block runs: Lq, or lo where no key of the block is in the batch's key range (no steps;
  // dK = dV = 0 stored)
  const KeyRange kr = key_range(p, b);
  const int qend = n0 < kr.hi && n0 + kBN > kr.lo ? p.lq : lo;
  ring.init();

  if (threadIdx.x >= kCW * 32) {  // producer warpgroup
    if (producer_lane()) {
      tma_prefetch(&tm_k);
      tma_prefetch(&tm_v);
      tma_prefetch(&tm_q);
      tma_prefetch(&tm_do);
      tma_prefetch(&tm_dot);
      tma_prefetch(&tm_qt);
      tma_prefetch(&tm_lse);
      tma_prefetch(&tm_dl);
      mbar_expect_tx(ring.first, L::kKBytes + L::kVBytes);
      tma_load_3d(sk, &tm_k, ring.first, 0, n0, bhk);
#pragma unroll
      for (int c = 0; c < D / 64; ++c) tma_load_3d(sv + c * kBN * 128, &tm_v, ring.first, 64 * c, n0, bhk);
      int it = 0;
      for (int g = 0; g < p.group; ++g) {
        const int bh = b * p.hq + hk * p.group + g;
        for (int m0 = lo; m0 < qend; m0 += kBM, ++it) {
          uint64_t* bar = ring.acquire(it);
          uint8_t* st = smem + L::kStage0 + (it % STAGES) * L::kStageBytes;
          float* sl = reinterpret_cast<float*>(smem + L::kL) + (it % STAGES) * 2 * kBM;
          if (SAGE_TRAIN_EARLY) {  // the step's scales, visible to the consumers with this arrival (release)
            float* sx = reinterpret_cast<float*>(smem + L::kX) + (it % STAGES) * 2;
            sx[0] = __ldg(p.qs + static_cast<size_t>(bh) * p.nqb + m0 / 128);
            sx[1] = __ldg(p.sdo + static_cast<size_t>(bh) * p.nqb + m0 / 128);
          }
          mbar_expect_tx(bar, L::kStageBytes + 2 * kBM * 4);
          tma_perm_rows(st + L::kQ, &tm_q, bar, 0, m0, bh, D);  // queries in perm_base's order
#pragma unroll
          for (int c = 0; c < D / 64; ++c) tma_perm_rows(st + L::kDO + c * kBM * 128, &tm_do, bar, 64 * c, m0, bh, 128);
          tma_load_3d(st + L::kDOT, &tm_dot, bar, m0, 0, bh);
          tma_load_3d(st + L::kQT, &tm_qt, bar, m0, 0, bh);
          tma_load_3d(sl, &tm_lse, bar, m0, bh, 0);
          tma_load_3d(sl + kBM, &tm_dl, bar, m0, bh, 0);
        }
      }
    }
    return;
  }

  // consumers
  const Lane ln = consumer_lane();
  const int t = ln.t;
  const int key0 = n0 + ln.wg * 64 + ln.w * 16 + ln.g8;  // this thread's keys: key0, key0 + 8
  // which of them lie outside the key range (P = 0), and whether any key of the warpgroup does (then every step masks)
  const bool kout[2] = {key0 < kr.lo || key0 >= kr.hi, key0 + 8 < kr.lo || key0 + 8 >= kr.hi};
  const bool kpart = n0 + ln.wg * 64 < kr.lo || n0 + ln.wg * 64 + 64 > kr.hi;
  const int kblk = (n0 + ln.wg * 64) / 64;
  const float kc = (kblk < p.nkb ? __ldg(p.ks + static_cast<size_t>(bhk) * p.nkb + kblk) : 0.f) * p.c;
  const uint64_t da_k = smem_desc<D>(sk + ln.wg * 64 * D);

  float dv[D / 2], dk[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) dv[i] = 0.f, dk[i] = 0.f;
  const Turns<2, (SAGE_TRAIN_PP & 4) != 0> turn{ln.wg};
  const Turns<2, (SAGE_TRAIN_PP & 12) == 12> pturn{ln.wg};
  turn.start();

  mbar_wait(ring.first, 0);
  int it = 0;
  // the query steps whose queries all see every key of the warpgroup (causal: from its last key's reach on)
  const int full0 = CAUSAL ? (max(0, n0 + ln.wg * 64 + 63 - p.coff) + kBM - 1) / kBM : 0;
  for (int g = 0; g < p.group; ++g) {
    [[maybe_unused]] const int bh = b * p.hq + hk * p.group + g;  // (read by the step's scale loads without EARLY)
    auto step = [&](int jm, auto edge_c) {
      constexpr int kEdge = decltype(edge_c)::value;
      const int m0 = jm * kBM;
      const uint8_t* st = smem + L::kStage0 + (it % STAGES) * L::kStageBytes;
      const float* sl = reinterpret_cast<const float*>(smem + L::kL) + (it % STAGES) * 2 * kBM;
      // the step needs a mask where a key of the warpgroup is past a query's causal reach or outside the key range,
      // or queries pass Lq
      const bool edge = kEdge == 1 ||
                        (kEdge == 2 && ((CAUSAL && n0 + ln.wg * 64 + 63 > m0 + p.coff) || kpart || m0 + kBM > p.lq));
      uint32_t sacc[32];
      float dp[32];
#if SAGE_TRAIN_EARLY
      s_fill(sacc);
      ring.wait_full(it);
      const float2 sc = *reinterpret_cast<const float2*>(smem + L::kX + (it % STAGES) * 8);
      const float qraw = sc.x, sdo = sc.y;
      float2 lse[8];  // this lane's queries' LSE2 pairs (column groups i)
#pragma unroll
      for (int i = 0; i < 8; ++i) lse[i] = *reinterpret_cast<const float2*>(sl + perm_base(i) + 4 * t);
#else
      const float qraw = __ldg(p.qs + static_cast<size_t>(bh) * p.nqb + m0 / 128);
      const float sdo = __ldg(p.sdo + static_cast<size_t>(bh) * p.nqb + m0 / 128);
      ring.wait_full(it);
      s_fill(sacc);
#endif
#if SAGE_TRAIN_DFILL
      // dP^T's columns are the lane's queries perm_base(i) + 4t + e: their delta, loaded straight into both rows' pairs
      // (volatile: the loads stay before the fence; copies by register moves could sink past it, and ptxas would then
      // fence and wait again itself, C7519)
#pragma unroll
      for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int rh = 0; rh < 2; ++rh)
          asm volatile("ld.volatile.shared.v2.f32 {%0, %1}, [%2];\n"
                       : "=f"(dp[4 * i + 2 * rh]), "=f"(dp[4 * i + 2 * rh + 1])
                       : "r"(smem_u32(sl + kBM + perm_base(i) + 4 * t)));
#endif
      turn.take();
      wg_fence();
      issue_s<D>(sacc, da_k, smem_desc<D>(st + L::kQ));
      wg_commit();
      issue_dp<D, T>(dp, sv + ln.wg * 64 * 128, kBN * 128, st + L::kDO, kBM * 128);
      wg_commit();
      turn.pass();
      wg_wait1();  // S^T
      reg_fence(sacc);

      // P^T = exp2(S^T * kc * qraw - LSE2) (0 where masked)
      const float a = kc * qraw;
      float pt[32];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int q = perm_base(i) + 4 * t;  // this lane's queries q, q + 1 of column group i
#if SAGE_TRAIN_EARLY
        const float2 l2 = lse[i];
#else
        const float2 l2 = *reinterpret_cast<const float2*>(sl + q);
#endif
        const float off[2] = {s_offset(-l2.x, a), s_offset(-l2.y, a)};
#pragma unroll
        for (int rh = 0; rh < 2; ++rh)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float z = fmaf(s_value(sacc[4 * i + 2 * rh + e]), a, off[e]);
            if (edge) {
              const int qq = m0 + q + e;
              if (qq >= p.lq || kout[rh] || (CAUSAL && key0 + 8 * rh > qq + p.coff)) z = -INFINITY;
            }
            pt[4 * i + 2 * rh + e] = ex2(z);
          }
      }
      uint32_t pa[2][4], da[2][4];
      float sp[2], sds[2];
      psi_rows<false, max_chains<D>()>(pt, pa, sp);

      wg_wait0();  // dP^T
      reg_fence(dp);
#if SAGE_TRAIN_DFILL
#pragma unroll
      for (int x = 0; x < 32; ++x) dp[x] *= pt[x];  // -dS^T (dp: delta - dP^T)
#else
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float2 d2 = *reinterpret_cast<const float2*>(sl + kBM + perm_base(i) + 4 * t);
#pragma unroll
        for (int rh = 0; rh < 2; ++rh)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int x = 4 * i + 2 * rh + e;
            dp[x] = pt[x] * (dp[x] - (e ? d2.y : d2.x));  // dS^T
          }
      }
#endif
      psi_rows<true, max_chains<D>()>(dp, da, sds);
      if (SAGE_TRAIN_DFILL) sds[0] = -sds[0], sds[1] = -sds[1];  // (the scales of -ψ(-dS^T) = ψ(dS^T))

      // dV += ψ(P^T)·ψ(dO) * (sp * sdo), then dK += ψ(dS^T)·q̂ * (sds * qraw): one int32 product at a time
#pragma unroll
      for (int kk = 0; kk < 2; ++kk) reg_fence(pa[kk]), reg_fence(da[kk]);  // the fragments complete before the fence
      const float fv[2] = {sp[0] * sdo, sp[1] * sdo};
      int8_product<D, D == 128 && (SAGE_TRAIN_PARTS & 1) ? 2 : 1>(dv, pa, smem_desc<64>(st + L::kDOT), fv, pturn);
      const float fk[2] = {sds[0] * qraw, sds[1] * qraw};
      int8_product<D, D == 128 && (SAGE_TRAIN_PARTS & 2) ? 2 : 1>(dk, da, smem_desc<64>(st + L::kQT), fk, pturn);
      ring.release(it);
      ++it;
    };
    run_steps(lo / kBM, (qend + kBM - 1) / kBM, full0, kpart ? full0 : qend / kBM, step);
  }
  turn.finish();

  // epilogue: dK * softmax scale, dV; rows past Lk are not stored
  const long long off = b * p.sob + hk * p.soh;
  store_rows<D, T>(static_cast<T*>(p.dk) + off, p.son, key0, p.lk, dk, {p.sm, p.sm}, t);
  store_rows<D, T>(static_cast<T*>(p.dv) + off, p.son, key0, p.lk, dv, {1.f, 1.f}, t);
#endif
}

// ------------------------------------------------------------------------------------------ dQ
struct DqParams {
  const float* qs;     // (B*Hq, nqb): Q scales, 128 queries each
  const float* ks;     // (B*Hkv, nkb): K scales, 64 keys each
  const float* lse2;   // (B*Hq, lq): LSE in log2 units, +inf for rows without keys
  const float* delta;  // (B*Hq, lq)
  const float* kmean;  // (B*Hkv, D): K's token mean (the smoothing), for dQ's correction rowsum(ψ(dS))·μ_K
  void* dq;
  int hq, group, lq, lk, nqb, nkb;
  float c;   // softmax scale * log2(e)
  float sm;  // softmax scale
  int coff;  // causal: key n visible from query m iff n <= m + coff
  long long sob, soh, son;  // dQ strides (elements)
  const int* gate;  // as Params'
  int want;
  const int* krange;  // as Params'
};

constexpr int kDqScaleBytes(int stages) { return (stages * 4 + 15) / 16 * 16; }
template <int D, int STAGES, int NWG = 2>
struct DqLayout : Frame<3 * NWG * kBM * D, 4 * kBM * D, STAGES, kDqScaleBytes(STAGES) + NWG * 32 * 16> {  // (8-aligned)
  static constexpr int kQBytes = NWG * kBM * D;       // q̂ of the CTA's 64 * NWG queries (int8), one box
  static constexpr int kDOBytes = NWG * kBM * D * 2;  // dO 16-bit, D / 64 chunks of (64 * NWG queries x 64 channels)
  static constexpr int kQ = 0, kDO = kQBytes;
  static constexpr int kK = 0, kV = kBM * D, kKT = 3 * kBM * D;  // a stage: k̂ + V̂ (16-bit) in perm_base's order, k̂^T
  // (SAGE_TRAIN_EARLY) each stage's K scale, one fp32, from kX; (SAGE_TRAIN_DFILL) from kD a 16-byte slot per quad
  // of consumer lanes: {delta, delta} of its row g, then of its row g + 8
  static constexpr int kX =
      Frame<3 * NWG * kBM * D, 4 * kBM * D, STAGES, kDqScaleBytes(STAGES) + NWG * 32 * 16>::kExtra;
  static constexpr int kD = kX + kDqScaleBytes(STAGES);
};

// dQ of 64 * NWG queries (NWG consumer warpgroups of 64: SAGE_TRAIN_DQ_WG) of one (batch, query head): per 64-key
// step S = q̂·k̂^T (s8) and dP = dO·V̂^T (16-bit) as two wgmma groups, P = exp2(S * qs * ks * c - LSE2) while dP
// runs, dS = P ∘ (dP - delta), ψ(dS) per query row over the 64 keys (psi="split"), dQ += ψ(dS)·k̂ (INT8, k̂^T as the
// K-major B operand) times the row scale and the K scale; the row sums of ψ(dS) (times the row scale) give the
// smoothing correction rowsum·μ_K at the end, and dQ is multiplied by the softmax scale. k̂ and V̂ come in
// perm_base's row order, so that S's and dP's columns are the keys of the INT8 A fragments.
template <int D, int STAGES, bool CAUSAL, typename T, int NWG = SAGE_TRAIN_DQ_WG>
__global__ void __launch_bounds__(128 * (NWG + 1), 1)
    dq_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_do,
              const __grid_constant__ CUtensorMap tm_k, const __grid_constant__ CUtensorMap tm_v,
              const __grid_constant__ CUtensorMap tm_kt, const DqParams p) {
#if SAGE_SM90A
  if (gated_off(p.gate, p.want)) return;
  using L = DqLayout<D, STAGES, NWG>;
  constexpr int kRows = NWG * kBM;  // the CTA's queries
  uint8_t* smem = smem_base();
  uint8_t* sq = smem + L::kQ;
  uint8_t* sdo = smem + L::kDO;
  const Ring<STAGES, 4 * NWG> ring(smem + L::kBar);
  const QueryBlock qb = query_block<CAUSAL, kRows>(p);
  ring.init();

  if (threadIdx.x >= NWG * 128) {  // producer warpgroup
    if (producer_lane<NWG>()) {
      tma_prefetch(&tm_q);
      tma_prefetch(&tm_do);
      tma_prefetch(&tm_k);
      tma_prefetch(&tm_v);
      tma_prefetch(&tm_kt);
      mbar_expect_tx(ring.first, L::kQBytes + L::kDOBytes);
      tma_load_3d(sq, &tm_q, ring.first, 0, qb.m0, qb.bh);
#pragma unroll
      for (int c = 0; c < D / 64; ++c) tma_load_3d(sdo + c * kRows * 128, &tm_do, ring.first, 64 * c, qb.m0, qb.bh);
      produce_steps(ring, smem + L::kStage0, L::kStageBytes, qb.n_tiles, [&](uint8_t* st, uint64_t* bar, int i) {
        const int n0 = (qb.j0 + i) * kBM;
        tma_perm_rows(st + L::kK, &tm_k, bar, 0, n0, qb.bhk, D);  // keys in perm_base's order
#pragma unroll
        for (int c = 0; c < D / 64; ++c) tma_perm_rows(st + L::kV + c * kBM * 128, &tm_v, bar, 64 * c, n0, qb.bhk, 128);
        tma_load_3d(st + L::kKT, &tm_kt, bar, n0, 0, qb.bhk);
      }, [&](int i) { put_k_scale<STAGES, true>(smem + L::kX, p, qb.bhk, i, qb.j0 + i); });
    }
    return;
  }

  // consumers
  const Lane ln = consumer_lane<NWG>();
  const int t = ln.t;
  const int row0 = qb.m0 + ln.wg * 64 + ln.w * 16 + ln.g8;  // this thread's queries: row0, row0 + 8
  const float qsc = wg_q_scale<NWG>(p, qb, ln.wg);
  float l2[2], dl[2];
#pragma unroll
  for (int rh = 0; rh < 2; ++rh) {
    const int row = row0 + 8 * rh;
    l2[rh] = row < p.lq ? __ldg(p.lse2 + static_cast<size_t>(qb.bh) * p.lq + row) : INFINITY;  // P = 0 past Lq
    dl[rh] = row < p.lq ? __ldg(p.delta + static_cast<size_t>(qb.bh) * p.lq + row) : 0.f;
  }
  const uint64_t da_q = smem_desc<D>(sq + ln.wg * 64 * D);
#if SAGE_TRAIN_DFILL
  // dP's fill: this quad's slot (the four lanes write the same words)
  const uint32_t dslot = smem_u32(smem + L::kD + (threadIdx.x >> 2) * 16);
  asm volatile("st.shared.v4.f32 [%0], {%1, %1, %2, %2};\n" ::"r"(dslot), "f"(dl[0]), "f"(dl[1]) : "memory");
  __syncwarp();
  auto d_fill = [&](float(&dp)[32]) {  // (volatile: one LDS.128 per four registers each step, not hoisted)
#pragma unroll
    for (int i = 0; i < 32; i += 4)
      asm volatile("ld.volatile.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                   : "=f"(dp[i]), "=f"(dp[i + 1]), "=f"(dp[i + 2]), "=f"(dp[i + 3])
                   : "r"(dslot));
  };
#else
  auto d_fill = [](float(&)[32]) {};
#endif

  float dq[D / 2], rs[2] = {0.f, 0.f};
#pragma unroll
  for (int i = 0; i < D / 2; ++i) dq[i] = 0.f;
  static_assert(!(SAGE_TRAIN_DQPIPE && (SAGE_TRAIN_PP & 16)), "SAGE_TRAIN_PP's dQ turns are not for SAGE_TRAIN_DQPIPE");
  const Turns<NWG, (SAGE_TRAIN_PP & 16) != 0> turn{ln.wg};
  const Turns<NWG, (SAGE_TRAIN_PP & 48) == 48> pturn{ln.wg};
  turn.start();

  mbar_wait(ring.first, 0);
  // S = q̂·k̂^T and dP = dO·V̂^T of the step at stage st (two commit groups)
  auto issue_s_dp = [&](uint32_t(&sacc)[32], float(&dp)[32], const uint8_t* st) {
    issue_s<D>(sacc, da_q, smem_desc<D>(st + L::kK));
    wg_commit();
    issue_dp<D, T>(dp, sdo + ln.wg * 64 * 128, kRows * 128, st + L::kV, kBM * 128);
    wg_commit();
  };
#if SAGE_TRAIN_DQPIPE
  static_assert(!SAGE_TRAIN_DQ_PARTS, "SAGE_TRAIN_DQPIPE takes the dQ product whole");
  if (qb.n_tiles > 0) {
  uint32_t sacc[32];  // S and dP of the coming step, issued by the one before it
  float dp[32];
  ring.wait_full(0);
  s_fill(sacc);
  d_fill(dp);
  wg_fence();
  issue_s_dp(sacc, dp, smem + L::kStage0);
#endif
  auto step = [&](int i, auto edge_c) {  // the CTA's step i: key step j
    constexpr int kEdge = decltype(edge_c)::value;
    const int j = qb.j0 + i;
    const int n0 = j * kBM;
    const uint8_t* st = smem + L::kStage0 + (i % STAGES) * L::kStageBytes;
#if SAGE_TRAIN_EARLY
    float ksc;  // (read from the stage once it is waited for)
#else
    const float ksc = j < p.nkb ? __ldg(p.ks + static_cast<size_t>(qb.bhk) * p.nkb + j) : 0.f;
#endif
    // the step needs a mask where it leaves the key range (passes Lk, at least) or a key is past the warpgroup's
    // first query's causal reach
    const bool edge = kEdge == 1 || (kEdge == 2 && (n0 < qb.klo || n0 + kBM > qb.khi ||
                                                    (CAUSAL && n0 + kBM - 1 > qb.m0 + ln.wg * 64 + p.coff)));
#if SAGE_TRAIN_DQPIPE
#if SAGE_TRAIN_EARLY
    ksc = stage_k_scale<STAGES>(smem + L::kX, i);  // (waited for by the step before)
#endif
    wg_wait0();  // S and dP
    reg_fence(sacc);
    reg_fence(dp);
#else
    uint32_t sacc[32];
    float dp[32];
#if SAGE_TRAIN_EARLY
    s_fill(sacc);
    d_fill(dp);
    ring.wait_full(i);
    ksc = stage_k_scale<STAGES>(smem + L::kX, i);
#else
    ring.wait_full(i);
    s_fill(sacc);
    d_fill(dp);
#endif
    turn.take();
    wg_fence();
    issue_s_dp(sacc, dp, st);
    turn.pass();
    wg_wait1();  // S
    reg_fence(sacc);
#endif

    float pt[32];
    row_logits<CAUSAL>(pt, sacc, qsc * ksc, {-l2[0], -l2[1]}, edge, n0, t, row0, qb.klo, qb.khi, p.coff);
#pragma unroll
    for (int x = 0; x < 32; ++x) pt[x] = ex2(pt[x]);  // P = exp2(S * qsc * ksc - LSE2)

#if !SAGE_TRAIN_DQPIPE
    wg_wait0();  // dP
    reg_fence(dp);
#endif
#pragma unroll
    for (int x = 0; x < 32; ++x) dp[x] = SAGE_TRAIN_DFILL ? pt[x] * dp[x] : pt[x] * (dp[x] - dl[(x >> 1) & 1]);  // (-)dS
    uint32_t da[2][4];
    float sds[2];
    int isum[2];
    psi_rows<true, max_chains<D>(), true>(dp, da, sds, &isum);
    if (SAGE_TRAIN_DFILL) sds[0] = -sds[0], sds[1] = -sds[1];  // (the scales of -ψ(-dS) = ψ(dS))
#pragma unroll
    for (int rh = 0; rh < 2; ++rh) rs[rh] = fmaf(static_cast<float>(isum[rh]), sds[rh], rs[rh]);
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) reg_fence(da[kk]);  // the fragments complete before the fence
    const float f[2] = {sds[0] * ksc, sds[1] * ksc};
#if SAGE_TRAIN_DQPIPE
    // the product, then S and dP of the next step (this step's stage again on the last: dropped)
    const bool more = i + 1 < qb.n_tiles;
    const int i1 = more ? i + 1 : i;
    if (more) ring.wait_full(i1);
    uint32_t prod[D / 2];
    s_fill(sacc);
    d_fill(dp);
    wg_fence();
    wgmma_s8_rs2<D>(prod, da, smem_desc<64>(st + L::kKT));
    wg_commit();
    issue_s_dp(sacc, dp, smem + L::kStage0 + (i1 % STAGES) * L::kStageBytes);
    wg_wait2();  // the product (S and dP may still run)
    reg_fence(prod);
    fold_int8_product<D, D>(dq, 0, prod, f);
#else
    int8_product<D, D == 128 && SAGE_TRAIN_DQ_PARTS ? 2 : 1>(dq, da, smem_desc<64>(st + L::kKT), f, pturn);
#endif
    ring.release(i);
  };
  const int2 full = full_steps<CAUSAL>(qb, ln.wg, p);
  run_steps(0, qb.n_tiles, full.x, full.y, step);
  turn.finish();
#if SAGE_TRAIN_DQPIPE
  wg_wait0();  // the last step's dropped S and dP
  }
#endif

  // epilogue: (dQ + rowsum(ψ(dS))·μ_K) * softmax scale; rows past Lq are not stored
#pragma unroll
  for (int rh = 0; rh < 2; ++rh) {
    rs[rh] += __shfl_xor_sync(0xffffffffu, rs[rh], 1);
    rs[rh] += __shfl_xor_sync(0xffffffffu, rs[rh], 2);
  }
  const float* mu = p.kmean + static_cast<size_t>(qb.bhk) * D;
#pragma unroll
  for (int i = 0; i < D / 8; ++i) {
    const float mu0 = __ldg(mu + 8 * i + 2 * t), mu1 = __ldg(mu + 8 * i + 2 * t + 1);
#pragma unroll
    for (int rh = 0; rh < 2; ++rh) {
      dq[4 * i + 2 * rh] = fmaf(rs[rh], mu0, dq[4 * i + 2 * rh]);
      dq[4 * i + 2 * rh + 1] = fmaf(rs[rh], mu1, dq[4 * i + 2 * rh + 1]);
    }
  }
  store_rows<D, T>(static_cast<T*>(p.dq) + qb.b * p.sob + qb.h * p.soh, p.son, row0, p.lq, dq, {p.sm, p.sm}, t);
#endif
}

// ------------------------------------------------------------------------------------------ forward
// SAGE_TRAIN_FWDMAX: one forward step's softmax from S's accumulator (S's magic start: each element's bits are those
// of the float 1.5 * 2^23 + S, positive, so their int32 order is the logits' order; a masked element becomes -inf,
// negative as an int32). Each row's max is taken on the bits (three-input integer maxima, tree_imax, and the quad's
// shuffles); the logits' max is then fmaf(max, a, off), the same value as the max over the logits fmaf(S, a, off)
// (fmaf rounds monotonically, a > 0). P~ = exp2(fmaf(S, a, off - m_new)): the offset and the new row max in one
// rounding, one FFMA a logit. ψ's row max is the P~ of the row's largest S, exp2(fmaf(max, a, off - m_new)) (the
// spec's δ_P = exp(rowmax(S) - m) / 127; the same value as the max over the row's P~ where ex2.approx is monotonic,
// and within an ulp of it otherwise, which rounds to 127 at most). Updates the running max m, the rescale factors,
// the row sums of the unrounded P~; writes P~ to z, ψ(P~) to pa and its row scales to sp.
template <bool CAUSAL>
__device__ __forceinline__ void fwd_softmax(float (&z)[32], uint32_t (&sacc)[32], float a, float (&m)[2],
                                            float (&alpha)[2], float (&rs)[2], uint32_t (&pa)[2][4], float (&sp)[2],
                                            bool edge, int n0, int t, int row0, int klo, int khi, int coff) {
  if (edge) {
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
      for (int rh = 0; rh < 2; ++rh)
#pragma unroll
        for (int e = 0; e < 2; ++e)
          if (row_masked<CAUSAL>(i, rh, e, n0, t, row0, klo, khi, coff)) sacc[4 * i + 2 * rh + e] = 0xff800000u;  // -inf
  }
  const float off = s_offset(0.f, a);  // the logits fmaf(S's float, a, off) are S * a
  float off2[2], pm[2];
#pragma unroll
  for (int rh = 0; rh < 2; ++rh) {
    int r[16];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      r[2 * i] = static_cast<int>(sacc[4 * i + 2 * rh]);
      r[2 * i + 1] = static_cast<int>(sacc[4 * i + 2 * rh + 1]);
    }
    int mb = tree_imax<16>(r);
    mb = max(mb, __shfl_xor_sync(0xffffffffu, mb, 1));
    mb = max(mb, __shfl_xor_sync(0xffffffffu, mb, 2));
    const float smax = __int_as_float(mb);  // 1.5 * 2^23 + the row's max S, or -inf
    const float mn = fmaxf(m[rh], fmaf(smax, a, off));
    const float msafe = mn == -INFINITY ? 0.f : mn;
    alpha[rh] = ex2(m[rh] - msafe);
    m[rh] = mn;
    off2[rh] = s_offset(-msafe, a);
    pm[rh] = ex2(fmaf(smax, a, off2[rh]));  // 0 for a row without keys so far
  }
#pragma unroll
  for (int x = 0; x < 32; ++x) {
    z[x] = ex2(fmaf(__uint_as_float(sacc[x]), a, off2[(x >> 1) & 1]));
    rs[(x >> 1) & 1] += z[x];
  }
  psi_pack(z, pm, pa, sp);
}

struct FwdParams {
  const float* qs;  // (B*Hq, nqb): Q scales, 128 queries each
  const float* ks;  // (B*Hkv, nkb): K scales, 64 keys each
  const float* vs;  // (B*Hkv, nkb): V scales, 64 keys each
  void* out;
  float* lse;       // (B*Hq, lq): natural-log units, -inf for rows without keys
  int hq, group, lq, lk, nqb, nkb;
  float c;   // softmax scale * log2(e)
  int coff;  // causal: key n visible from query m iff n <= m + coff
  long long sob, soh, son;  // O strides (elements)
  const int* gate;  // as Params'
  int want;
  const int* krange;  // as Params'
};

template <int D, int STAGES, int NWG = 2>
struct FwdLayout : Frame<NWG * kBM * D, 2 * kBM * D, STAGES, (STAGES * 4 + 15) / 16 * 16> {
  static constexpr int kQBytes = NWG * kBM * D;  // q̂ of the CTA's 64 * NWG queries, one box
  static constexpr int kQ = 0;
  static constexpr int kK = 0, kVT = kBM * D;  // a stage: k̂ (perm_base's row order) + V̂^T (channels x 64 keys)
  // (SAGE_TRAIN_EARLY) each stage's K scale, one fp32, from kX (the barriers stay 8-aligned)
  static constexpr int kX = Frame<NWG * kBM * D, 2 * kBM * D, STAGES, (STAGES * 4 + 15) / 16 * 16>::kExtra;
};

// Where the forward's time goes (offline: `benchmarks/sass_mix.py --csrc`, results/sass_csrc_d821880_cpu.txt): a full
// step of one consumer warp is 489 instructions at hd128 (391 at hd64) for 64 queries x 64 keys, where the int8_fp8
// core takes 454 for 64 x 128 keys: the fold of the step's INT8 PV product into O (an I2FP and an FFMA for each of the
// warp's D / 2 accumulators) and psi(P~) (an FFMA a value, PRMT packs) come once per 64 keys: two consumer warps per
// scheduler issue ~980 instructions a CTA step against ~512 cycles of the tensor cores (s8, 8192 ops a clock and SM).
// Yet it is the latencies that bound it: Nsight Compute at hd128 16K, B=2 x 16 heads (H200 run 173,
// results/ncu_train_fwd_kernel_run173_*): 7.63 ms, issue slots 53 % busy, 0.88 of 2.24 warps per scheduler eligible,
// tensor pipe 31 % active, XU 36 %; stall samples MUFU 21 % (its queue and its results), FFMA 11 %, FADD 9.5 %,
// branches on long-scoreboard results (barrier polls) 6 %, the wgmma waits 5 %, the row max's shuffles 4 %. (The
// int8_fp8 core's 907 TOPS, H100 run 151, would be 4.9 ms at these FLOPs.) 128-key tiles would halve the fold per key,
// but the numerics' per-token P~ scales and V's scales would then cover 128 keys: O's rel-L1 +9 % (gaussian) / +12 %
// (SmolLM2's layers), dQ's +1-11 % (CPU, results/ablation_sagebwd_fwdtile_cpu.*): not taken.
// Forward of 64 * NWG queries (NWG consumer warpgroups of 64: 3 at hd64, SAGE_TRAIN_FWD_WG64, else 2) of one (batch,
// query head), SageBwd's numerics as the Triton `_fwd_kernel`: per 64-key step S = q̂·k̂^T (s8) times the Q scale
// (with the softmax scale and log2 e) and the K scale; online softmax in the exp2 domain; P~ = exp2(z - m) quantized
// per row with the row's max in the step (ψ per token: pmax / 127) straight into the INT8 A fragments of O_step =
// P̂·V̂ (s8, V̂^T as the K-major B operand), folded as O = alpha * O + O_step * (pmax / 127 * V scale); row sums of
// the unrounded P~; O / l and the LSE at the end. The turn at the tensor cores issues PV of this step and S of the
// next one together (on the last step S is recomputed on this step's k̂ and dropped: no wgmma sits in a conditional).
template <int D, int STAGES, bool CAUSAL, typename T, int NWG = fwd_wg<D>()>
__global__ void __launch_bounds__(128 * (NWG + 1), 1)
    fwd_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
               const __grid_constant__ CUtensorMap tm_vt, const FwdParams p) {
#if SAGE_SM90A
  if (gated_off(p.gate, p.want)) return;
  using L = FwdLayout<D, STAGES, NWG>;
  uint8_t* smem = smem_base();
  uint8_t* sq = smem + L::kQ;
  const Ring<STAGES, 4 * NWG> ring(smem + L::kBar);
  const QueryBlock qb = query_block<CAUSAL, NWG * kBM>(p);
  ring.init();

  if (threadIdx.x >= NWG * 128) {  // producer warpgroup
    if (producer_lane<NWG>()) {
      tma_prefetch(&tm_q);
      tma_prefetch(&tm_k);
      tma_prefetch(&tm_vt);
      mbar_expect_tx(ring.first, L::kQBytes);
      tma_load_3d(sq, &tm_q, ring.first, 0, qb.m0, qb.bh);
      produce_steps(ring, smem + L::kStage0, L::kStageBytes, qb.n_tiles, [&](uint8_t* st, uint64_t* bar, int i) {
        tma_perm_rows(st + L::kK, &tm_k, bar, 0, (qb.j0 + i) * kBM, qb.bhk, D);  // keys in perm_base's order
        tma_load_3d(st + L::kVT, &tm_vt, bar, (qb.j0 + i) * kBM, 0, qb.bhk);
      }, [&](int i) { put_k_scale<STAGES, false>(smem + L::kX, p, qb.bhk, i, qb.j0 + i); });
    }
    return;
  }

  // consumers
  const Lane ln = consumer_lane<NWG>();
  const int t = ln.t;
  const int row0 = qb.m0 + ln.wg * 64 + ln.w * 16 + ln.g8;  // this thread's queries: row0, row0 + 8
  const float qsc = wg_q_scale<NWG>(p, qb, ln.wg);
  const uint64_t da_q = smem_desc<D>(sq + ln.wg * 64 * D);

  float o[D / 2], m_i[2] = {-INFINITY, -INFINITY}, l_i[2] = {0.f, 0.f};
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
  const Turns<NWG, (SAGE_TRAIN_PP & (D == 128 ? 1 : 2)) != 0> turn{ln.wg};
  turn.start();

  mbar_wait(ring.first, 0);
  if (qb.n_tiles > 0) {
    uint32_t sacc[32];
    ring.wait_full(0);
    s_fill(sacc);
    turn.take();
    wg_fence();
    issue_s<D>(sacc, da_q, smem_desc<D>(smem + L::kStage0 + L::kK));
    wg_commit();
    turn.pass();
    // (SAGE_TRAIN_EARLY: the coming step's K scale, read from its stage once it is waited for)
    [[maybe_unused]] float ksc_next = stage_k_scale<STAGES>(smem + L::kX, 0);
    wg_wait0();
    reg_fence(sacc);
    auto step = [&](int i, auto edge_c) {  // the CTA's step i: key step j
      constexpr int kEdge = decltype(edge_c)::value;
      const int j = qb.j0 + i;
      const int n0 = j * kBM;
      const uint8_t* st = smem + L::kStage0 + (i % STAGES) * L::kStageBytes;
#if SAGE_TRAIN_EARLY
      const float ksc = ksc_next;
#else
      const float ksc = __ldg(p.ks + static_cast<size_t>(qb.bhk) * p.nkb + j);
#endif
      const float vsc = __ldg(p.vs + static_cast<size_t>(qb.bhk) * p.nkb + j);
      const bool edge = kEdge == 1 || (kEdge == 2 && (n0 < qb.klo || n0 + kBM > qb.khi ||
                                                      (CAUSAL && n0 + kBM - 1 > qb.m0 + ln.wg * 64 + p.coff)));
      float z[32], alpha[2], rs[2] = {0.f, 0.f};
      uint32_t pa[2][4];
      float sp[2];
#if SAGE_TRAIN_FWDMAX
      // the row max on S's bits; P~ = exp2(S * a + (off - m_new)), one FFMA a logit; ψ's row max from the row max
      fwd_softmax<CAUSAL>(z, sacc, qsc * ksc, m_i, alpha, rs, pa, sp, edge, n0, t, row0, qb.klo, qb.khi, p.coff);
#else
      // z = S * qsc * ksc (-inf where masked); the row max; P~ = exp2(z - m_new)
      row_logits<CAUSAL>(z, sacc, qsc * ksc, {0.f, 0.f}, edge, n0, t, row0, qb.klo, qb.khi, p.coff);  // (+0: the product)
      float msafe[2];
#pragma unroll
      for (int rh = 0; rh < 2; ++rh) {
        float mx = -INFINITY;
#pragma unroll
        for (int i = 0; i < 8; ++i) mx = fmaxf(mx, fmaxf(z[4 * i + 2 * rh], z[4 * i + 2 * rh + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float mn = fmaxf(m_i[rh], mx);
        msafe[rh] = mn == -INFINITY ? 0.f : mn;
        alpha[rh] = ex2(m_i[rh] - msafe[rh]);
        m_i[rh] = mn;
      }
#pragma unroll
      for (int x = 0; x < 32; ++x) {
        z[x] = ex2(z[x] - msafe[(x >> 1) & 1]);
        rs[(x >> 1) & 1] += z[x];
      }
      psi_rows<false, max_chains<D>()>(z, pa, sp);
#endif
#pragma unroll
      for (int rh = 0; rh < 2; ++rh) l_i[rh] = fmaf(l_i[rh], alpha[rh], rs[rh]);
#pragma unroll
      for (int kk = 0; kk < 2; ++kk) reg_fence(pa[kk]);
      // the turn: PV of this step, then S of the next one (this step's k̂ again on the last: dropped)
      const bool more = i + 1 < qb.n_tiles;
      const int i1 = more ? i + 1 : i;
      if (more) ring.wait_full(i1);
      if (SAGE_TRAIN_EARLY) ksc_next = stage_k_scale<STAGES>(smem + L::kX, i1);
      uint32_t pv[D / 2];
      s_fill(sacc);
      turn.take();
      wg_fence();
      wgmma_s8_rs2<D>(pv, pa, smem_desc<64>(st + L::kVT));
      issue_s<D>(sacc, da_q, smem_desc<D>(smem + L::kStage0 + (i1 % STAGES) * L::kStageBytes + L::kK));
      wg_commit();
      turn.pass();
      // O * alpha while the tensor cores work (SAGE_TRAIN_LAZY: only where a row of the warp raised its max)
      if (!SAGE_TRAIN_LAZY || !__all_sync(0xffffffffu, alpha[0] == 1.f && alpha[1] == 1.f)) {
#pragma unroll
        for (int x = 0; x < D / 2; ++x) o[x] *= alpha[(x >> 1) & 1];
      }
      wg_wait0();
      reg_fence(pv);
      reg_fence(sacc);
      ring.release(i);
      const float f[2] = {sp[0] * vsc, sp[1] * vsc};
#pragma unroll
      for (int i = 0; i < D / 8; ++i)
#pragma unroll
        for (int rh = 0; rh < 2; ++rh)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float& acc = o[4 * i + 2 * rh + e];
            acc = fmaf(__int2float_rn(static_cast<int>(pv[4 * i + 2 * rh + e])), f[rh], acc);
          }
    };
    const int2 full = full_steps<CAUSAL>(qb, ln.wg, p);
    run_steps(0, qb.n_tiles, full.x, full.y, step);
  }
  turn.finish();

  // epilogue: full row sums over the quad, O / l (0 for rows that see no key), the LSE
  float inv[2];
#pragma unroll
  for (int rh = 0; rh < 2; ++rh) {
    float l = l_i[rh];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    inv[rh] = l == 0.f ? 0.f : __fdividef(1.f, l);  // l in [1, Lk] (the row max's own exp is 1)
    const int row = row0 + 8 * rh;
    if (row < p.lq && t == 0)
      p.lse[static_cast<size_t>(qb.bh) * p.lq + row] = l == 0.f ? -INFINITY : (m_i[rh] + __log2f(l)) * 0.6931471805599453f;
  }
  store_rows<D, T>(static_cast<T*>(p.out) + qb.b * p.sob + qb.h * p.soh, p.son, row0, p.lq, o, inv, t);
#endif
}

// Launch `kernel` on a (gx, gy) grid of `threads`-thread CTAs with `bytes` of dynamic shared memory
template <typename K, typename... A>
int launch_kernel(K kernel, int bytes, int gx, int gy, int threads, cudaStream_t stream, const A&... args) {
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes) != cudaSuccess) return 12;
  kernel<<<dim3(gx, gy), threads, bytes, stream>>>(args...);
  return cudaGetLastError() == cudaSuccess ? 0 : 13;
}

template <typename T>
struct Type {
  using type = T;
};
// f(head dim, causal, output type) as compile-time tags for the runtime d (64 or 128), causal and fp16
template <typename F>
int dispatch(int d, bool causal, bool fp16, F&& f) {
  auto by_type = [&](auto dc, auto cc) {
    return fp16 ? f(dc, cc, Type<__half>{}) : f(dc, cc, Type<__nv_bfloat16>{});
  };
  auto by_causal = [&](auto dc) {
    return causal ? by_type(dc, std::true_type{}) : by_type(dc, std::false_type{});
  };
  return d == 128 ? by_causal(std::integral_constant<int, 128>{}) : by_causal(std::integral_constant<int, 64>{});
}

}  // namespace train
}  // namespace sage_sm90

// Returns 0 on success; 1 unsupported arguments; 10-13 tensor-map / launch failures. Tensors as described at the
// top (contiguous HND); lengths in elements; dK / dV strides (sob, soh, son) in elements, channel stride 1; c =
// softmax scale * log2(e), sm = softmax scale; causal: key n visible from query m iff n <= m + coff. gate, want
// (every launcher's): want >= 0, the CTAs leave at once unless gate[0] (device memory) == want (gated_off); krange
// (every launcher's): null, or (B, 2) int32 in device memory, batch b's visible keys [krange[2b], krange[2b + 1])
// (key_range; with causal, keys visible under both rules).
extern "C" int sage_int8_train_sm90_dkdv(const void* q8, const void* q8t, const float* qs, const void* k8,
                                         const float* ks, const void* v16, const float* lse2, const float* delta,
                                         const void* do16, const void* do8t, const float* sdo, void* dk, void* dv,
                                         int fp16, int b, int hq, int hkv, int lq, int lk, int d, long long sob,
                                         long long soh, long long son, float c, float sm, int causal, int coff,
                                         const int* gate, int want, const int* krange, void* stream) {
  using namespace sage_sm90;
  using namespace sage_sm90::train;
  if ((d != 64 && d != 128) || hkv <= 0 || hq % hkv != 0 || lq <= 0 || lk <= 0 || lq % 16 != 0 ||
      static_cast<long long>(b) * hkv > 65535)
    return 1;
  const uint64_t ud = d, ulq = lq, ulk = lk, bhq = static_cast<uint64_t>(b) * hq, bhk = static_cast<uint64_t>(b) * hkv;
  const CUtensorMapSwizzle swz8 = d == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B;
  CUtensorMap maps[8];
  // k̂ (d, lk, b*hkv), one (d, 128) box
  const uint64_t k_dims[3] = {ud, ulk, bhk}, k_str[2] = {ud, ulk * ud};
  const uint32_t k_box[3] = {static_cast<uint32_t>(d), kBN, 1};
  // V̂ 16-bit (d, lk, b*hkv), (64 channels, 128 keys) boxes
  const uint64_t v_dims[3] = {ud, ulk, bhk}, v_str[2] = {2 * ud, 2 * ulk * ud};
  const uint32_t v_box[3] = {64, kBN, 1};
  // q̂ as (d, query % 4, query / 4, b*hq): a (d, 2, 4, 1) box is 8 rows of perm_base's order
  const uint64_t q_dims[4] = {ud, 4, ulq / 4, bhq}, q_str[3] = {ud, 4 * ud, ulq * ud};
  const uint32_t q_box[4] = {static_cast<uint32_t>(d), 2, 4, 1};
  // dO 16-bit the same way, (64 channels, 2, 4) boxes
  const uint64_t o_dims[4] = {ud, 4, ulq / 4, bhq}, o_str[3] = {2 * ud, 8 * ud, 2 * ulq * ud};
  const uint32_t o_box[4] = {64, 2, 4, 1};
  // dO8^T and q̂^T (lq, d, b*hq), (64 queries, d) boxes
  const uint64_t t_dims[3] = {ulq, ud, bhq}, t_str[2] = {ulq, ulq * ud};
  const uint32_t t_box[3] = {kBM, static_cast<uint32_t>(d), 1};
  // LSE2 and delta (lq, b*hq) fp32, 64-query boxes
  const uint64_t l_dims[3] = {ulq, bhq, 1}, l_str[2] = {4 * ulq, 4 * ulq * bhq};
  const uint32_t l_box[3] = {kBM, 1, 1};
  int rc = make_map(&maps[0], k8, 3, k_dims, k_str, k_box, swz8);
  if (!rc) rc = make_map(&maps[1], v16, 3, v_dims, v_str, v_box, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_DATA_TYPE_UINT16);
  if (!rc) rc = make_map(&maps[2], q8, 4, q_dims, q_str, q_box, swz8);
  if (!rc) rc = make_map(&maps[3], do16, 4, o_dims, o_str, o_box, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_DATA_TYPE_UINT16);
  if (!rc) rc = make_map(&maps[4], do8t, 3, t_dims, t_str, t_box, CU_TENSOR_MAP_SWIZZLE_64B);
  if (!rc) rc = make_map(&maps[5], q8t, 3, t_dims, t_str, t_box, CU_TENSOR_MAP_SWIZZLE_64B);
  if (!rc) rc = make_map(&maps[6], lse2, 3, l_dims, l_str, l_box, CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_DATA_TYPE_FLOAT32);
  if (!rc) rc = make_map(&maps[7], delta, 3, l_dims, l_str, l_box, CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_DATA_TYPE_FLOAT32);
  if (rc) return rc;
  const int nqb = (lq + 127) / 128, nkb = (lk + 63) / 64;
  Params p{qs, sdo, ks, dk, dv, hq, hq / hkv, lq, lk, nqb, nkb, c, sm, coff, sob, soh, son, gate, want, krange};
  const int gx = (lk + kBN - 1) / kBN, gy = b * hkv;
  return dispatch(d, causal, fp16, [&](auto dc, auto cc, auto tc) {
    constexpr int kD = decltype(dc)::value;
    using L = Layout<kD, SAGE_TRAIN_STAGES>;
    return launch_kernel(dkdv_kernel<kD, SAGE_TRAIN_STAGES, decltype(cc)::value, typename decltype(tc)::type>,
                         L::kBytes, gx, gy, kThreads, static_cast<cudaStream_t>(stream), maps[0], maps[1], maps[2],
                         maps[3], maps[4], maps[5], maps[6], maps[7], p);
  });
}

// dQ (B, Hq, Lq, D) at strides (sob, soh, son) (channel stride 1) in the 16-bit type of v16 / do16; returns as
// sage_int8_train_sm90_dkdv. q8, qs, k8, ks, v16, lse2, delta, do16 as there; k8t (B, Hkv, D, Lk) int8 (k̂
// transposed); kmean (B, Hkv, D) fp32. Lk a multiple of 16 (k̂^T's row stride for TMA).
extern "C" int sage_int8_train_sm90_dq(const void* q8, const float* qs, const void* k8, const void* k8t,
                                       const float* ks, const void* v16, const float* kmean, const float* lse2,
                                       const float* delta, const void* do16, void* dq, int fp16, int b, int hq,
                                       int hkv, int lq, int lk, int d, long long sob, long long soh, long long son,
                                       float c, float sm, int causal, int coff, const int* gate, int want,
                                       const int* krange, void* stream) {
  using namespace sage_sm90;
  using namespace sage_sm90::train;
  if ((d != 64 && d != 128) || hkv <= 0 || hq % hkv != 0 || lq <= 0 || lk <= 0 || lk % 16 != 0 ||
      static_cast<long long>(b) * hq > 65535)
    return 1;
  const uint64_t ud = d, ulq = lq, ulk = lk, bhq = static_cast<uint64_t>(b) * hq, bhk = static_cast<uint64_t>(b) * hkv;
  const CUtensorMapSwizzle swz8 = d == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B;
  CUtensorMap maps[5];
  // q̂ (d, lq, b*hq), (d, rows) boxes; dO 16-bit the same, (64 channels, rows) boxes: the CTA's queries
  constexpr uint32_t rows = SAGE_TRAIN_DQ_WG * kBM;
  const uint64_t q_dims[3] = {ud, ulq, bhq}, q_str[2] = {ud, ulq * ud};
  const uint32_t q_box[3] = {static_cast<uint32_t>(d), rows, 1};
  const uint64_t o_str[2] = {2 * ud, 2 * ulq * ud};
  const uint32_t o_box[3] = {64, rows, 1};
  // k̂ as (d, key % 4, key / 4, b*hkv) and V̂ 16-bit the same: (d | 64, 2, 4, 1) boxes, 8 rows of perm_base's order
  const uint64_t k_dims[4] = {ud, 4, ulk / 4, bhk}, k_str[3] = {ud, 4 * ud, ulk * ud};
  const uint32_t k_box[4] = {static_cast<uint32_t>(d), 2, 4, 1};
  const uint64_t v_str[3] = {2 * ud, 8 * ud, 2 * ulk * ud};
  const uint32_t v_box[4] = {64, 2, 4, 1};
  // k̂^T (lk, d, b*hkv), (64 keys, d) boxes
  const uint64_t t_dims[3] = {ulk, ud, bhk}, t_str[2] = {ulk, ulk * ud};
  const uint32_t t_box[3] = {kBM, static_cast<uint32_t>(d), 1};
  int rc = make_map(&maps[0], q8, 3, q_dims, q_str, q_box, swz8);
  if (!rc) rc = make_map(&maps[1], do16, 3, q_dims, o_str, o_box, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_DATA_TYPE_UINT16);
  if (!rc) rc = make_map(&maps[2], k8, 4, k_dims, k_str, k_box, swz8);
  if (!rc) rc = make_map(&maps[3], v16, 4, k_dims, v_str, v_box, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_DATA_TYPE_UINT16);
  if (!rc) rc = make_map(&maps[4], k8t, 3, t_dims, t_str, t_box, CU_TENSOR_MAP_SWIZZLE_64B);
  if (rc) return rc;
  const int nqb = (lq + 127) / 128, nkb = (lk + 63) / 64;
  DqParams p{qs, ks, lse2, delta, kmean, dq, hq, hq / hkv, lq, lk, nqb, nkb, c, sm, coff, sob, soh, son, gate, want,
             krange};
  const int gx = (lq + static_cast<int>(rows) - 1) / static_cast<int>(rows), gy = b * hq;
  return dispatch(d, causal, fp16, [&](auto dc, auto cc, auto tc) {
    constexpr int kD = decltype(dc)::value;
    using L = DqLayout<kD, SAGE_TRAIN_DQ_STAGES, SAGE_TRAIN_DQ_WG>;
    return launch_kernel(dq_kernel<kD, SAGE_TRAIN_DQ_STAGES, decltype(cc)::value, typename decltype(tc)::type>,
                         L::kBytes, gx, gy, 128 * (SAGE_TRAIN_DQ_WG + 1), static_cast<cudaStream_t>(stream), maps[0],
                         maps[1], maps[2], maps[3], maps[4], p);
  });
}

// Forward: O (B, Hq, Lq, D) at strides (sob, soh, son) (channel stride 1), bf16 (out_fp16 0) or fp16, and the LSE
// (B, Hq, Lq) fp32 (natural log, -inf for rows without keys); returns as sage_int8_train_sm90_dkdv. q8 (B, Hq, Lq,
// D) int8, qs (B, Hq, ceil(Lq/128)), k8 (B, Hkv, Lk, D) int8, ks and vs (B, Hkv, ceil(Lk/64)), v8t (B, Hkv, D, Lk)
// int8 (V̂ transposed). Lk a multiple of 16 (V̂^T's row stride for TMA).
extern "C" int sage_int8_train_sm90_fwd(const void* q8, const float* qs, const void* k8, const float* ks,
                                        const void* v8t, const float* vs, void* out, float* lse, int out_fp16, int b,
                                        int hq, int hkv, int lq, int lk, int d, long long sob, long long soh,
                                        long long son, float c, int causal, int coff, const int* gate, int want,
                                        const int* krange, void* stream) {
  using namespace sage_sm90;
  using namespace sage_sm90::train;
  if ((d != 64 && d != 128) || hkv <= 0 || hq % hkv != 0 || lq <= 0 || lk <= 0 || lk % 16 != 0 ||
      static_cast<long long>(b) * hq > 65535)
    return 1;
  const uint64_t ud = d, ulq = lq, ulk = lk, bhq = static_cast<uint64_t>(b) * hq, bhk = static_cast<uint64_t>(b) * hkv;
  const CUtensorMapSwizzle swz8 = d == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B;
  CUtensorMap maps[3];
  // q̂ (d, lq, b*hq), (d, rows) boxes: the CTA's queries
  const int rows = (d == 64 ? fwd_wg<64>() : fwd_wg<128>()) * kBM;
  const uint64_t q_dims[3] = {ud, ulq, bhq}, q_str[2] = {ud, ulq * ud};
  const uint32_t q_box[3] = {static_cast<uint32_t>(d), static_cast<uint32_t>(rows), 1};
  const uint64_t k_dims[4] = {ud, 4, ulk / 4, bhk}, k_str[3] = {ud, 4 * ud, ulk * ud};
  const uint32_t k_box[4] = {static_cast<uint32_t>(d), 2, 4, 1};
  const uint64_t t_dims[3] = {ulk, ud, bhk}, t_str[2] = {ulk, ulk * ud};
  const uint32_t t_box[3] = {kBM, static_cast<uint32_t>(d), 1};
  int rc = make_map(&maps[0], q8, 3, q_dims, q_str, q_box, swz8);
  if (!rc) rc = make_map(&maps[1], k8, 4, k_dims, k_str, k_box, swz8);
  if (!rc) rc = make_map(&maps[2], v8t, 3, t_dims, t_str, t_box, CU_TENSOR_MAP_SWIZZLE_64B);
  if (rc) return rc;
  const int nqb = (lq + 127) / 128, nkb = (lk + 63) / 64;
  FwdParams p{qs, ks, vs, out, lse, hq, hq / hkv, lq, lk, nqb, nkb, c, coff, sob, soh, son, gate, want, krange};
  const int gx = (lq + rows - 1) / rows, gy = b * hq;
  return dispatch(d, causal, out_fp16, [&](auto dc, auto cc, auto tc) {
    constexpr int kD = decltype(dc)::value;
    using L = FwdLayout<kD, SAGE_TRAIN_FWD_STAGES, fwd_wg<kD>()>;
    return launch_kernel(fwd_kernel<kD, SAGE_TRAIN_FWD_STAGES, decltype(cc)::value, typename decltype(tc)::type>,
                         L::kBytes, gx, gy, 128 * (fwd_wg<kD>() + 1), static_cast<cudaStream_t>(stream), maps[0],
                         maps[1], maps[2], p);
  });
}
