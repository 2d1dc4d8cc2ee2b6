// SageAttention2 core for Hopper (sm_90a): INT8 QK^T, FP8 E4M3 PV with two-level accumulation.
//
// Same numerics as the Triton kernel (sage_compile/kernels/int8_fp8/attention.py) and the reference
// (sage_compile/reference/int8_fp8.py, shared/docs/numerics.md §2): per-token INT8 Q scales with softmax
// scale * log2(e) folded in, INT8 K scales tied in SageAttention2's per-thread groups (SAGE_KGROUP), online
// softmax in the exp2 domain over 128-key tiles with the running row max mapped to 448, P~ rounded to E4M3,
// PV product of each tile accumulated in a fresh tensor-core accumulator and added to the fp32 output once
// per tile, row sums from unrounded fp32 P~, O * delta_V / l at the end.
//
// Inputs are the prologue's tensors (HND): q8 (B, Hq, Lq, D) int8, qs (B, Hq, Lq) fp32, k8 (B, Hkv, ldk, D)
// int8 (ldk >= Lk a multiple of 4), ks (B, Hkv, Lk) fp32 (tied in groups: SAGE_KGROUP), v8 (B, Hkv, D, ldv)
// e4m3 (V transposed, ldv >= Lk a multiple of 16), vs (B, Hkv, D) fp32. Output: any (b, h, token) strides,
// channel stride 1, bf16 or fp16.
//
// CTA at hd128: 128 query rows, 12 warps: warps 0-7 are two consumer warpgroups (64 rows each, 240 registers
// per thread through setmaxnreg), warps 8-11 the producer warpgroup (24 registers); at hd64 three consumer
// warpgroups (192 rows, 160 registers) and the producer, 16 warps. One producer lane issues
// the TMA loads (Q once, then K (+ its scales) and V^T tiles into a STAGES-deep ring on mbarriers; K in
// the key order of key_base, 16 boxes of 8 rows). Each consumer warpgroup per 128-key tile: S = wgmma s8
// (Q, K from shared memory, 128B or 64B swizzle), dequantize + mask + online softmax in registers, P~ ->
// E4M3 straight into the wgmma A-operand fragment (the key order makes the lane's own accumulator
// columns the fragment's keys), O_tile = wgmma e4m3 (P~ from registers, V^T from shared memory),
// O = alpha * O + O_tile. At hd128 the two warpgroups take turns at the tensor cores (ping-pong); at hd64,
// where the softmax bounds the loop, the three run freely.
//
// Plain C launcher (no torch headers) so the CPU CI can compile it with nvcc -c; the torch binding is
// int8_fp8_sm90_bind.cpp.

#include "sm90_common.cuh"

// Build knobs (benchmarks/cuda_variants.py times them; SAGE_COMPILE_CUDA_FLAGS="-DSAGE_KPERM=0 ..." builds one;
// the defaults are the fastest measured, benchmarks/results/cuda_variants_run1[234]_*.json):
// SAGE_KPERM 1 loads each K tile in the accumulator's key order (see key_base), 0 in natural order with the
// P fragment assembled by quad shuffles; SAGE_STAGES128 / SAGE_STAGES64 / SAGE_STAGES64C the depth of the K/V
// ring (hd128; hd64 non-causal; hd64 causal, by default SAGE_STAGES64). Run 80 (cuda_variants_run80_*, identical
// outputs): hd64 with 5 stages 573 vs 561-562 TOPS at 17,776 tokens, 524 vs 512-516 at 4K, but causal 16K 502 vs
// 537-540 (then one knob for both hd64 kinds; not yet timed split, nor GPU-tested with 5 stages; ptxas then
// spills 4 / 20 bytes in the non-causal hd64 key-range kernels, which spill nothing with 4).
#ifndef SAGE_KPERM
#define SAGE_KPERM 1
#endif
#ifndef SAGE_STAGES128
#define SAGE_STAGES128 4
#endif
#ifndef SAGE_STAGES64
#define SAGE_STAGES64 4
#endif
#ifndef SAGE_STAGES64C
#define SAGE_STAGES64C SAGE_STAGES64
#endif
// SAGE_PINGPONG64 / SAGE_PINGPONG128 0: no turn order between the consumer warpgroups.
// SAGE_WG64 / SAGE_WG128: consumer warpgroups per CTA (2, or 3 without ping-pong: 192 query rows, 160
// registers per consumer thread). SAGE_WG128=3 (SAGE_PINGPONG128=0) is not worth timing: the hd128 kernels then spill
// 944-1276 bytes (nvcc 13.0 offline; 128 registers reported for the 512-thread kernel, 160 a consumer thread).
#ifndef SAGE_WG64
#define SAGE_WG64 3
#endif
#ifndef SAGE_WG128
#define SAGE_WG128 2
#endif
// SAGE_RING64 / SAGE_RING64C 1 (hd64 non-causal / causal; three consumer warpgroups, no ping-pong): the warpgroups
// take turns at the tensor cores in a ring (named barriers 6-8: 0, 1, 2, 0, ...), each turn issuing the warpgroup's
// wgmmas as the ping-pong's does; warpgroup 0 takes the last warpgroup's final pass after its loop. 0: they run
// freely. Run 150 (H100, cuda_variants_run150_*, TOPS, same outputs): causal 16K 609 vs 590, causal
// 4K 457 vs 450; non-causal 16K 642 vs 646, 8K 629 vs 632, 4K 559 vs 560 (within the spread), so on for causal only
// (run 149 with the ids in registers, which spilled 8-24 bytes: causal 16K 605 vs 582, non-causal the same).
#ifndef SAGE_RING64
#define SAGE_RING64 0
#endif
#ifndef SAGE_RING64C
#define SAGE_RING64C 1
#endif
#ifndef SAGE_PINGPONG64
#define SAGE_PINGPONG64 0
#endif
// Removed after timing (code at 295bc0b): SAGE_SPLIT64, hd64 waiting for PV before issuing the next S (no hd64
// kernel spilled; run 15, H200: 463 vs 459 TOPS at 16K, but 432 vs 463 causal and 390 vs 421 at 4K).
#ifndef SAGE_PINGPONG128
#define SAGE_PINGPONG128 1
#endif
// SAGE_PINGPONG128C: the same for the causal hd128 kernels (run 84, kernel only, hd128 causal 16K: 843 TOPS without
// ping-pong and with SAGE_PVLAG vs 815-826 with it; the non-causal ones lost, 804 vs 869). With the causal edge
// loops (SAGE_EDGELOOP 3) no difference: runs 97-98 (H100) 885-899 without ping-pong vs 889-892 with it at 16K,
// 774-802 vs 796-807 at 8K; so it stays on
#ifndef SAGE_PINGPONG128C
#define SAGE_PINGPONG128C SAGE_PINGPONG128
#endif
// Some of P~'s exponentials on the FMA pipe by a polynomial (SAGE_EXP2POLY k of every 16, degree SAGE_EXP2DEG; code at
// 6e84345) was timed twice and dropped: run 36 (2-5 of every 8, 11-24 % slower at hd64 16K, when the loop issued 593
// instructions a tile) and run 100 (H100, 214ad10, results/cuda_variants_run100_*; the loop then issued 411 / 454 at
// hd64 / hd128): hd64 16K 629-635 TOPS -> 592 (1 of 16) / 558 (2 of 16), causal 578-582 -> 545 / 532; hd128 16K
// 893-901 -> 907 / 883, within the spread. hd64's loop is not bound by MUFU's throughput.
// Two exps per MUFU instruction through half precision does not exist on sm_90a: ex2.approx.f16x2 (and .bf16x2)
// compile to two MUFU.EX2.F16 (.BF16), one per half (nvcc 13.0 offline), beside the packing and unpacking.
// Removed after timing (code at 295bc0b): SAGE_EXPTURN64 / SAGE_EXPTURN64C, hd64's three warpgroups taking turns
// at the exps of their softmax (named barriers 3-5 in a ring, tied to the exps through shared memory). H200:
// non-causal 0.90-0.96x (run 74), causal 1.05-1.08x (runs 72, 74) before S's magic start; with it the
// free-running causal kernels were faster and the ring slowed them (run 77: 16K 540 vs 458 TOPS, 4K 400 vs 348).
// Two warpgroups at a time is not sound with named barriers, which count arrivals (run 70: such a kernel hung).
// SAGE_KGROUP 1: the K scales are tied in groups of 32 keys of each 128-key tile, the keys k with equal
// (k >> 2) & 3 (SageAttention2's per-thread grouping, in this kernel's key order: a lane's own columns), as
// the int8_fp8 prologue writes them (reference.quant.quant_int8_k_groups): one K scale per thread and tile,
// the row max on S itself and one FFMA per logit. 0: any per-token K scales (an FFMA more per logit and the
// scale loads: run 44 measured 1.11-1.13x at hd128, 1.22-1.24x at hd64 for the grouped kernel).
#ifndef SAGE_KGROUP
#define SAGE_KGROUP SAGE_KPERM  // (its groups are SAGE_KPERM's lanes)
#endif
// SAGE_SMAGIC (bits: 1 the non-causal hd64 kernels, 2 the causal hd64 ones, 4 the hd128 ones; with SAGE_KGROUP):
// S accumulates onto 0x4B400000, the bits of the float 1.5 * 2^23, instead of zero, so that each S accumulator
// read as a float is 1.5 * 2^23 + S exactly (|S| <= 128^2 * 128 < 2^22): no int32 -> fp32 conversion (I2FP, 64
// a tile). The constant comes off the row max (one FADD a row, exact) and goes into the exp offset (one FFMA a
// row, off - 1.5 * 2^23 * factor rounded once: a per-row shift of the tile's logits by at most half an ulp of
// that offset). The accumulator is filled by 16 four-word shared-memory loads a tile (LDS.128) in place of the
// wgmma's zero start.
// H200, kernel only, 2 x 30 heads (cuda_variants_run7[67]_*): hd64 non-causal 544-546 -> 561-563 TOPS at 17,776
// tokens, 527 -> 549 at 8K, 476-478 -> 516-517 at 4K; hd128 16K 830-837 -> 874, causal 777-784 -> 830, 8K 794 ->
// 828-841, 4K 724 -> 785-788; hd64 causal 492-496 (with the exp ring, then the default) -> 540 at 16K and 370-372
// -> 400 at 4K without the ring (457-458 / 348 with it: the ring was removed since).
#ifndef SAGE_SMAGIC
#define SAGE_SMAGIC 7
#endif

