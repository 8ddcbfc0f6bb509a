#!/bin/bash
# NEXT SESSION (prepared in session 8), nvidia-h200-x2, ~560 s, carry [".whlcc", ".gpucv"] (~59 MiB with the checkout).
# (1) issue 8's last two-GPU item: 1.2b under BF16, TP=2 and PP=2 continuing a one-GPU checkpoint (--concurrent);
# (2) GPU 0: the 1.2b step as train.py runs it (--grad-accum 4) with a profile, and replayed from a CUDA graph;
#     small nvfp4 vs mxfp4 with the MXFP4 Wgrad Hadamard as a Triton kernel (session 8);
# (3) GPU 1: the GPU tests not run in session 8 (the new Hadamard kernel, MXFP4, the model on the GPU).
# Lesson of session 8: a fresh machine compiles for ~100-150 s per process; every timeout below allows for it.
source scripts/gpu_env.sh .whlcc >/dev/null 2>/tmp/gpu_env.log || { cat /tmp/gpu_env.log; exit 1; }
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TRITON_CACHE_AUTOTUNING=1 MAMBA_DETERMINISTIC=1
O=/tmp/o; mkdir -p $O /tmp/tok; T0=$(date +%s)
t() { echo "$1 rc=$2 at $(( $(date +%s) - T0 ))s" >> $O/times.txt; tar czf $OUT/s9.tgz --exclude=checkpoints --exclude='eq_*' -C $O .; }
left() { echo $(( ${1:-550} - ($(date +%s) - T0) )); }
xz -d -T8 -c .gpucv/text_train.bin.xz > /tmp/tok/text_train.bin && cp .gpucv/text_train.idx .gpucv/text_train.meta.json .gpucv/text_validation.* /tmp/tok/
DATA="data.train_prefixes=[/tmp/tok/text_train] data.valid_prefixes=[/tmp/tok/text_validation] data.cache_dir=/tmp/idxcache"
BIGC="model=1.2b $DATA data.seq_length=4096 schedule.global_batch_size=8 schedule.micro_batch_size=2 schedule.warmup_steps=3 schedule.eval_interval=0 schedule.eval_batches=1 schedule.lr=3e-4"
timeout 250 python3 scripts/layout_check.py --out $O/big_bf16 --ckpt-root /dev/shm/ck --run-timeout 230 --concurrent --steps 5 --save-at 3 --save-at2 4 \
  --layouts 1 tp2 pp2 -- $BIGC precision=bf16 > $O/big_bf16.md 2>&1; t big_bf16 $?
rm -rf /dev/shm/ck
( export CUDA_VISIBLE_DEVICES=1; timeout $(left 540) taskset -c 16-31 python3 -m pytest -q -n 8 -m "triton or gpu" -p no:cacheprovider -rfEs --durations=10 \
   tests/kernels/test_hadamard_triton.py tests/kernels/test_mxfp4.py tests/kernels/test_mxfp4_gemm.py tests/models/test_model_gpu.py \
   > $O/tests.log 2>&1; t tests $? ) &
P1=$!
export CUDA_VISIBLE_DEVICES=0
B="taskset -c 0-15 python3 scripts/bench_train.py"
timeout 150 $B --cases 1.2b --recipes bf16 fp8 nvfp4 --grad-accum 4 --warmup 1 --iters 3 --profile $O/prof --json $O/bt_1.2b_acc4.json > $O/bt_1.2b_acc4.md 2>&1; t bt_1.2b_acc4 $?
for r in bf16 nvfp4; do timeout 45 $B --cases 1.2b --recipes $r --grad-accum 4 --cuda-graph --warmup 1 --iters 3 --json $O/g_1.2b_$r.json > $O/g_1.2b_$r.md 2>&1; t g_1.2b_$r $?; done
L=$(left); [ $L -gt 20 ] && { timeout $L $B --cases small --recipes nvfp4 mxfp4 --grad-accum 4 --warmup 1 --iters 3 --profile $O/prof_mx --json $O/bt_mx.json > $O/bt_mx.md 2>&1; t bt_mx $?; }
wait $P1
cat $O/times.txt; grep -E "^layout|^\||all layouts" $O/big_bf16.md | head; grep -E "^\| (small|1.2b)" $O/bt_1.2b_acc4.md $O/g_1.2b_*.md $O/bt_mx.md | head -20; tail -3 $O/tests.log
