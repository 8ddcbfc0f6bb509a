#!/bin/bash
# session 6, call B on nvidia-h200 (1 GPU): (1) bench_train small with --profile (GPU busy / idle, kernels by
# category); (2) py-spy on a steady-state small nvfp4 run (where the host time goes); (3) GPU tests that decide:
# the quantizer files under the lean design, the pair dequant, the fused alpha, the GEMM files.
source scripts/gpu_env.sh .whl >/dev/null 2>/tmp/gpu_env.log || { cat /tmp/gpu_env.log; exit 1; }
export PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=1 MAMBA_DETERMINISTIC=1
O=/tmp/o; mkdir -p $O
T0=$(date +%s); t() { echo "$1 rc=$2 at $(( $(date +%s) - T0 ))s" >> $O/times.txt; tar czf $OUT/b.tgz -C $O .; }
left() { echo $(( ${1:-575} - ($(date +%s) - T0) )); }
(lscpu | head -20; nproc; python3 -c "import time,torch; x=torch.empty(8,device='cuda'); torch.cuda.synchronize(); t=time.perf_counter(); [x.add_(1) for _ in range(20000)]; torch.cuda.synchronize(); print('add_ launch us', (time.perf_counter()-t)/20000*1e6)") > $O/host.txt 2>&1
timeout 200 python3 scripts/bench_train.py --cases small --recipes bf16 fp8 nvfp4 --warmup 3 --iters 6 --profile $O/prof --json $O/bt_prof.json > $O/bench_train_prof.md 2>&1; t bench_train_prof $?
pip install -q --no-index --target /tmp/pyspy .gputmp/py_spy-*.whl > $O/pyspy_install.txt 2>&1
PS=$(ls /tmp/pyspy/bin/py-spy 2>/dev/null || echo /tmp/pyspy/py_spy*/py-spy)
python3 scripts/bench_train.py --cases small --recipes nvfp4 --warmup 3 --iters 400 > $O/bt_spy.md 2>&1 &
P=$!; sleep 60
timeout 40 $PS record --pid $P --duration 20 --rate 200 --format raw --output $O/pyspy_nvfp4.txt >> $O/pyspy_install.txt 2>&1; t pyspy $?
kill $P 2>/dev/null; wait $P 2>/dev/null
export NVFP4_QUANTIZE_DESIGN=grouped_lean
timeout $(left 570) python3 -m pytest -v -n 6 -m "triton or gpu" -p no:cacheprovider tests/kernels tests/models/test_model_gpu.py -rfE --tb=short --durations=10 > $O/test_kernels_lean.log 2>&1; t tests_lean $?
cat $O/times.txt; cat $O/host.txt | tail -3; grep -E "^\|" $O/bench_train_prof.md | head -60; tail -4 $O/test_kernels_lean.log; grep -E "^FAILED|^ERROR" $O/test_kernels_lean.log | head -20; tail -3 $O/pyspy_install.txt