// SAGE_PVLAG (bits: 1 the non-causal hd64 kernels, 2 the causal hd64 ones, 4 the hd128 ones): PV of tile j
// completes while the softmax of tile j + 1 takes its row maxima. The turn at the tensor cores issues S of the next
// tile first and PV of this one after it, in two commit groups; the warpgroup waits for S alone (wait_group 1) and
// starts the next softmax; once that softmax has its row maxima it waits for PV (wait_group 0) and folds it into O
// with the previous factors, which alpha still holds. The same arithmetic in the same order for every element:
// outputs identical to the default build's. The PV accumulator and P~'s fragments (PV's operand) stay live through
// the row max: at hd64 with three warpgroups (160 registers) ptxas then spills 64-216 bytes, so hd64 pairs it with
// SAGE_WG64=2 (240 registers: no spill); hd128 spills 0-4 bytes (with the warpgroup index warp-uniform, as
// SAGE_WGSHFL; 12-36 without). Placed later (after the exps), the wait made every hd128 kernel spill ~100 bytes.
// Off by default: within the spread of identical builds on the H100 (runs 102 and 177, hd128 16K / causal / 8K);
// not yet timed on the H200.
#ifndef SAGE_PVLAG
#define SAGE_PVLAG 0
#endif
// SAGE_WGSHFL 1 (default): the consumer's warpgroup index comes through a shuffle from lane 0, so that ptxas knows
// it is warp-uniform (as SAGE_PVLAG always does): Q's descriptor and the named-barrier ids move to
// uniform registers. Offline SASS: the tile loops 7-11 instructions shorter (hd64 448 -> 441, causal 656 -> 645,
// hd128 495 -> 484, causal 692 -> 681) and no kernel spills (the causal hd64 ones spill 16 bytes without it); with
// SAGE_PVLAG it takes hd128's spills from 12-36 bytes to 0-4. H200 run 84 (2 x 30 heads, kernel only,
// benchmarks/results/cuda_variants_run84_*): hd64 561-562 -> 624 TOPS at 17,776 tokens, 515-516 -> 557 at 4K,
// causal 16K 537-540 -> 570; hd128 within its spread (16K 853-860 -> 853).
#ifndef SAGE_WGSHFL
#define SAGE_WGSHFL 1
#endif
// SAGE_IMAX 1 (default; with S's magic start): the row max over the logits' bits as int32 (1.5 * 2^23 + S is a
// positive float, a masked logit -inf, negative as int32, so the int order is the float order), where sm90 has a
// three-input max (VIMNMX3) and the float max has two inputs (FMNMX): the same maxima in about half the
// instructions. Run 84, with SAGE_WGSHFL: hd64 631 TOPS at 17,776 tokens, 564 at 4K, causal 567; hd128 16K 869,
// 8K 845 (819-835), 4K 805 (783-790), causal 820 (815-826); the CUDA core's GPU tests 36/36 (run 85).
#ifndef SAGE_IMAX
#define SAGE_IMAX 1
#endif

// SAGE_EDGELOOP (bits: 1 the non-causal kernels, 2 the causal ones): the tiles that need no key mask run in a
// loop of their own, the masked ones after them; otherwise one loop with the mask under a runtime test, which
// ptxas if-converts into ~70-100 predicated instructions on every tile. H200 (cuda_variants_run4[45]_*): the
// own loop pays non-causal (hd128 / hd64 1.00-1.03x / 1.02-1.05x), but causal kernels ran 0.93-0.95x with
// it (per-token K) and 0.94x (hd128 16K, grouped K: 722 vs 772 TOPS), so causal kept the one loop. With
// grouped K, run 67 (cuda_variants_run67_*, identical outputs): one loop for the non-causal kernels too ran
// 0.90-0.92x at hd64 (4K-17,776 tokens) and 0.98x at hd128 16K. Since S's magic start, the integer row max
// and the uniform warpgroup index, the causal full-tile loop is 412 / 454 instructions (hd64 / hd128) against
// the one loop's 614 / 651, and the own loop pays causal too: runs 97-98 (an H100, no H200 could be started;
// cuda_variants_run9[78]_*, 2 x 30 heads, identical outputs) hd128 causal 16K 832-878 -> 885-899 TOPS, 8K
// 747-795 -> 774-807, 4K 667-674 -> 681-687; hd64 causal 16K 567-585 -> 581-588, 4K 419-424 -> 423-431. So 3.
#ifndef SAGE_EDGELOOP
#define SAGE_EDGELOOP 3
#endif

