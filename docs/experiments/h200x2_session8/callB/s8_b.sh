#!/bin/bash
# session 8 call B, nvidia-h200-x2, carry [".whlcc", ".gpucv"]:
# GPU 0 (cores 0-15): the timings of .gpus7/next_1gpu.sh (+ small mxfp4 --profile);
# GPU 1 (cores 16-31): the MXFP4 convergence run alone (call A's ran 4 to a GPU and was cut at step 127).
source scripts/gpu_env.sh .whlcc >/dev/null 2>/tmp/gpu_env.log || { cat /tmp/gpu_env.log; exit 1; }
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TRITON_CACHE_AUTOTUNING=1 MAMBA_DETERMINISTIC=1
O=/tmp/o; mkdir -p $O /tmp/tok; T0=$(date +%s)
t() { echo "$1 rc=$2 at $(( $(date +%s) - T0 ))s" >> $O/times.txt; tar czf $OUT/b.tgz --exclude=checkpoints -C $O .; }
left() { echo $(( ${1:-570} - ($(date +%s) - T0) )); }
xz -d -T4 -c .gpucv/text_train.bin.xz > /tmp/tok/text_train.bin && cp .gpucv/text_train.idx .gpucv/text_train.meta.json .gpucv/text_validation.* /tmp/tok/
sha256sum /tmp/tok/text_train.bin > $O/tokens.sha256; diff <(cut -d' ' -f1 $O/tokens.sha256) <(cut -d' ' -f1 .gpucv/text_train.bin.sha256) > /dev/null || { echo "token file corrupt"; exit 1; }
DATA="data.train_prefixes=[/tmp/tok/text_train] data.valid_prefixes=[/tmp/tok/text_validation] data.cache_dir=/tmp/idxcache"
COMMON="model=small $DATA data.seq_length=2048 schedule.global_batch_size=32 schedule.micro_batch_size=8 schedule.lr=2e-3 schedule.min_lr=2e-5 \
  schedule.warmup_steps=32 schedule.decay_fraction=0.2 schedule.eval_interval=32 schedule.eval_batches=8 logging.wandb=disabled logging.tensorboard=false \
  checkpoint.interval=0 checkpoint.save_at_end=false checkpoint.save_on_signal=false"
( CUDA_VISIBLE_DEVICES=1 taskset -c 16-31 python3 scripts/convergence.py --out $O/conv --steps 320 --timeout 500 --runs mxfp4 -- $COMMON > $O/conv_gpu1.log 2>&1; t conv_mxfp4 $? ) &
P1=$!
export CUDA_VISIBLE_DEVICES=0
B="taskset -c 0-15 python3 scripts/bench_train.py"
timeout 200 $B --cases small 1.2b --recipes bf16 fp8 nvfp4 --warmup 3 --iters 6 --profile $O/prof --json $O/bt.json > $O/bt.md 2>&1; t bench_train $?
timeout 70 $B --cases small --recipes nvfp4 mxfp4 --warmup 3 --iters 6 --profile $O/prof_mx --json $O/bt_mx.json > $O/bt_mx.md 2>&1; t bench_train_mx $?
timeout 120 $B --cases small --recipes bf16 fp8 nvfp4 --grad-accum 4 --cuda-graph --warmup 2 --iters 4 --json $O/bt_acc4.json > $O/bt_acc4.md 2>&1; t bench_train_acc4 $?
NVFP4_GEMM_ENGINE=triton timeout 70 $B --cases 1.2b --recipes nvfp4 --warmup 2 --iters 4 --json $O/bt_1.2b_triton.json > $O/bt_1.2b_triton.md 2>&1; t bench_train_triton_engine $?
timeout 60 taskset -c 0-15 python3 scripts/bench_linear.py --recipes bf16 fp8 nvfp4 --json $O/bl.json > $O/bench_linear.md 2>&1; t bench_linear $?
L=$(left 560); [ $L -gt 30 ] && { timeout $L taskset -c 0-15 python3 -m pytest -q -n 6 -m "triton or gpu" -p no:cacheprovider -rfEs --durations=10 tests/kernels/test_nvfp4_host_path.py tests/kernels/test_nvfp4_quantize_triton.py tests/kernels/test_nvfp4_quant_lean_gpu.py tests/precision/test_linear.py \
  > $O/tests_b.log 2>&1; t tests_b $?; }
wait $P1
cat $O/times.txt; grep -E "^\| (small|1.2b)" $O/bt.md $O/bt_mx.md $O/bt_acc4.md $O/bt_1.2b_triton.md | head -24; tail -4 $O/bench_linear.md; tail -3 $O/tests_b.log
grep -E "step (1|127|320)/" $O/conv/mxfp4/stdout.log; grep '"eval"' $O/conv/mxfp4/metrics.jsonl | tail -2
