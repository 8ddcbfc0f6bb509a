#!/usr/bin/env bash
# One wave of the `10m` convergence runs (docs/experiments.md) on a fresh offline GPU machine, from a checkout:
#
#     scripts/convergence_wave.sh OUT WHEEL_DIR TEXT_TOKENS SEED...
#
#   OUT          folder for what the wave reports: runs.tgz (each run's command, config, metrics.jsonl, stdout),
#                the machine corpus's MANIFEST.json, the logs, GPU and host samples
#   WHEEL_DIR    the wheelhouse for scripts/gpu_env.sh (scripts/wheelhouse.sh --minimal)
#   TEXT_TOKENS  the default corpus's token files as a .tar.xz (data/tokens/text_{train,validation}.{bin,idx,meta.json})
#   SEED...      experiment.seed of each repeat (data.seed stays 1234)
#
# Environment: RUNS (recipes, default all nine of scripts/convergence.py), LIMIT (seconds the whole script may take,
# default 585), RESERVE (seconds kept for archiving, default 20).
#
# Order matters: the machine's own corpus is collected BEFORE anything is installed into the interpreter's
# environment (scripts/build_env_corpus.py --stage collect), then the wheels, then tokenization (which needs
# megatron-core). Runs still alive 12 s before the limit get SIGABRT: with PYTHONFAULTHANDLER=1 their stack is
# dumped into their stdout.log, so a hang says where it is.
set -u
if [[ $# -lt 4 ]]; then
  echo "usage: $0 OUT WHEEL_DIR TEXT_TOKENS SEED..." >&2
  exit 2
fi
T0=$(date +%s)
OUT=$(mkdir -p "$1" && cd "$1" && pwd); WHEELS=$2; TEXT=$3; shift 3
cd "$(dirname "$0")/.." || exit 1
mkdir -p data/tokens "$OUT"

python3 -c "import tarfile, sys; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter='data')" "$TEXT" data/tokens \
  || { echo "convergence_wave: error: cannot extract $TEXT into data/tokens" >&2; exit 1; }
# A machine kept from an earlier wave already holds the corpus, and its environment no longer is the bare image
# (the wheels and the editable install are in it): reuse the corpus, checked against its manifest, never re-collect.
REUSE=0
[[ -f data/env_corpus/MANIFEST.json && -f data/tokens/env_train.bin && -f data/tokens/env_validation.bin ]] && REUSE=1
if (( ! REUSE )); then
  python3 scripts/build_env_corpus.py --jobs "$(nproc)" --stage collect >"$OUT/env_corpus.log" 2>&1 \
    || { tail -5 "$OUT/env_corpus.log"; exit 1; }
fi
# shellcheck source=scripts/gpu_env.sh
source scripts/gpu_env.sh "$WHEELS" >"$OUT/gpu_env.log" 2>&1 || { tail -5 "$OUT/gpu_env.log"; exit 1; }
if (( REUSE )); then
  python3 scripts/build_env_corpus.py --verify >"$OUT/env_corpus.log" 2>&1 \
    || { tail -5 "$OUT/env_corpus.log"; echo "convergence_wave: error: the corpus kept on this machine does not match its manifest: remove data/env_corpus and data/tokens/env_* on a fresh machine" >&2; exit 1; }
  echo "[env_corpus] reused the corpus already on this machine (verified against its manifest)" >>"$OUT/env_corpus.log"
else
  python3 scripts/build_env_corpus.py --jobs "$(nproc)" --stage tokenize >>"$OUT/env_corpus.log" 2>&1 \
    || { tail -5 "$OUT/env_corpus.log"; exit 1; }
fi
cp data/env_corpus/MANIFEST.json "$OUT/env_corpus_MANIFEST.json"
grep '^\[env_corpus\]' "$OUT/env_corpus.log"

export MAMBA_DETERMINISTIC=1 PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=1 PYTHONFAULTHANDLER=1
nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv -l 5 >"$OUT/smi.csv" 2>&1 &
SMI=$!
(while true; do echo "$(date +%T) $(free -g | awk 'NR==2{print $3" GiB used, "$7" GiB available"}') $(uptime | sed 's/.*load/load/')"; sleep 10; done) >"$OUT/host.log" 2>&1 &
HOST=$!
TO=$(( ${LIMIT:-585} - ($(date +%s) - T0) - ${RESERVE:-20} ))
echo "convergence_wave: setup $(( $(date +%s) - T0 ))s; the runs get ${TO}s"
if (( TO < 60 )); then
  echo "convergence_wave: error: ${TO}s left for the runs: raise LIMIT" >&2
  kill "$SMI" "$HOST" 2>/dev/null
  exit 1
fi
RUN_DIR=$(mktemp -d /tmp/conv.XXXXXX)
# The runs are children of convergence.py, started in a session of its own: the watcher signals that process
# group only (pgid = its pid), and its own stdio is detached so an early end does not wait for its sleep.
# shellcheck disable=SC2086
setsid python3 scripts/convergence.py --out "$RUN_DIR" --steps 625 --timeout "$TO" \
  --runs ${RUNS:-bf16 fp8 nvfp4 nvfp4_no_rht nvfp4_no_sr nvfp4_1d nvfp4_all_blocks mxfp4 nvfp4_to_bf16} \
  --seeds "$@" --data-seed 1234 -- model=10m data=env_blend schedule=conv_10m logging.wandb=disabled \
  logging.tensorboard=false checkpoint.interval=0 checkpoint.save_at_end=true checkpoint.save_on_signal=false \
  >"$OUT/convergence.log" 2>&1 &
CONV=$!
(sleep $(( TO - 12 )); ps -o pid=,args= -g "$CONV" | grep "/train.py" >"$OUT/alive_at_limit.txt" \
  && pkill -ABRT -g "$CONV" -f "/train.py") </dev/null >/dev/null 2>&1 &
WATCH=$!
wait "$CONV"
pkill -P "$WATCH" 2>/dev/null
kill "$SMI" "$HOST" "$WATCH" 2>/dev/null
mkdir -p "$OUT/runs"
for d in "$RUN_DIR"/*/; do
  n=$(basename "$d")
  [[ $# -eq 1 ]] && n=${n}_s$1  # one seed: convergence.py names the runs without it
  mkdir -p "$OUT/runs/$n"
  cp "$d"/metrics.jsonl "$d"/config.yaml "$d"/command.txt "$d"/stdout.log "$OUT/runs/$n/" 2>/dev/null
done
tar -C "$OUT" -czf "$OUT/runs.tgz" runs && rm -rf "$OUT/runs"
echo "convergence_wave: checkpoints of the runs are under $RUN_DIR"
grep -v '^/' "$OUT/convergence.log" | tail -22
echo "convergence_wave: done in $(( $(date +%s) - T0 ))s"