// SAGE_KRLOOP64 / SAGE_KRLOOP128 (the key-range kernels' tile loops, non-causal): 0 a masked first tile where
// the range starts inside one, then the full tiles' loop and the masked tiles' loop (three tile bodies); 2 one
// loop with the mask under a runtime test (as the causal kernels). H200, run 62 (results/masks_krloop_run62_*,
// core alone, key mask): hd64 16K 7.54 / 5.82 ms (0 / 2; without the mask 6.09), hd128 HunyuanVideo 15.57 /
// 16.49 ms (without the mask 15.78-16.49 across identical builds). A third form, the same order as 0 with two
// tile bodies in an outer loop over masked / full segments (1 then), took 6.20 / 15.93 ms: removed, code at 34f15af.
#ifndef SAGE_KRLOOP64
#define SAGE_KRLOOP64 2
#endif
#ifndef SAGE_KRLOOP128
#define SAGE_KRLOOP128 0
#endif

namespace sage_sm90 {

constexpr int kBN = 128;            // keys per tile (the numerics' tile: P's scale follows the max per tile)
constexpr int kConsumerWarps = 8;   // two warpgroups take turns (ping-pong barriers count their threads)
template <int D>
__host__ __device__ constexpr int consumer_wgs() { return D == 64 ? SAGE_WG64 : SAGE_WG128; }
template <int D>
__host__ __device__ constexpr int block_m() { return 64 * consumer_wgs<D>(); }  // query rows per CTA
// registers per consumer thread (setmaxnreg; the producer warpgroup keeps 24): all of the register file
template <int D>
__host__ __device__ constexpr int consumer_regs() {
  return consumer_wgs<D>() == 2 ? 240 : 160;
}
template <int D>
__host__ __device__ constexpr int threads() { return 128 * consumer_wgs<D>() + 128; }  // + the producer warpgroup (one lane issues TMA)
constexpr float kPOff = 8.807354922057604f;  // log2(448)

// S (64 x 128, s32) (+)= A (64 x 32 s8, smem) * B (128 x 32 s8, smem)^T
__device__ __forceinline__ void wgmma_s8_n128(uint32_t (&d)[64], uint64_t da, uint64_t db, int accumulate) {
#if SAGE_SM90A
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8 "
      SAGE_D64 ", "
      "%64, %65, p;\n"
      "}\n"
      : SAGE_R8(d, 0), SAGE_R8(d, 8), SAGE_R8(d, 16), SAGE_R8(d, 24), SAGE_R8(d, 32), SAGE_R8(d, 40),
        SAGE_R8(d, 48), SAGE_R8(d, 56)
      : "l"(da), "l"(db), "r"(accumulate));
#endif
}

// O (64 x 128, f32) (+)= P (64 x 32 e4m3, registers) * V^T (128 x 32 e4m3, smem)^T
__device__ __forceinline__ void wgmma_e4m3_n128(float (&d)[64], const uint32_t (&a)[4], uint64_t db,
                                                int accumulate) {
#if SAGE_SM90A
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
      SAGE_D64 ", "
      "{%64, %65, %66, %67}, %68, p, 1, 1;\n"
      "}\n"
      : SAGE_F8(d, 0), SAGE_F8(d, 8), SAGE_F8(d, 16), SAGE_F8(d, 24), SAGE_F8(d, 32), SAGE_F8(d, 40),
        SAGE_F8(d, 48), SAGE_F8(d, 56)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate));
#endif
}

// O (64 x 64, f32) (+)= P (64 x 32 e4m3, registers) * V^T (64 x 32 e4m3, smem)^T
__device__ __forceinline__ void wgmma_e4m3_n64(float (&d)[32], const uint32_t (&a)[4], uint64_t db,
                                               int accumulate) {
#if SAGE_SM90A
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, "
      "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1;\n"
      "}\n"
      : SAGE_F8(d, 0), SAGE_F8(d, 8), SAGE_F8(d, 16), SAGE_F8(d, 24)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate));
#endif
}

template <int D>
__device__ __forceinline__ void wgmma_pv(float (&d)[D / 2], const uint32_t (&a)[4], uint64_t db, int acc) {
  if constexpr (D == 128) {
    wgmma_e4m3_n128(d, a, db, acc);
  } else {
    wgmma_e4m3_n64(d, a, db, acc);
  }
}

// two fp32 (already in [0, 448]) -> E4M3 RNE (satfinite), lo in byte 0
__device__ __forceinline__ uint32_t e4m3x2(float lo, float hi) {
  uint16_t r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
}


struct Params {
  const float* qs;  // (the K scales come through their tensor map)
  const float* vs;
  const int* krange;  // KR: (B, 2) int32, each batch's visible keys [first, end) (clamped to [0, lk))
  const int* flag;    // KR: int32[1]; the kernel runs only where *flag == want, else every CTA leaves at once
  int want;
  void* out;
  int hq, group, lq, lk;
  float c;     // softmax scale * log2(e)
  int coff;    // causal: key n visible from query m iff n <= m + coff
  long long sob, soh, son;
};

template <int D, int STAGES>
struct Layout {
  static constexpr int kQBytes = block_m<D>() * D;
  static constexpr int kKBytes = kBN * D;
  static constexpr int kVBytes = D * kBN;
  static constexpr int kSBytes = kBN * 4;  // the tile's K scales (fp32)
  static constexpr int kQ = 0;
  static constexpr int kK = kQ + kQBytes;
  static constexpr int kV = kK + STAGES * kKBytes;
  static constexpr int kS = kV + STAGES * kVBytes;
  static constexpr int kBar = kS + STAGES * kSBytes;
  static constexpr int kBytes = kBar + 8 * (1 + 3 * STAGES) + 1024;  // + alignment slack
};

// named barriers 1 and 2: the consumer warpgroups take turns at the tensor cores (ping-pong); SAGE_RING64's ring the
// same with barriers 6-8 (each counts the waiting warpgroup and the one passing to it)
template <bool PP>
__device__ __forceinline__ void named_sync(int id) {
  if (!PP) return;
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "n"(kConsumerWarps * 32) : "memory");
}
template <bool PP>
__device__ __forceinline__ void named_arrive(int id) {
  if (!PP) return;
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "n"(kConsumerWarps * 32) : "memory");
}
// SAGE_RING64's ring of three warpgroups: warpgroup w waits at barrier 6 + w (ring_wait) and passes the turn to
// 6 + (w + 1) % 3 (ring_pass). The ids are immediates, one instruction each behind a predicate on w: an id in a
// register is one more live register across the loop, and at 160 registers the hd64 kernels then spilled 8-24 bytes.
#define SAGE_RING_ASM(OP, A, B, C)                                                                                    \
  asm volatile("{\n.reg .pred p0, p1, p2;\nsetp.eq.s32 p0, %0, 0;\nsetp.eq.s32 p1, %0, 1;\nsetp.eq.s32 p2, %0, 2;\n" \
               "@p0 " OP " " #A ", %1;\n@p1 " OP " " #B ", %1;\n@p2 " OP " " #C ", %1;\n}\n" ::"r"(wg),           \
               "n"(kConsumerWarps * 32)                                                                              \
               : "memory")
template <bool ON>
__device__ __forceinline__ void ring_wait(int wg) {
  if (ON) SAGE_RING_ASM("bar.sync", 6, 7, 8);
}
template <bool ON>
__device__ __forceinline__ void ring_pass(int wg) {
  if (ON) SAGE_RING_ASM("bar.arrive", 7, 8, 6);
}
#undef SAGE_RING_ASM
template <bool PP>
__device__ __forceinline__ void named_arrive_if(int id, bool pred) {  // predicated: no branch between wgmmas
  if (!PP) return;
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %2, 0;\n"
      "@p bar.arrive %0, %1;\n"
      "}\n" ::"r"(id),
      "n"(kConsumerWarps * 32), "r"(static_cast<int>(pred))
      : "memory");
}

