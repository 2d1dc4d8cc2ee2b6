#!/usr/bin/env bash
# One GPU session's steps, logs under $OUT (see benchmarks/README.md):
#   SAGE_COMPILE_COMMIT=<sha> bash benchmarks/gpu_run.sh tests tune bench block variants train e2e robust ncu ncu_cuda
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install --no-deps --no-build-isolation -q -e . 2>&1 | tail -2
if compgen -G ".whl/*.whl" > /dev/null; then  # peers (benchmark-only): fa3-fwd, sageattention
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv | tee "$OUT/gpu.txt"
for step in "$@"; do
  t0=$(date +%s)
  case $step in
    tests) python3 -m pytest -q -m gpu -rA -s -p no:cacheprovider ${PYTEST_N:+-n $PYTEST_N} ${PYTEST_K:+-k "$PYTEST_K"} ${PYTEST_FILES:-tests/} > "$OUT/gpu_tests.log" 2>&1
           tail -5 "$OUT/gpu_tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -20 ;;
    tune) python3 benchmarks/tune_int8_fp8.py --out "$OUT/tune_int8_fp8_h200.json" > "$OUT/tune.log" 2>&1
          tail -45 "$OUT/tune.log" ;;
    bench) timeout ${BENCH_TIMEOUT:-3000} python3 benchmarks/bench_attention.py ${BENCH_ARGS:---flex} --out "$OUT/${BENCH_NAME:-attention_h200}.json" > "$OUT/${BENCH_NAME:-attention_h200}.log" 2>&1
           tail -40 "$OUT/${BENCH_NAME:-attention_h200}.log" ;;
    block) timeout ${BLOCK_TIMEOUT:-900} python3 benchmarks/bench_block.py --out "$OUT/block_h200.json" ${BLOCK_ARGS:-} > "$OUT/block.log" 2>&1
           tail -40 "$OUT/block.log" ;;
    variants) timeout ${VARIANTS_TIMEOUT:-400} python3 benchmarks/cuda_variants.py --variants "${VARIANTS:-base=;e1=-DSAGE_EDGELOOP=1;base2=}" \
                ${VARIANT_ARGS:---batch 2 --heads 30 --shapes 64:17776:none,64:4096:none,64:16384:top_left,128:16384:none,128:16384:top_left} \
                --out "$OUT/cuda_variants.json" > "$OUT/cuda_variants.log" 2>&1
              grep -v -i warn "$OUT/cuda_variants.log" | tail -12 ;;
    train) timeout ${TRAIN_TIMEOUT:-300} python3 benchmarks/bench_train.py --out "$OUT/train_h200.json" > "$OUT/train.log" 2>&1
           tail -12 "$OUT/train.log" ;;
    e2e) for m in ${E2E_MODELS:-cogvideox flux}; do
           timeout ${E2E_TIMEOUT:-500} python3 benchmarks/bench_e2e.py --model $m --variants ${E2E_VARIANTS:-eager,inductor,sage_int8_fp8} \
             --out "$OUT/e2e_${m}_h200.json" > "$OUT/e2e_$m.log" 2>&1; tail -8 "$OUT/e2e_$m.log"
         done ;;
    robust) timeout ${ROBUST_TIMEOUT:-400} python3 benchmarks/robustness.py --out "$OUT/robustness_h200.json" > "$OUT/robustness.log" 2>&1
            grep -E "PASS|FAIL|wrote" "$OUT/robustness.log" ;;
    ncu) timeout 200 ncu --clock-control none --set full -k regex:_fwd_body -c 1 -o "$OUT/int8_fp8_hd128_16k" \
           python3 benchmarks/profile_one.py > "$OUT/ncu.log" 2>&1
         ncu --import "$OUT/int8_fp8_hd128_16k.ncu-rep" --page details > "$OUT/ncu_details.txt" 2>&1
         tail -3 "$OUT/ncu.log"; grep -E "Duration|Throughput|Registers|Spill|Warp Cycles|Issue Slots|Achieved Occupancy|Tensor" "$OUT/ncu_details.txt" | head -40 ;;
    ncu_cuda) d=${NCU_DIM:-128}; r="$OUT/int8_fp8_cuda_hd${d}_16k"
         timeout 200 ncu --clock-control none --set full --import-source yes -k regex:fwd_kernel -c 1 -o "$r" \
           python3 benchmarks/profile_one.py --core cuda --dim $d > "$OUT/ncu_cuda.log" 2>&1
         ncu --import "$r.ncu-rep" --page details > "${r}_details.txt" 2>&1
         ncu --import "$r.ncu-rep" --page raw > "${r}_raw.txt" 2>&1
         ncu --import "$r.ncu-rep" --page source --csv --print-source sass > "${r}_sass.csv" 2>&1 || true
         python3 benchmarks/ncu_stalls.py "${r}_sass.csv" > "${r}_stalls.txt" 2>&1 || true
         tail -3 "$OUT/ncu_cuda.log"; grep -E "Duration|Throughput|Registers|Spill|Warp Cycles|Issue Slots|Eligible|Tensor" "${r}_details.txt" | head -30
         grep -E "smsp__average_warps_issue_stalled_[a-z_]+_per_issue_active.ratio" "${r}_raw.txt" | sort -k3 -gr | head -12
         grep -E "sm__inst_executed_pipe_[a-z_]+.avg.pct_of_peak_sustained_active|sm__pipe_[a-z_]+_cycles_active.avg.pct" "${r}_raw.txt" | sort -k3 -gr | head -14 ;;
    *) echo "unknown step $step" ;;
  esac
  echo "== step $step: $(( $(date +%s) - t0 )) s"
done
