#!/bin/bash
# session 5, call B on nvidia-h200-x2. Phase 1: small nvfp4 layouts 1 pp2 dp2 tp2:pp2, sequential (clean tokens/s,
# PP=2 checkpoint resumed under TP=2); GPU1 meanwhile runs bench_kernels --gemm-only while the reference compiles.
# Phase 2: GPU1 = the full GPU test suite; GPU0 = bench_linear with both GEMM engines.
source scripts/gpu_env.sh .whl >/dev/null 2>/tmp/gpu_env.log || { cat /tmp/gpu_env.log; exit 1; }
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TRITON_CACHE_AUTOTUNING=1
T0=$(date +%s)
t() { echo "$1 rc=$2 at $(( $(date +%s) - T0 ))s" >> $OUT/times.txt; }
CK=/dev/shm/ck; mkdir -p $CK || CK=/tmp/ck
DATA="data.train_prefixes=[.gputmp/tokens/text_train] data.valid_prefixes=[.gputmp/tokens/text_validation] data.cache_dir=/tmp/idxcache"
R=/tmp/lay; mkdir -p $R
SMALL="model=small $DATA data.seq_length=2048 schedule.global_batch_size=32 schedule.micro_batch_size=8 schedule.warmup_steps=3 schedule.eval_interval=0 schedule.eval_batches=1 schedule.lr=1e-3"
lc() { # name timeout args...
  local name=$1 to=$2; shift 2
  timeout $to python3 scripts/layout_check.py --out $R/$name --ckpt-root $CK/$name --run-timeout $to "$@" > $OUT/$name.md 2>&1
  t $name $?
  rm -rf $CK/$name
  tar czf $OUT/runs.tgz --exclude=checkpoints -C $R . 2>/dev/null
}
( CUDA_VISIBLE_DEVICES=1 TRITON_CACHE_DIR=/tmp/tc_bk taskset -c 16-31 timeout 125 python3 scripts/bench_kernels.py --gemm-only --out $OUT/bk.json > $OUT/bench_kernels.md 2>&1; t bench_kernels $? ) &
lc seq2_nvfp4 320 --steps 12 --save-at 4 --save-at2 8 --layouts 1 pp2 dp2 tp2:pp2 -- $SMALL precision=nvfp4
wait
left=$(( 572 - ($(date +%s) - T0) ))
( CUDA_VISIBLE_DEVICES=1 MAMBA_DETERMINISTIC=1 TRITON_CACHE_DIR=/tmp/tc_test taskset -c 16-31 timeout $left python3 -m pytest -q -n 4 -m "triton or gpu" -p no:cacheprovider tests -rfE --tb=short > $OUT/test_gpu.log 2>&1; t tests $? ) &
( CUDA_VISIBLE_DEVICES=0 TRITON_CACHE_DIR=/tmp/tc_bl taskset -c 0-15 timeout $(( left - 3 )) python3 scripts/bench_linear.py --recipes bf16 fp8 nvfp4 --gemm-engine triton cublas --json $OUT/bl.json > $OUT/bench_linear.md 2>&1; t bench_linear $? ) &
wait
cat $OUT/times.txt; grep -E "^layout|^\||all layouts" $OUT/seq2_nvfp4.md; tail -3 $OUT/test_gpu.log; grep -E "^FAILED|^ERROR" $OUT/test_gpu.log | head -20; tail -25 $OUT/bench_linear.md