// SAGE_SMAGIC: S of these kernels starts from 1.5 * 2^23's bits (s_magic, four copies), not from zero
// the bit of a per-kernel-kind knob (SAGE_SMAGIC, SAGE_PVLAG): 1 non-causal hd64, 2 causal hd64, 4 hd128
template <int D, bool CAUSAL>
__host__ __device__ constexpr int kind_bit() {
  return D == 128 ? 4 : CAUSAL ? 2 : 1;
}
template <int D, bool CAUSAL>
__host__ __device__ constexpr bool s_magic_on() {
  return SAGE_KGROUP && (SAGE_SMAGIC & kind_bit<D, CAUSAL>()) != 0;
}
// SAGE_PVLAG: PV of a tile lags into the next tile's softmax in these kernels
template <int D, bool CAUSAL>
__host__ __device__ constexpr bool pv_lag_on() {
  return (SAGE_PVLAG & kind_bit<D, CAUSAL>()) != 0;
}
__shared__ __align__(16) uint32_t s_magic[4];  // 0x4B400000 (set at the kernel's start)
constexpr float kMagic = 12582912.0f;           // 1.5 * 2^23
// the accumulator filled with 0x4B400000 (volatile loads: one LDS.128 per four registers, not merged)
__device__ __forceinline__ void s_magic_fill(uint32_t (&d)[64]) {
#pragma unroll
  for (int i = 0; i < 64; i += 4)
    asm volatile("ld.volatile.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(d[i]), "=r"(d[i + 1]), "=r"(d[i + 2]), "=r"(d[i + 3])
                 : "r"(smem_u32(s_magic)));
}

// S = Q K^T of one tile; MAGIC: onto the accumulator's fill (s_magic_fill), else from zero
template <int D, bool MAGIC>
__device__ __forceinline__ void issue_s(uint32_t (&sacc)[64], uint64_t dq, const uint8_t* sk) {
#pragma unroll
  for (int kk = 0; kk < D / 32; ++kk) wgmma_s8_n128(sacc, dq + 2 * kk, smem_desc<D>(sk) + 2 * kk, MAGIC ? 1 : kk);
}

// Key order of a K tile in shared memory. The producer loads the tile's 128 keys so that S's accumulator
// column 8i + 2t + e (i < 16, t < 4, e < 2: what lane t of a quad holds) is key key_base(i) + 4t + e of the
// tile. Then the E4M3 A fragment of the PV wgmma, which wants keys 32kk + 16h + 4t + {0..3} of each row in
// lane t (register 2h (+1 for row g+8) of k-step kk), is made of the lane's own accumulator columns
// i = 4kk + 2h and 4kk + 2h + 1: no shuffles, and V^T keeps the prologue's natural key order.
// With SAGE_KPERM 0 the tile is in natural order: column 8i + 2t + e is key 8i + 2t + e.
__host__ __device__ constexpr int key_base(int i) { return SAGE_KPERM ? perm_base(i) : 8 * i; }
constexpr int kLaneKeys = SAGE_KPERM ? 4 : 2;  // key stride between the lanes of a quad

template <int N>
__device__ __forceinline__ float tree_max(const float* x) {  // max over x[0..N): depth log2 N
  if constexpr (N == 1) {
    return x[0];
  } else {
    return fmaxf(tree_max<N / 2>(x), tree_max<N / 2>(x + N / 2));
  }
}
template <int N>
__device__ __forceinline__ float tree_sum(const float* x) {
  if constexpr (N == 1) {
    return x[0];
  } else {
    return tree_sum<N / 2>(x) + tree_sum<N / 2>(x + N / 2);
  }
}

// an accumulator-layout tile (row g: elements 4i, 4i+1; row g+8: 4i+2, 4i+3) as its two rows
__device__ __forceinline__ void split_rows(const float (&z)[64], float (&r)[2][32]) {
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    r[0][2 * i] = z[4 * i + 0];
    r[0][2 * i + 1] = z[4 * i + 1];
    r[1][2 * i] = z[4 * i + 2];
    r[1][2 * i + 1] = z[4 * i + 3];
  }
}

// S tile (int32 accumulators, keys in the order of key_base) -> online softmax -> P~ as E4M3 A fragments.
// Updates m_i and the per-thread partial row sums l_i; returns the rescale factors of the rows. edge: the
// tile crosses the key end or the causal diagonal (masked); keys past the end read zero scales from the
// TMA fill. One code path: only the logits are touched under the edge branch, never a register a wgmma
// reads (else ptxas serializes every wgmma of the kernel, warning C7520).
template <int E>
struct EdgeMask {
  static constexpr int value = E;
};

// after_max() runs once the row maxima are known, before the rescale factors are updated (SAGE_PVLAG: the
// previous tile's PV is waited for and folded there).
template <bool CAUSAL, bool KR, int EDGE, bool MAGIC, typename AfterMax>
__device__ __forceinline__ void softmax_tile(const uint32_t (&sacc)[64], uint32_t (&pa)[4][4], float (&m_i)[2],
                                             float (&l_i)[2], float (&alpha)[2], const float* sks, bool edge,
                                             int n0, int klo, int khi, int r0, int coff, float qsc0, float qsc1,
                                             int t, int lane, AfterMax after_max) {
  const bool mask = EDGE == 1 || (EDGE == 2 && edge);
  float z[64];
  // under `mask` (the tile crosses an end of the key range [klo, khi) or the causal diagonal): this
  // thread's visible logits (without KR the range is [0, lk))
  auto visible = [&](int i, int e, int row) {
    const int col = n0 + key_base(i) + kLaneKeys * t + e;
    return (!KR || col >= klo) && col < khi && (!CAUSAL || col <= row + coff);
  };
#if SAGE_KGROUP
  static_assert(SAGE_KPERM, "SAGE_KGROUP's groups are the lanes' keys of SAGE_KPERM's order");
  // K scales tied in groups of 32 keys per tile (the keys k with (k >> 2) & 3 == t: exactly this lane's
  // columns), so the thread's logits share one K scale dk: the row max is taken on S itself (exact int32
  // -> fp32, I2FP) and each logit costs one FFMA, S * (qsc * dk) + offset, below. A masked logit is -inf
  // from here on (its FFMA keeps it: the factor is > 0 or NaN, see a0). dk == 0 (an all-zero key group, or
  // keys past the end: zero scales from the TMA fill) gives logit 0 for the unmasked keys.
  const float dk = sks[kLaneKeys * t];
  // (MAGIC: the accumulators are 1.5 * 2^23 + S as floats; the constant is taken off the row max and the offsets)
#pragma unroll
  for (int i = 0; i < 64; ++i) z[i] = MAGIC ? __int_as_float(sacc[i]) : __int2float_rn(static_cast<int>(sacc[i]));
#else
  // y = S * delta_K (the row scale qsc = delta_Q * c > 0 comes in through one FFMA below: rounding is
  // monotone, so the row max of qsc * y is qsc * max y). int32 -> fp32 through the 1.5 * 2^23 trick
  // (|S| <= 127^2 * 128 < 2^22: the bits of S + 0x4B400000 are the float 1.5 * 2^23 + S exactly) with the
  // subtraction folded into the scaling FFMA: y = f * dK - round(1.5 * 2^23 * dK), one rounding of the
  // exact product; the error is below dK (one unit of S, far under S's quantization error).
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const float2 kv = *reinterpret_cast<const float2*>(sks + key_base(i) + kLaneKeys * t);
    const float nx = kv.x * -12582912.0f, ny = kv.y * -12582912.0f;
    z[4 * i + 0] = fmaf(__int_as_float(sacc[4 * i + 0] + 0x4B400000u), kv.x, nx);
    z[4 * i + 1] = fmaf(__int_as_float(sacc[4 * i + 1] + 0x4B400000u), kv.y, ny);
    z[4 * i + 2] = fmaf(__int_as_float(sacc[4 * i + 2] + 0x4B400000u), kv.x, nx);
    z[4 * i + 3] = fmaf(__int_as_float(sacc[4 * i + 3] + 0x4B400000u), kv.y, ny);
  }
