#!/bin/bash
# session 7, call C, nvidia-h200-x2 (~560 s), causal-conv1d 1.7.0 (sm_90, built in call A) installed with the wheelhouse.
# Phase 1: GPU0 bench_train small bf16/fp8/nvfp4 --profile --sync-debug (cores 0-11); GPU1 the gpu tests of the model, norm,
#   telemetry (cores 12-23), then py-spy of a steady small bf16 and nvfp4 step loop on GPU1 (cores 24-25).
# Phase 2: GPU0 bench_train 1.2b + slice12b with this session's code. Phase 3: the equivalence harness, bf16 recipe, fp32.
source scripts/gpu_env.sh .whlcc >/dev/null 2>/tmp/gpu_env.log || { cat /tmp/gpu_env.log; exit 1; }
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TRITON_CACHE_AUTOTUNING=1 MAMBA_DETERMINISTIC=1
O=/tmp/o; mkdir -p $O
T0=$(date +%s); t() { echo "$1 rc=$2 at $(( $(date +%s) - T0 ))s" >> $O/times.txt; tar czf $OUT/c.tgz --exclude=checkpoints --exclude='eq_*/ckpt*' -C $O .; }
left() { echo $(( ${1:-560} - ($(date +%s) - T0) )); }
python3 -c "import causal_conv1d_cuda, causal_conv1d; print('causal-conv1d', causal_conv1d.__version__)" > $O/cc.txt 2>&1
pip install -q --no-index --target /tmp/pyspy .gpus7/py_spy-*.whl > $O/pyspy.log 2>&1; PS=/tmp/pyspy/bin/py-spy
spy() { # recipe cores: a steady small step loop on GPU1, sampled for 20 s after 50 s
  CUDA_VISIBLE_DEVICES=1 taskset -c $2 python3 scripts/bench_train.py --cases small --recipes $1 --warmup 3 --iters 3000 > $O/spy_$1.md 2>&1 &
  local P=$!; sleep 50; timeout 40 $PS record --pid $P --duration 20 --rate 250 --format raw --output $O/pyspy_$1.txt >> $O/pyspy.log 2>&1
  t spy_$1 $?; kill $P; wait $P 2>/dev/null; gzip -f $O/pyspy_$1.txt; }
( CUDA_VISIBLE_DEVICES=1 taskset -c 12-23 timeout 170 python3 -m pytest -v -m gpu -p no:cacheprovider -rfEs --tb=short --durations=8 \
    tests/models tests/precision/test_telemetry.py > $O/tests.log 2>&1; t tests $?
  spy bf16 24-25; spy nvfp4 24-25 ) &
CUDA_VISIBLE_DEVICES=0 taskset -c 0-11 timeout 250 python3 scripts/bench_train.py --cases small --recipes bf16 fp8 nvfp4 --warmup 3 --iters 6 \
  --profile $O/prof --sync-debug --json $O/bt_small.json > $O/bt_small.md 2>&1; t bt_small $?
CUDA_VISIBLE_DEVICES=0 taskset -c 0-11 timeout $(left 440) python3 scripts/bench_train.py --cases 1.2b slice12b --recipes bf16 fp8 nvfp4 --warmup 2 --iters 5 \
  --json $O/bt.json > $O/bench_train.md 2>&1; t bench_train $?
wait
timeout $(left 555) python3 -m torch.distributed.run --standalone --nproc_per_node 2 tests/models/dist_model_equivalence.py --model small --vocab 32768 --seq 512 --batch 2 --recipe bf16 --dtype fp32 --layout tp,tp_sp,pp --out $O/eq_bf16 > $O/eq_bf16.log 2>&1; t eq_bf16 $?
python3 .gpus7/eq_summary.py $O/eq_bf16 > $O/equivalence.txt 2>&1; t end 0
cat $O/times.txt $O/cc.txt; tail -3 $O/tests.log; grep -E "^\| (small|1.2b|slice)" $O/bt_small.md $O/bench_train.md; grep -A12 -i "sync-debug" $O/bt_small.md | head -40; cat $O/equivalence.txt
