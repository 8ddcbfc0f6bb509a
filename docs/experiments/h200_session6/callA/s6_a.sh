#!/bin/bash
# session 6, call A on nvidia-h200 (1 GPU): benchmarks only, nothing else on the GPU.
# bench_linear twice (issue 3: the layer with alpha formed inside the alpha pass), bench_kernels (GEMM + quantize,
# default cublas engine), bench_train small/1.2b/slice12b (issue 6, cublas engine; saved-by-fwd column), lean sweep.
source scripts/gpu_env.sh .whl >/dev/null 2>/tmp/gpu_env.log || { cat /tmp/gpu_env.log; exit 1; }
export PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=1 MAMBA_DETERMINISTIC=1
O=/tmp/o; mkdir -p $O
T0=$(date +%s); t() { echo "$1 rc=$2 at $(( $(date +%s) - T0 ))s" >> $O/times.txt; tar czf $OUT/a.tgz -C $O .; }
left() { echo $(( ${1:-575} - ($(date +%s) - T0) )); }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv > $O/gpu.txt 2>&1
timeout 100 python3 scripts/bench_linear.py --recipes bf16 fp8 nvfp4 --json $O/bl1.json > $O/bench_linear1.md 2>&1; t bench_linear1 $?
timeout 120 ncu --clock-control none --set full -k regex:'quantize_grouped|amax_grouped|copy' python3 .gputmp/ncu_q.py > $O/ncu_q.txt 2>&1; t ncu $?
timeout 80 python3 scripts/bench_linear.py --recipes bf16 fp8 nvfp4 --json $O/bl2.json > $O/bench_linear2.md 2>&1; t bench_linear2 $?
timeout 120 python3 scripts/bench_kernels.py --out $O/bk.json > $O/bench_kernels.md 2>&1; t bench_kernels $?
timeout $(left 545) python3 scripts/bench_train.py --cases small 1.2b slice12b --recipes bf16 fp8 nvfp4 --warmup 3 --iters 6 --json $O/bt.json > $O/bench_train.md 2>&1; t bench_train $?
L=$(left 580); [ $L -gt 40 ] && { timeout $L python3 scripts/bench_quantize_sweep.py --lean --out $O/sweep_lean.json > $O/sweep_lean.md 2>&1; t sweep_lean $?; }
cat $O/times.txt; tail -12 $O/bench_linear1.md; tail -12 $O/bench_linear2.md; tail -14 $O/bench_train.md