#endif
  if (mask) {
#pragma unroll
    for (int i = 0; i < 16; ++i)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        if (!visible(i, e, r0)) z[4 * i + e] = -INFINITY;
        if (!visible(i, e, r0 + 8)) z[4 * i + 2 + e] = -INFINITY;
      }
  }
  float r[2][32];
  split_rows(z, r);
  float mx0, mx1;
  if constexpr (MAGIC && SAGE_IMAX) {
    // the logits so far are 1.5 * 2^23 + S (positive floats) or a masked -inf (negative as int32): their bits
    // order as int32 as the floats do, and the integer max has three inputs on sm90 (VIMNMX3)
    int ri[2][32];
#pragma unroll
    for (int i = 0; i < 32; ++i) ri[0][i] = __float_as_int(r[0][i]), ri[1][i] = __float_as_int(r[1][i]);
    mx0 = __int_as_float(tree_imax<32>(ri[0]));
    mx1 = __int_as_float(tree_imax<32>(ri[1]));
  } else {
    mx0 = tree_max<32>(r[0]);
    mx1 = tree_max<32>(r[1]);
  }
#if SAGE_KGROUP
  if constexpr (MAGIC) {  // exact: both in [2^23, 2^24) (-inf stays -inf)
    mx0 -= kMagic;
    mx1 -= kMagic;
  }
  if (mask) {  // -inf * 0 would be NaN
    mx0 = mx0 == -INFINITY ? -INFINITY : mx0 * dk;
    mx1 = mx1 == -INFINITY ? -INFINITY : mx1 * dk;
  } else {
    mx0 *= dk;
    mx1 *= dk;
  }
#endif
  mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
  mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
  mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
  mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
  mx0 *= qsc0;
  mx1 *= qsc1;
  after_max();  // (alpha still holds the previous tile's factors here)
  const float mn0 = fmaxf(m_i[0], mx0), mn1 = fmaxf(m_i[1], mx1);
  const float mu0 = mn0 == -INFINITY ? 0.f : mn0, mu1 = mn1 == -INFINITY ? 0.f : mn1;
  alpha[0] = ex2(m_i[0] - mu0);
  alpha[1] = ex2(m_i[1] - mu1);
  float off0 = kPOff - mu0, off1 = kPOff - mu1;  // row max -> 448
#if SAGE_KGROUP
  // the logits' factors; 0 (dk == 0, or an underflow) becomes the smallest normal float, so that a masked
  // -inf stays -inf (-inf * 0 would be NaN) and an unmasked logit still gives the offset; NaN stays NaN
  float a0 = qsc0 * dk, a1 = qsc1 * dk;
  a0 = a0 == 0.f ? 1.17549435e-38f : a0;
  a1 = a1 == 0.f ? 1.17549435e-38f : a1;
  if constexpr (MAGIC) {  // z * a + off with z = 1.5 * 2^23 + S: off - 1.5 * 2^23 * a (rounded once)
    off0 = fmaf(-kMagic, a0, off0);
    off1 = fmaf(-kMagic, a1, off1);
  }
#pragma unroll
  for (int i = 0; i < 64; ++i) z[i] = ex2(fmaf(z[i], (i & 2) ? a1 : a0, (i & 2) ? off1 : off0));
#else
#pragma unroll
  for (int i = 0; i < 64; ++i) {
    z[i] = ex2(fmaf(z[i], (i & 2) ? qsc1 : qsc0, (i & 2) ? off1 : off0));  // masked: -inf
  }
#endif
  split_rows(z, r);
  const float rs0 = tree_sum<32>(r[0]), rs1 = tree_sum<32>(r[1]);
  l_i[0] = fmaf(l_i[0], alpha[0], rs0);  // per-thread partial row sums (quad-reduced at the end)
  l_i[1] = fmaf(l_i[1], alpha[1], rs1);
  m_i[0] = mn0;
  m_i[1] = mn1;

  // P~ -> E4M3 A fragments: register (kk, 2h + rh) = row g + 8rh, keys 32kk + 16h + 4t + {0..3}
  //   SAGE_KPERM: the lane's own accumulator columns i = 4kk + 2h, +1;
  //   else: this lane has keys {2t, 2t+1, 8+2t, 9+2t} of each 16: two quad shuffles + one byte permute.
  const int src0 = (lane & ~3) | ((2 * t) & 3), src1 = (lane & ~3) | ((2 * t + 1) & 3);
  const uint32_t sel = t < 2 ? 0x5410u : 0x7632u;
#pragma unroll
  for (int c = 0; c < 8; ++c) {
#pragma unroll
    for (int rh = 0; rh < 2; ++rh) {
      const int i0 = 2 * c, i1 = 2 * c + 1;
      const uint32_t x = e4m3x2(z[4 * i0 + 2 * rh], z[4 * i0 + 2 * rh + 1]) |
                         (e4m3x2(z[4 * i1 + 2 * rh], z[4 * i1 + 2 * rh + 1]) << 16);
      if constexpr (SAGE_KPERM) {
        pa[c >> 1][(c & 1) * 2 + rh] = x;
      } else {
        const uint32_t y0 = __shfl_sync(0xffffffffu, x, src0);
        const uint32_t y1 = __shfl_sync(0xffffffffu, x, src1);
        pa[c >> 1][(c & 1) * 2 + rh] = __byte_perm(y0, y1, sel);
      }
    }
  }
}

// KR: the CTA's key range [x, y) as the kernel's start stored it in shared memory, read anew at each use (asm
// volatile: not hoisted, not held in registers); otherwise [0, lk)
template <bool KR>
__device__ __forceinline__ int2 key_range(const int* srange, int lk) {
  if constexpr (!KR) {
    return make_int2(0, lk);
  } else {
    int2 r;
    asm volatile("ld.shared.v2.s32 {%0, %1}, [%2];\n" : "=r"(r.x), "=r"(r.y) : "r"(smem_u32(srange)));
    return r;
  }
}

// two-level accumulation: O = alpha * O + O_tile (fp32), once per tile
template <int D>
__device__ __forceinline__ void fold_tile(float (&o)[D / 2], const float (&ot)[D / 2], const float (&alpha)[2]) {
#pragma unroll
  for (int i = 0; i < D / 8; ++i) {
    o[4 * i + 0] = fmaf(o[4 * i + 0], alpha[0], ot[4 * i + 0]);
    o[4 * i + 1] = fmaf(o[4 * i + 1], alpha[0], ot[4 * i + 1]);
    o[4 * i + 2] = fmaf(o[4 * i + 2], alpha[1], ot[4 * i + 2]);
    o[4 * i + 3] = fmaf(o[4 * i + 3], alpha[1], ot[4 * i + 3]);
  }
}

