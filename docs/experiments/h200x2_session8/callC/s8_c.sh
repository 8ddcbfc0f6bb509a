#!/bin/bash
# session 8 call C, nvidia-h200-x2, carry [".whlcc", ".gpucv"]:
# GPU 0 (cores 0-15): small --grad-accum 4 eager (bf16 fp8 nvfp4), then the CUDA-graph retry (one side stream), a process per recipe;
# GPU 1 (cores 16-31): the GPU tests not run since session 6's changes (norm, mamba ops, telemetry, the rest of kernels/precision);
# then both: small BF16 layouts 1 and dp2 (issue 8), --prewarm.
source scripts/gpu_env.sh .whlcc >/dev/null 2>/tmp/gpu_env.log || { cat /tmp/gpu_env.log; exit 1; }
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TRITON_CACHE_AUTOTUNING=1 MAMBA_DETERMINISTIC=1
O=/tmp/o; mkdir -p $O /tmp/tok; T0=$(date +%s)
t() { echo "$1 rc=$2 at $(( $(date +%s) - T0 ))s" >> $O/times.txt; tar czf $OUT/c.tgz --exclude=checkpoints --exclude='ck*' -C $O .; }
left() { echo $(( ${1:-545} - ($(date +%s) - T0) )); }
( xz -d -T4 -c .gpucv/text_train.bin.xz > /tmp/tok/text_train.bin && cp .gpucv/text_train.idx .gpucv/text_train.meta.json .gpucv/text_validation.* /tmp/tok/ ) &
XZ=$!
( export CUDA_VISIBLE_DEVICES=1; timeout 240 taskset -c 16-31 python3 -m pytest -q -n 8 -m "triton or gpu" -p no:cacheprovider -rfEs --durations=10 \
   tests/models/test_norm.py tests/models/mamba/test_mamba_ops.py tests/precision tests/kernels \
   --deselect tests/kernels/test_nvfp4_quant_lean_gpu.py --deselect tests/kernels/test_nvfp4_host_path.py --deselect tests/kernels/test_nvfp4_quantize_triton.py \
   > $O/tests_c.log 2>&1; t tests_c $? ) &
P1=$!
export CUDA_VISIBLE_DEVICES=0
B="taskset -c 0-15 python3 scripts/bench_train.py"
timeout 110 $B --cases small --recipes bf16 fp8 nvfp4 --grad-accum 4 --warmup 2 --iters 4 --json $O/bt_acc4.json > $O/bt_acc4.md 2>&1; t bench_train_acc4 $?
for r in bf16 nvfp4; do timeout 60 $B --cases small --recipes $r --grad-accum 4 --cuda-graph --warmup 2 --iters 4 --json $O/bt_graph_$r.json > $O/bt_graph_$r.md 2>&1; t graph_$r $?; done
wait $P1 $XZ
unset CUDA_VISIBLE_DEVICES
DATA="data.train_prefixes=[/tmp/tok/text_train] data.valid_prefixes=[/tmp/tok/text_validation] data.cache_dir=/tmp/idxcache"
SMALL="model=small $DATA data.seq_length=2048 schedule.global_batch_size=32 schedule.micro_batch_size=8 schedule.warmup_steps=3 schedule.eval_interval=0 schedule.eval_batches=1 schedule.lr=1e-3"
L=$(left); timeout $L python3 scripts/layout_check.py --out $O/small_bf16 --ckpt-root /dev/shm/ck --run-timeout $((L-20)) --prewarm --steps 10 --save-at 4 --save-at2 8 \
  --layouts 1 dp2 -- $SMALL precision=bf16 > $O/small_bf16.md 2>&1; t small_bf16 $?
cat $O/times.txt; grep -E "^\| small" $O/bt_acc4.md $O/bt_graph_*.md | head; grep -E "^layout|^\||all layouts" $O/small_bf16.md | head -20; tail -3 $O/tests_c.log
