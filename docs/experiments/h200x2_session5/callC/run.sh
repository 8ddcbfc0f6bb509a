#!/bin/bash
# session 5, call C on nvidia-h200-x2: GPU1 = the full GPU test suite (-v, default GEMM engine now cublas);
# both GPUs = layout_check on a mini Transformer (no Mamba autotuning): 1 tp2 pp2 dp2:tp2 tp2sp:pp2, nvfp4.
source scripts/gpu_env.sh .whl >/dev/null 2>/tmp/gpu_env.log || { cat /tmp/gpu_env.log; exit 1; }
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TRITON_CACHE_AUTOTUNING=1
T0=$(date +%s)
t() { echo "$1 rc=$2 at $(( $(date +%s) - T0 ))s" >> $OUT/times.txt; }
CK=/dev/shm/ck; mkdir -p $CK || CK=/tmp/ck
DATA="data.train_prefixes=[.gputmp/tokens/text_train] data.valid_prefixes=[.gputmp/tokens/text_validation] data.cache_dir=/tmp/idxcache"
R=/tmp/lay; mkdir -p $R
MINI="model=1.2b model.pattern=*-*-*-*- model.num_layers=8 model.hidden_size=1024 model.ffn_hidden_size=3072 model.num_attention_heads=8 model.num_query_groups=4 model.vocab_size=32768 $DATA data.seq_length=2048 schedule.global_batch_size=16 schedule.micro_batch_size=4 schedule.warmup_steps=2 schedule.eval_interval=0 schedule.eval_batches=1 schedule.lr=1e-3"
( CUDA_VISIBLE_DEVICES=1 MAMBA_DETERMINISTIC=1 TRITON_CACHE_DIR=/tmp/tc_test taskset -c 16-31 timeout ${SUITE_T:-415} python3 -m pytest -v -n 4 -m "triton or gpu" -p no:cacheprovider tests -rfE --tb=short --durations=15 > $OUT/test_gpu.log 2>&1; t tests $? ) &
timeout ${LC_T:-425} python3 scripts/layout_check.py --out $R/mini_nvfp4 --ckpt-root $CK/mini --run-timeout 150 --steps 10 --save-at 3 --save-at2 6 --layouts 1 tp2 pp2 dp2:tp2 tp2sp:pp2 -- $MINI precision=nvfp4 > $OUT/mini_nvfp4.md 2>&1; t mini_nvfp4 $?
tar czf $OUT/runs.tgz --exclude=checkpoints -C $R . 2>/dev/null
wait
cat $OUT/times.txt; grep -E "^layout|^\||all layouts" $OUT/mini_nvfp4.md; tail -4 $OUT/test_gpu.log; grep -E "^FAILED|^ERROR" $OUT/test_gpu.log | head -20