template <int D, int STAGES, bool CAUSAL, bool KR, typename OutT>
__global__ void __launch_bounds__(threads<D>(), 1)
    fwd_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
               const __grid_constant__ CUtensorMap tm_v, const __grid_constant__ CUtensorMap tm_s,
               const Params p) {
#if SAGE_SM90A
  using L = Layout<D, STAGES>;
  constexpr bool kPP = D == 64 ? SAGE_PINGPONG64 : (CAUSAL ? SAGE_PINGPONG128C : SAGE_PINGPONG128);
  constexpr int kBM = block_m<D>(), kCW = 4 * consumer_wgs<D>();  // rows, consumer warps
  constexpr int kNwg = consumer_wgs<D>();
  constexpr bool kRing =
      D == 64 && (CAUSAL ? SAGE_RING64C : SAGE_RING64) && consumer_wgs<D>() == 3 && !kPP;
  constexpr bool kMagic = s_magic_on<D, CAUSAL>();
  constexpr bool kLag = pv_lag_on<D, CAUSAL>();
  constexpr int kKrLoop = D == 64 ? SAGE_KRLOOP64 : SAGE_KRLOOP128;
  static_assert(kKrLoop == 0 || kKrLoop == 2, "SAGE_KRLOOP64 / SAGE_KRLOOP128: 0 or 2");
  static_assert(consumer_wgs<D>() == 2 || (consumer_wgs<D>() == 3 && !kPP), "2 warpgroups, or 3 without ping-pong");
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  uint8_t* sq = smem + L::kQ;
  uint8_t* sk = smem + L::kK;
  uint8_t* sv = smem + L::kV;
  float* ss = reinterpret_cast<float*>(smem + L::kS);
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + L::kBar);
  uint64_t* q_full = bars;
  uint64_t* k_full = bars + 1;  // K tile + its scales
  uint64_t* v_full = bars + 1 + STAGES;
  uint64_t* empty = bars + 1 + 2 * STAGES;

  // KR (key-range masks): a device-side flag says which of the launched kernels serves (mask_structure in
  // kernels/int8_fp8/attention.py); the others leave before touching anything
  if (KR && __ldg(p.flag) != p.want) return;
  // One CTA per (query block, batch x head), causal's longest rows first within each head. Persistent CTAs (one per
  // SM taking the same items round-robin, the ring and Q's barrier running on across items, the next item's
  // loads under this one's last tile and epilogue; code at 59c6a66) were slower, same outputs: run 101 (H100,
  // kernel only, 2 x 30 heads) hd128 16K 883 vs 891-903 TOPS, 8K 836 vs 855-859, causal 16K 704 vs 786-875
  // (a static round-robin balances causal rows worse than the block scheduler), hd64 16K 588 vs 603-606.
  const int m_blk = gridDim.x - 1 - blockIdx.x;  // causal: the longest rows first
  const int bh = blockIdx.y;
  const int m0 = m_blk * kBM;
  // visible keys [klo, khi) (KR: this batch's range); the tiles j0 .. j0 + n_tiles - 1, 128-key aligned as in
  // the reference (the K scales' groups and P's per-tile scale follow those tiles)
  int klo = 0, khi = p.lk;
  __shared__ int srange[2];  // KR: the batch's key range (a static address: no register holds it)
  if constexpr (KR) {
    const int b = bh / p.hq;
    klo = max(0, __ldg(p.krange + 2 * b));
    khi = min(p.lk, __ldg(p.krange + 2 * b + 1));
    if (threadIdx.x == 0) srange[0] = klo, srange[1] = khi;  // (read by the masked tiles, see key_range)
  }
  int hi = khi;
  if (CAUSAL) hi = min(khi, m0 + kBM + p.coff);
  const int j0 = KR ? klo / kBN : 0;
  const int n_tiles = hi > klo ? (hi + kBN - 1) / kBN - j0 : 0;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  if (threadIdx.x == 0) {
    mbar_init(q_full, 1);
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&k_full[s], 1);
      mbar_init(&v_full[s], 1);
      mbar_init(&empty[s], kCW);
    }
    if (kMagic)
      for (int i = 0; i < 4; ++i) s_magic[i] = 0x4B400000u;
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  if (warp >= kCW) {  // producer warpgroup: gives its registers to the consumers
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n");
    if (warp == kCW && lane == 0) {
      const int bhk = (bh / p.hq) * (p.hq / p.group) + (bh % p.hq) / p.group;  // K/V's (batch, kv head)
      tma_prefetch(&tm_q);
      tma_prefetch(&tm_k);
      tma_prefetch(&tm_v);
      tma_prefetch(&tm_s);
      mbar_expect_tx(q_full, L::kQBytes);
      tma_load_3d(sq, &tm_q, q_full, 0, m0, bh);
      for (int i = 0; i < n_tiles; ++i) {  // the i-th tile of this CTA (ring slot and phase), key tile j
        const int s = i % STAGES, j = j0 + i;
        if (i >= STAGES) mbar_wait(&empty[s], ((i / STAGES) - 1) & 1);
        mbar_expect_tx(&k_full[s], L::kKBytes + L::kSBytes);
        if (SAGE_KPERM) {
#pragma unroll
          for (int r = 0; r < 16; ++r)  // 8 rows each, keys key_base(r) + 4t + e at row 2t + e (see key_base)
            tma_load_4d(sk + s * L::kKBytes + r * 8 * D, &tm_k, &k_full[s], 0, key_base(r) & 3,
                        (j * kBN + (key_base(r) & ~3)) / 4, bhk);
        } else {
          tma_load_4d(sk + s * L::kKBytes, &tm_k, &k_full[s], 0, 0, j * kBN / 4, bhk);
        }
        tma_load_3d(ss + s * kBN, &tm_s, &k_full[s], j * kBN, bhk, 0);
        mbar_expect_tx(&v_full[s], L::kVBytes);
        tma_load_3d(sv + s * L::kVBytes, &tm_v, &v_full[s], j * kBN, 0, bhk);
      }
    }
    return;
  }

  // consumers
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(consumer_regs<D>()));
  // (with SAGE_PVLAG or SAGE_WGSHFL, the warpgroup index through a shuffle from lane 0: ptxas then treats it as
  // warp-uniform, and what derives from it (Q's descriptor, the barrier ids) lives in uniform registers)
  const int wg = kLag || SAGE_WGSHFL ? __shfl_sync(0xffffffffu, warp / 4, 0) : warp / 4;
  const int w = warp % 4, g = lane / 4, t = lane % 4;
  const int r0 = m0 + wg * 64 + w * 16 + g;  // this thread's rows: r0, r0 + 8
  const float* qs = p.qs + static_cast<size_t>(bh) * p.lq;
  // a zero row scale (padding rows, all-zero query rows) becomes the smallest normal float: every finite
  // logit then still gives the exp argument log2(448) exactly (uniform attention, as the reference) and a
  // masked -inf stays -inf (0 * -inf would be NaN); NaN scales stay NaN
  float qsc0 = r0 < p.lq ? qs[r0] * p.c : 0.f;
  float qsc1 = r0 + 8 < p.lq ? qs[r0 + 8] * p.c : 0.f;
  qsc0 = qsc0 == 0.f ? 1.17549435e-38f : qsc0;
  qsc1 = qsc1 == 0.f ? 1.17549435e-38f : qsc1;
  const int wg_first = m0 + wg * 64;
  const int my_bar = 1 + wg, other_bar = 2 - wg;

  float m_i[2] = {-INFINITY, -INFINITY}, l_i[2] = {0.f, 0.f}, alpha[2];
  float o[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
  const uint64_t dq = smem_desc<D>(sq + wg * 64 * D);

  mbar_wait(q_full, 0);
  if (n_tiles > 0) {
    // Ping-pong (kPP): a warpgroup's turn at the tensor cores issues PV of its current tile and S of its
    // next one; the other warpgroup's softmax runs meanwhile. Warpgroup 0 starts. Without kPP the same
    // code runs with no turn order (at hd64 the softmax, not the tensor cores, bounds the loop: its issue slots
    // and latencies, not MUFU alone). Timed and dropped (runs 35-38, benchmarks/results/cuda_variants_run3[568]_*,
    // the code at aaff619 / 61617ad): 2-5 of every 8 exps as FMA polynomials, 11-24 % slower at hd64 16K; at
    // hd64 each of 2 warpgroups overlapping its own S/PV with its softmax, 9 % slower than 3 without; the K
    // scales' -1.5 * 2^23 * dK products precomputed by a producer warp (27 instructions fewer a tile), within
    // the 2-4 % spread of identical builds at hd128 and 4-7 % slower at hd64 (spills).
    uint32_t sacc[64];  // the first wgmma of each S starts a fresh sum (scale-d 0)
    // kLag: PV's accumulator and P~'s fragments outlive a tile (its PV completes in the next one's softmax);
    // the first tile folds a zero tile with factor 1
    float ot_lag[D / 2];
    uint32_t pa_lag[4][4];
    if constexpr (kLag) {
#pragma unroll
      for (int i = 0; i < D / 2; ++i) ot_lag[i] = 0.f;
      alpha[0] = alpha[1] = 1.f;
    }
    if (wg == 1) named_arrive<kPP>(1);
    if (wg == kNwg - 1) named_arrive<kRing>(6);
    named_sync<kPP>(my_bar);
    ring_wait<kRing>(wg);
    if constexpr (kMagic) s_magic_fill(sacc);
    mbar_wait(&k_full[0], 0);
    wg_fence();
    issue_s<D, kMagic>(sacc, dq, sk);
    wg_commit();
    named_arrive<kPP>(other_bar);
    ring_pass<kRing>(wg);
    wg_wait0();
    reg_fence(sacc);
    // one tile: softmax, then the turn at the tensor cores; edge_c: EdgeMask<0> the tile needs no mask,
    // <1> it does, <2> a runtime test (SAGE_EDGELOOP's bit unset)
    auto tile = [&](int j, auto edge_c) {  // j: the CTA's j-th tile (key tile j0 + j)
      constexpr int kEdge = decltype(edge_c)::value;
      const int s = j % STAGES;
      const uint32_t parity = (j / STAGES) & 1;
      // the key range, n0 and edge matter to tiles that may need a mask only; KR reads the range from
      // shared memory there, so that it is not held in registers across the loop of the full tiles (at hd64
      // three more live registers changed that loop's schedule: 21 % slower, run 61)
      int2 kr = make_int2(0, p.lk);
      if constexpr (kEdge != 0) kr = key_range<KR>(srange, p.lk);
      const int n0 = ((KR ? kr.x / kBN : 0) + j) * kBN;
      const bool edge = (n0 + kBN > kr.y) || (KR && n0 < kr.x) || (CAUSAL && (n0 + kBN - 1 > wg_first + p.coff));
      if constexpr (kLag) {
        // the previous tile's PV is in flight: waited for and folded (with that tile's factors, still in
        // alpha) once this tile's row maxima are known
        auto fold_prev = [&]() {
          // this tile's V first: its try-wait loop is a branch, which ptxas does not hoist the wait_group across
          // (alone, the wait_group went to the top of the softmax, before the row max: no overlap)
          mbar_wait(&v_full[s], parity);
          wg_wait0();
          reg_fence(ot_lag);
          if (j > 0) mbar_arrive_one(&empty[(j + STAGES - 1) % STAGES]);  // that tile's stage is free
          fold_tile<D>(o, ot_lag, alpha);
        };
        softmax_tile<CAUSAL, KR, kEdge, kMagic>(sacc, pa_lag, m_i, l_i, alpha, ss + s * kBN, edge, n0, kr.x, kr.y, r0,
                                                p.coff, qsc0, qsc1, t, lane, fold_prev);
        if constexpr (kMagic) s_magic_fill(sacc);
        const bool more = j + 1 < n_tiles;
        const int s1 = more ? (j + 1) % STAGES : s;
        // the turn: S of the next tile (its own commit group), then PV of this one; wait for S alone
        named_sync<kPP>(my_bar);
        ring_wait<kRing>(wg);
        if (more) mbar_wait(&k_full[s1], ((j + 1) / STAGES) & 1);
        wg_fence();
        issue_s<D, kMagic>(sacc, dq, sk + s1 * L::kKBytes);
        wg_commit();
#pragma unroll
        for (int kk = 0; kk < kBN / 32; ++kk)
          wgmma_pv<D>(ot_lag, pa_lag[kk], smem_desc<128>(sv + s * L::kVBytes) + 2 * kk, kk);
        wg_commit();
        named_arrive_if<kPP>(other_bar, !(wg == 1 && !more));
        ring_pass<kRing>(wg);
        wg_wait1();
        reg_fence(sacc);
        return;
      }
      uint32_t pa[4][4];
      softmax_tile<CAUSAL, KR, kEdge, kMagic>(sacc, pa, m_i, l_i, alpha, ss + s * kBN, edge, n0, kr.x, kr.y, r0,
                                              p.coff, qsc0, qsc1, t, lane, [] {});
      if constexpr (kMagic) s_magic_fill(sacc);  // (S's registers are free from here)
      // the turn: PV of this tile, then S of the next one (on the last tile S is recomputed on this tile's
      // K, which this warpgroup still holds, and dropped: no wgmma may sit in a conditional, see above)
      const bool more = j + 1 < n_tiles;
      const int s1 = more ? (j + 1) % STAGES : s;
      float ot[D / 2];  // fresh tensor-core accumulator of this tile (scale-d 0 on the first wgmma)
      named_sync<kPP>(my_bar);
      ring_wait<kRing>(wg);
      mbar_wait(&v_full[s], parity);
      if (more) mbar_wait(&k_full[s1], ((j + 1) / STAGES) & 1);
      wg_fence();
#pragma unroll
      for (int kk = 0; kk < kBN / 32; ++kk)
        wgmma_pv<D>(ot, pa[kk], smem_desc<128>(sv + s * L::kVBytes) + 2 * kk, kk);
      issue_s<D, kMagic>(sacc, dq, sk + s1 * L::kKBytes);
      wg_commit();
      named_arrive_if<kPP>(other_bar, !(wg == 1 && !more));  // (warpgroup 0 has no turn left)
      ring_pass<kRing>(wg);
      wg_wait0();
      reg_fence(ot);
      reg_fence(sacc);
      mbar_arrive_one(&empty[s]);  // this warp is done with the stage
      fold_tile<D>(o, ot, alpha);
    };
    if constexpr ((SAGE_EDGELOOP & (CAUSAL ? 2 : 1)) != 0 && !(KR && kKrLoop == 2)) {
      // the tiles needing no mask first (all but the last at most, or up to the diagonal), then the rest:
      // the full tiles' loop carries no masking code at all
      const int vis = CAUSAL ? min(khi, wg_first + p.coff + 1) : khi;  // keys every row of the warpgroup sees
      const int n_full = min(n_tiles, vis > 0 ? vis / kBN - j0 : 0);
      int j = 0;
      if (KR && klo % kBN != 0) tile(j++, EdgeMask<1>{});  // (n_tiles > 0 here) the range starts inside a tile
      for (; j < n_full; ++j) tile(j, EdgeMask<0>{});
      for (; j < n_tiles; ++j) tile(j, EdgeMask<1>{});
    } else {
      for (int j = 0; j < n_tiles; ++j) tile(j, EdgeMask<2>{});
    }
    // the tensor-core ring: warpgroup 0 takes the last warpgroup's final pass here, so that no barrier is left
    // with an arrival
    if (wg == 0) named_sync<kRing>(6);
    if constexpr (kLag) {  // the last tile's PV
      wg_wait0();
      reg_fence(ot_lag);
      fold_tile<D>(o, ot_lag, alpha);
    }
  }

  // epilogue: full row sums over the quad, O * delta_V / l (0 for rows that see no key)
  float l0 = l_i[0], l1 = l_i[1];
  l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
  l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
  const float inv0 = l0 == 0.f ? 0.f : 1.f / l0, inv1 = l1 == 0.f ? 0.f : 1.f / l1;
  const int bh_e = ctaid_y(), b = bh_e / p.hq, h = bh_e % p.hq;
  const float* vs = p.vs + static_cast<size_t>(b * (p.hq / p.group) + h / p.group) * D;
  OutT* out = static_cast<OutT*>(p.out) + b * p.sob + h * p.soh;
#pragma unroll
  for (int i = 0; i < D / 8; ++i) {
    const int col = 8 * i + 2 * t;
    const float v0 = __ldg(vs + col), v1 = __ldg(vs + col + 1);
    if (r0 < p.lq) store2<OutT>(out + r0 * p.son + col, o[4 * i + 0] * inv0 * v0, o[4 * i + 1] * inv0 * v1);
    if (r0 + 8 < p.lq)
      store2<OutT>(out + (r0 + 8) * p.son + col, o[4 * i + 2] * inv1 * v0, o[4 * i + 3] * inv1 * v1);
  }
#endif
}


