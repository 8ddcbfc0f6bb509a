#!/bin/bash
# Session 9, call C (nvidia-h200-x2, carry [".whlcc", ".gpucv"]): seeds 1237 and 1238 of run 3 (call B ran 1235 and 1236).
# bf16, nvfp4, nvfp4_no_rht, nvfp4_no_sr with seeds 1235 and 1236 (run 3 has 1234), same data order (data.seed 1234), same config as run 3.
# 4 + 4 runs on the two GPUs, one epoch each (320 x 32 x 2048 tokens). Then copy run 3's seed-1234 runs
# (docs/experiments/h200x2_session8/conv/<run>) next to them and run convergence.py --summarize on the folder.
source scripts/gpu_env.sh .whlcc >/dev/null 2>/tmp/gpu_env.log || { cat /tmp/gpu_env.log; exit 1; }
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TRITON_CACHE_AUTOTUNING=1 MAMBA_DETERMINISTIC=1
O=/tmp/o; mkdir -p $O /tmp/tok; T0=$(date +%s)
xz -d -T4 -c .gpucv/text_train.bin.xz > /tmp/tok/text_train.bin && cp .gpucv/text_train.idx .gpucv/text_train.meta.json .gpucv/text_validation.* /tmp/tok/
sha256sum /tmp/tok/text_train.bin > $O/tokens.sha256; diff <(cut -d' ' -f1 $O/tokens.sha256) <(cut -d' ' -f1 .gpucv/text_train.bin.sha256) > /dev/null || { echo "token file corrupt"; exit 1; }
DATA="data.train_prefixes=[/tmp/tok/text_train] data.valid_prefixes=[/tmp/tok/text_validation] data.cache_dir=/tmp/idxcache"
COMMON="model=small $DATA data.seq_length=2048 schedule.global_batch_size=32 schedule.micro_batch_size=8 schedule.lr=2e-3 schedule.min_lr=2e-5 \
  schedule.warmup_steps=32 schedule.decay_fraction=0.2 schedule.eval_interval=32 schedule.eval_batches=8 logging.wandb=disabled logging.tensorboard=false \
  checkpoint.interval=0 checkpoint.save_at_end=false checkpoint.save_on_signal=false"
( CUDA_VISIBLE_DEVICES=0 taskset -c 0-15 python3 scripts/convergence.py --out $O/conv --steps 320 --timeout 550 --runs bf16 nvfp4_no_rht --seeds 1237 1238 --data-seed 1234 -- $COMMON > $O/conv_gpu0.log 2>&1 ) &
P1=$!
( CUDA_VISIBLE_DEVICES=1 taskset -c 16-31 python3 scripts/convergence.py --out $O/conv --steps 320 --timeout 550 --runs nvfp4 nvfp4_no_sr --seeds 1237 1238 --data-seed 1234 -- $COMMON > $O/conv_gpu1.log 2>&1 ) &
P2=$!
( while sleep 30; do echo "$(( $(date +%s) - T0 ))s $(nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader | tr '\n' ' ')"; \
    tar czf $OUT/conv.tgz --exclude=checkpoints -C $O . ; done > $O/mon.txt 2>&1 ) &
MON=$!
wait $P1 $P2; kill $MON; tar czf $OUT/conv.tgz --exclude=checkpoints -C $O .
for d in $O/conv/*/; do echo "$(basename $d): $(grep -c '"type": "train"' $d/metrics.jsonl 2>/dev/null) train records; $(grep '"type": "eval"' $d/metrics.jsonl 2>/dev/null | tail -n 1 | cut -c1-160)"; done
tail -n 3 $O/conv_gpu0.log $O/conv_gpu1.log
python3 scripts/convergence.py --summarize $O/conv
