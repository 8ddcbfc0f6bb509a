#!/bin/bash
# session 7, call B, nvidia-h200-x2 (~550 s): issue 8's 1.2b items. (1) 1.2b NVFP4: one-GPU reference saving at step 3
# (~17 GB checkpoint in /dev/shm), TP=2 and PP=2 resuming it at once (--concurrent), steps 4-5 compared.
# (2) 1.2b BF16 on two GPUs from scratch: one GPU, DP=2, TP=2 (6 steps each, tokens/s). (3) the GPU equivalence harness.
source scripts/gpu_env.sh .whl >/dev/null 2>/tmp/gpu_env.log || { cat /tmp/gpu_env.log; exit 1; }
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TRITON_CACHE_AUTOTUNING=1 MAMBA_DETERMINISTIC=1
O=/tmp/o; mkdir -p $O
T0=$(date +%s); t() { echo "$1 rc=$2 at $(( $(date +%s) - T0 ))s" >> $O/times.txt; tar czf $OUT/b.tgz --exclude=checkpoints -C $O .; }
left() { echo $(( ${1:-545} - ($(date +%s) - T0) )); }
CK=/dev/shm/ck; mkdir -p $CK
DATA="data.train_prefixes=[.gputmp/tokens/text_train] data.valid_prefixes=[.gputmp/tokens/text_validation] data.cache_dir=/tmp/idxcache"
BIGC="model=1.2b $DATA data.seq_length=4096 schedule.global_batch_size=8 schedule.micro_batch_size=2 schedule.warmup_steps=3 schedule.eval_interval=0 schedule.eval_batches=1 schedule.lr=3e-4"
( while sleep 20; do echo "$(( $(date +%s) - T0 ))s $(nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader | tr '\n' ' ') shm $(du -sh $CK 2>/dev/null | cut -f1)"; done > $O/mon.txt 2>&1 ) &
MON=$!
timeout 330 python3 scripts/layout_check.py --out $O/big --ckpt-root $CK/big --run-timeout 300 --concurrent --steps 5 --save-at 3 --save-at2 4 \
  --layouts 1 tp2 pp2 -- $BIGC precision=nvfp4 > $O/big_nvfp4.md 2>&1; t big_layouts $?
rm -rf $CK
BIG="$BIGC precision=bf16 schedule.train_steps=6 checkpoint.interval=0 checkpoint.save_at_end=false logging.wandb=disabled logging.tensorboard=false logging.progress=lines"
CUDA_VISIBLE_DEVICES=0 timeout $(left 420) python3 train.py $BIG experiment.run_dir=$O/bf16_1 > $O/bf16_1.log 2>&1; t bf16_1 $?
timeout $(left 480) python3 -m torch.distributed.run --standalone --nproc_per_node 2 train.py $BIG experiment.run_dir=$O/bf16_dp2 > $O/bf16_dp2.log 2>&1; t bf16_dp2 $?
timeout $(left 545) python3 -m torch.distributed.run --standalone --nproc_per_node 2 tests/models/dist_model_equivalence.py --model small --vocab 32768 --seq 512 --batch 2 --recipe nvfp4 --dtype bf16 --layout tp,tp_sp,pp --out $O/eq_nvfp4 > $O/eq_nvfp4.log 2>&1; t eq_nvfp4 $?
python3 .gputmp/eq_summary.py $O/eq_nvfp4 > $O/equivalence.txt 2>&1
kill $MON; t end 0
cat $O/times.txt; grep -E "^layout|^\||all layouts" $O/big_nvfp4.md | head; tail -3 $O/bf16_1.log $O/bf16_dp2.log; cat $O/equivalence.txt; tail -5 $O/mon.txt