template <int D, int STAGES, bool CAUSAL, bool KR, typename OutT>
int launch(const CUtensorMap& mq, const CUtensorMap& mk, const CUtensorMap& mv, const CUtensorMap& ms,
           const Params& p, int b, cudaStream_t stream) {
  using L = Layout<D, STAGES>;
  auto kernel = fwd_kernel<D, STAGES, CAUSAL, KR, OutT>;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, L::kBytes) != cudaSuccess)
    return 12;
  dim3 grid((p.lq + block_m<D>() - 1) / block_m<D>(), b * p.hq);
  kernel<<<grid, threads<D>(), L::kBytes, stream>>>(mq, mk, mv, ms, p);
  return cudaGetLastError() == cudaSuccess ? 0 : 13;
}

template <int D, typename OutT>
int dispatch_causal(const CUtensorMap& mq, const CUtensorMap& mk, const CUtensorMap& mv, const CUtensorMap& ms,
                    const Params& p, int b, bool causal, cudaStream_t stream) {
  constexpr int kStages = D == 128 ? SAGE_STAGES128 : SAGE_STAGES64;
  constexpr int kStagesC = D == 128 ? SAGE_STAGES128 : SAGE_STAGES64C;  // causal
  if (p.krange != nullptr)
    return causal ? launch<D, kStagesC, true, true, OutT>(mq, mk, mv, ms, p, b, stream)
                  : launch<D, kStages, false, true, OutT>(mq, mk, mv, ms, p, b, stream);
  return causal ? launch<D, kStagesC, true, false, OutT>(mq, mk, mv, ms, p, b, stream)
                : launch<D, kStages, false, false, OutT>(mq, mk, mv, ms, p, b, stream);
}

}  // namespace sage_sm90

