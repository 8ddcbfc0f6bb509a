#!/bin/bash
# session 7, call A, nvidia-h200-x2 (~580 s). Background (cores 24-31, nice 19): build causal-conv1d for sm_90 from the
# carried sdist. Foreground (cores 0-23): issue 8 small NVFP4 layouts 1 tp2 pp2 dp2 tp2sp:pp2 with --prewarm.
# Then, with the conv wheel installed: its GPU test (GPU1) and bench_train small bf16/fp8/nvfp4 (GPU0).
source scripts/gpu_env.sh .whl >/dev/null 2>/tmp/gpu_env.log || { cat /tmp/gpu_env.log; exit 1; }
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TRITON_CACHE_AUTOTUNING=1 MAMBA_DETERMINISTIC=1
O=/tmp/o; mkdir -p $O
T0=$(date +%s); t() { echo "$1 rc=$2 at $(( $(date +%s) - T0 ))s" >> $O/times.txt; tar czf $OUT/a.tgz --exclude=checkpoints -C $O .; }
left() { echo $(( ${1:-575} - ($(date +%s) - T0) )); }
nproc > $O/nproc.txt; nvidia-smi topo -m >> $O/nproc.txt 2>&1
( MAX_JOBS=8 taskset -c 24-31 nice -n 19 timeout 480 bash scripts/wheelhouse.sh --only-causal-conv1d --out /tmp/ccwhl \
    --sdist .gputmp/causal_conv1d-1.7.0.tar.gz --cuda-arch 90 --build-python python3 > $O/cc_build.log 2>&1
  echo "build rc=$? at $(( $(date +%s) - T0 ))s" >> $O/cc_build.log; ls -la /tmp/ccwhl >> $O/cc_build.log
  w=$(ls /tmp/ccwhl/causal_conv1d-*.whl 2>/dev/null | head -1)
  [ -n "$w" ] && { sha256sum $w > $OUT/ccwhl.sha256; basename $w > $OUT/ccwhl.name; split -b 15M -d $w $OUT/ccwhl.part; } ) &
CK=/dev/shm/ck; mkdir -p $CK
DATA="data.train_prefixes=[.gputmp/tokens/text_train] data.valid_prefixes=[.gputmp/tokens/text_validation] data.cache_dir=/tmp/idxcache"
SMALL="model=small $DATA data.seq_length=2048 schedule.global_batch_size=32 schedule.micro_batch_size=8 schedule.warmup_steps=3 schedule.eval_interval=0 schedule.eval_batches=1 schedule.lr=1e-3"
taskset -c 0-23 timeout 420 python3 scripts/layout_check.py --out $O/lay --ckpt-root $CK/small --run-timeout 400 --prewarm --steps 12 --save-at 4 --save-at2 8 \
  --layouts 1 tp2 pp2 dp2 tp2sp:pp2 -- $SMALL precision=nvfp4 > $O/small_nvfp4.md 2>&1; t small_layouts $?
rm -rf $CK
wait
w=$(ls /tmp/ccwhl/causal_conv1d-*.whl 2>/dev/null | head -1)
if [ -n "$w" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $w > $O/cc_install.log 2>&1; t cc_install $?
  python3 -c "import causal_conv1d, causal_conv1d_cuda; print(causal_conv1d.__version__)" >> $O/cc_install.log 2>&1
  ( CUDA_VISIBLE_DEVICES=1 timeout $(left 560) python3 -m pytest -q -m gpu -rfEs tests/models/mamba tests/models/test_norm.py tests/models/test_model_gpu.py > $O/tests_cc.log 2>&1; t tests_cc $? ) &
  CUDA_VISIBLE_DEVICES=0 taskset -c 0-15 timeout $(left 565) python3 scripts/bench_train.py --cases small --recipes bf16 fp8 nvfp4 --warmup 3 --iters 6 --json $O/bt_small_cc.json > $O/bt_small_cc.md 2>&1; t bt_small_cc $?
  wait
fi
cat $O/times.txt; tail -5 $O/cc_build.log; grep -E "^layout|^prewarm|^\||all layouts" $O/small_nvfp4.md | head -30; tail -4 $O/tests_cc.log; grep -E "^\| small" $O/bt_small_cc.md
