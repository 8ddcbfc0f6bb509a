#!/bin/bash
# session 5, call A on nvidia-h200-x2 (issue 8): small model, layouts 1 tp2 pp2 dp2:tp2, nvfp4 + bf16.
# Phase 1: both recipes --concurrent (losses checked, caches warmed in parallel). Phase 2: sequential (throughput).
source scripts/gpu_env.sh .whl >/dev/null 2>/tmp/gpu_env.log || { cat /tmp/gpu_env.log; exit 1; }
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TRITON_CACHE_AUTOTUNING=1
T0=$(date +%s)
t() { echo "$1 rc=$2 at $(( $(date +%s) - T0 ))s" >> $OUT/times.txt; }
python3 -m pip install -q --no-index --target /tmp/pyspy .gputmp/py_spy-*.whl >/dev/null 2>&1
( sleep ${DUMP_AT:-275}; for p in $(pgrep -f "train.py"); do echo "== $p $(tr '\0' ' ' < /proc/$p/cmdline | cut -c1-220)"; /tmp/pyspy/bin/py-spy dump --pid $p 2>&1 | head -40; done > $OUT/stacks.txt ) &
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
L="--steps 12 --save-at 4 --save-at2 8 --layouts 1 tp2 pp2 dp2:tp2"
lc conc_nvfp4 300 $L --concurrent -- $SMALL precision=nvfp4 &
sleep 20; lc conc_bf16 280 $L --concurrent -- $SMALL precision=bf16 &
wait
left=$(( 565 - ($(date +%s) - T0) ))
[ $left -gt 60 ] && lc seq_nvfp4 $(( left * 6 / 10 )) $L -- $SMALL precision=nvfp4
left=$(( 570 - ($(date +%s) - T0) ))
[ $left -gt 45 ] && lc seq_bf16 $left $L -- $SMALL precision=bf16
cat $OUT/times.txt; for f in $OUT/*.md; do echo "== $f"; grep -E "^layout|^\||all layouts|not a throughput" $f; done