// Returns 0 on success; 1 unsupported arguments; 10-13 tensor-map / launch failures (see the launcher).
// Lengths in elements; ldk = K's rows per head (>= lk, a multiple of 4; rows past lk are zeros), ldv = V^T's
// row stride (>= lk, a multiple of 16), ldks = the K scales' row stride (>= lk, a multiple of 4), all in
// elements; out strides in elements. Key-range masks: krange (b, 2) int32 device pointer, each batch's visible
// keys [first, end) (clamped to [0, lk)), and flag (int32[1], device): the kernel runs where *flag == want and
// leaves at once elsewhere (no host sync: the caller launches one kernel per possible flag value); krange null:
// every key visible (flag and want unused).
extern "C" int sage_int8_fp8_sm90_fwd(const void* q8, const float* qs, const void* k8, long long ldk, const float* ks,
                                      long long ldks, const void* v8, const float* vs, void* out, int out_fp16,
                                      int b, int hq, int hkv, int lq, int lk, int d, long long ldv, long long sob,
                                      long long soh, long long son, float c, int causal, int coff,
                                      const int* krange, const int* flag, int want, void* stream) {
  using namespace sage_sm90;
  if ((d != 64 && d != 128) || hkv <= 0 || hq % hkv != 0 || lq <= 0 || lk <= 0 || ldk % 4 != 0 || ldk < lk ||
      ldv % 16 != 0 || ldv < lk || ldks % 4 != 0 || ldks < lk || b * hq > 65535 || ((krange == nullptr) != (flag == nullptr)))
    return 1;
  const CUtensorMapSwizzle qk_swz = d == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B;
  const uint64_t ud = d, bhq = static_cast<uint64_t>(b) * hq, bhk = static_cast<uint64_t>(b) * hkv;
  CUtensorMap mq, mk, mv, ms;
  // Q (d, lq, b*hq), 128-row boxes
  const uint64_t q_dims[3] = {ud, static_cast<uint64_t>(lq), bhq}, q_str[2] = {ud, static_cast<uint64_t>(lq) * ud};
  const uint32_t q_box[3] = {static_cast<uint32_t>(d), static_cast<uint32_t>(d == 128 ? block_m<128>() : block_m<64>()), 1};
  // K viewed as (d, key % 4, key / 4, b*hkv): a (d, 2, 4, 1) box is 8 rows of the key order of key_base
  // (SAGE_KPERM), a (d, 4, 32, 1) box a whole tile in natural order
  const uint64_t k_dims[4] = {ud, 4, static_cast<uint64_t>(ldk) / 4, bhk};
  const uint64_t k_str[3] = {ud, 4 * ud, static_cast<uint64_t>(ldk) * ud};
  const uint32_t k_box[4] = {static_cast<uint32_t>(d), SAGE_KPERM ? 2u : 4u, SAGE_KPERM ? 4u : kBN / 4, 1};
  // V^T (lk, d, b*hkv) with row stride ldv, (128 keys, d) boxes
  const uint64_t v_dims[3] = {static_cast<uint64_t>(lk), ud, bhk};
  const uint64_t v_str[2] = {static_cast<uint64_t>(ldv), static_cast<uint64_t>(ldv) * ud};
  const uint32_t v_box[3] = {kBN, static_cast<uint32_t>(d), 1};
  // K scales (ldks, b*hkv) fp32, 128-key boxes
  const uint64_t s_dims[3] = {static_cast<uint64_t>(ldks), bhk, 1};
  const uint64_t s_str[2] = {static_cast<uint64_t>(ldks) * 4, static_cast<uint64_t>(ldks) * 4 * bhk};
  const uint32_t s_box[3] = {kBN, 1, 1};
  int rc = make_map(&mq, q8, 3, q_dims, q_str, q_box, qk_swz);
  if (!rc) rc = make_map(&mk, k8, 4, k_dims, k_str, k_box, qk_swz);
  if (!rc) rc = make_map(&mv, v8, 3, v_dims, v_str, v_box, CU_TENSOR_MAP_SWIZZLE_128B);
  if (!rc) rc = make_map(&ms, ks, 3, s_dims, s_str, s_box, CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_DATA_TYPE_FLOAT32);
  if (rc) return rc;
  Params p{qs, vs, krange, flag, want, out, hq, hq / hkv, lq, lk, c, coff, sob, soh, son};
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (d == 128)
    return out_fp16 ? dispatch_causal<128, __half>(mq, mk, mv, ms, p, b, causal, st)
                    : dispatch_causal<128, __nv_bfloat16>(mq, mk, mv, ms, p, b, causal, st);
  return out_fp16 ? dispatch_causal<64, __half>(mq, mk, mv, ms, p, b, causal, st)
                  : dispatch_causal<64, __nv_bfloat16>(mq, mk, mv, ms, p, b, causal, st);
}
