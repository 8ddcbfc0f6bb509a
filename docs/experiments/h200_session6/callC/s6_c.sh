#!/bin/bash
# session 6, call C on nvidia-h200 (1 GPU): the whole GPU suite with the final code (grouped_lean default, pair
# dequant, fused alpha) on cores 2-15; beside it a small nvfp4 bench_train on cores 0-1 that py-spy samples in its
# steady state (from 255 s: the first steps compile and autotune), for where the host time of a step goes.
source scripts/gpu_env.sh .whl >/dev/null 2>/tmp/gpu_env.log || { cat /tmp/gpu_env.log; exit 1; }
export PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=1 MAMBA_DETERMINISTIC=1
O=/tmp/o; mkdir -p $O
T0=$(date +%s); t() { echo "$1 rc=$2 at $(( $(date +%s) - T0 ))s" >> $O/times.txt; tar czf $OUT/c.tgz -C $O .; }
left() { echo $(( ${1:-575} - ($(date +%s) - T0) )); }
( TRITON_CACHE_DIR=/tmp/tc_test taskset -c 2-15 timeout 560 python3 -m pytest -v -n 6 -m "triton or gpu" -p no:cacheprovider tests -rfE --tb=short --durations=15 > $O/test_gpu.log 2>&1; t tests $? ) &
pip install -q --no-index --target /tmp/pyspy .gputmp/py_spy-*.whl > $O/pyspy.log 2>&1
PS=/tmp/pyspy/bin/py-spy
TRITON_CACHE_DIR=/tmp/tc_bt taskset -c 0-1 python3 scripts/bench_train.py --cases small --recipes nvfp4 --warmup 3 --iters 3000 > $O/bt_spy.md 2>&1 &
P=$!; sleep 255
timeout 60 $PS record --pid $P --duration 25 --rate 250 --format raw --output $O/pyspy_nvfp4.txt >> $O/pyspy.log 2>&1; t pyspy $?
kill $P 2>/dev/null; wait $P 2>/dev/null
wait
cat $O/times.txt; tail -4 $O/test_gpu.log; grep -E "^FAILED|^ERROR" $O/test_gpu.log | head -30; tail -2 $O/pyspy.log
