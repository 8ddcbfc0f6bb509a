#!/usr/bin/env bash
# Build an offline wheelhouse of this project's Python dependencies for another interpreter and platform, so that
# an air-gapped GPU machine installs with `pip install --no-index --no-deps --find-links DIR -r DIR/requirements.txt`
# (or `source scripts/gpu_env.sh DIR` on our H200 machine). docs/wheelhouse.md explains it; --help lists options.
#
# What it does, in order:
#   1. builds here what PyPI has only as sdists: mamba-ssm as a pure-Python wheel (no CUDA ops; Mamba-2 needs
#      none), sdist-only pure-Python dependencies (antlr4-python3-runtime 4.9.3 for hydra-core), and with
#      --with-causal-conv1d the CUDA extension causal-conv1d (needs a CUDA torch and nvcc, ~12 min; from a local
#      sdist with --sdist, for some GPU architectures only with --cuda-arch; alone with --only-causal-conv1d);
#   2. resolves the dependency closure of pyproject.toml ([project.dependencies] + the `gpu` extra) for the TARGET
#      (pip's resolver with --python-version/--platform/--implementation cp/--only-binary=:all:), leaving out
#      torch/triton/nvidia-*/cuda-* (the cluster has its own CUDA torch) and, with --minimal or --skip-present,
#      whatever the target already has;
#   3. downloads exactly that set (`pip download --no-deps`), copies it into --out (replacing the *.whl there),
#      writes --out/requirements.txt, and checks every wheel installs on the target (tags, one version per name).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
HELPER="$REPO/nvfp4_train/wheelhouse.py"

usage() {
  cat <<'EOF'
usage: scripts/wheelhouse.sh [options]
  --python X.Y[.Z]       target CPython version (default 3.12)
  --platform TAG         target platform tag, repeatable (default manylinux_2_28_x86_64); manylinux_2_N is
                         expanded to every manylinux_2_M with M <= N and the legacy manylinux2014/2010/1 aliases
  --out DIR              where the wheels go (default wheelhouse/); its old *.whl files are replaced
  --minimal              leave out what our H200 image already has (the image's package list, built into
                         nvfp4_train/wheelhouse.py with the versions known) -> a small folder to copy
  --skip-present FILE    leave out what FILE lists: the target's `python3 -m pip list --format=freeze` (exact:
                         resolves against those versions) or bare names (assumed compatible); repeatable
  --carry NAME           carry NAME although the skip list says the target has it (e.g. when
                         scripts/gpu_env.sh warns that the target's version is too old); repeatable
  --with-torch           also carry torch, triton, nvidia-*, cuda-* (default: never, the cluster has its own)
  --with-mamba3          also carry tilelang, apache-tvm-ffi, quack-kernels (mamba-ssm requires them, only its
                         Mamba-3 modules import them, inside try/except)
  --with-causal-conv1d   build causal-conv1d==<pyproject pin> as a CUDA extension (needs --build-python with
                         Python X.Y and a CUDA torch of the cluster's version, and nvcc; ~12 min). A wheel of it
                         already in --out is reused.
  --sdist FILE           build causal-conv1d from this local sdist (causal_conv1d-<pin>.tar.gz) instead of
                         downloading it: for a GPU machine without internet (docs/wheelhouse.md says how to get it)
  --cuda-arch LIST       build causal-conv1d for these GPU architectures only, comma-separated compute
                         capabilities without the dot (90 = sm_90, the H200; 90,100): rewrites its setup.py in the
                         unpacked sdist; the wheel's version gets a local label (1.7.0+sm90). Default: its own 9
  --only-causal-conv1d   build just the causal-conv1d wheel (implies --with-causal-conv1d) into --out, replacing
                         a causal_conv1d wheel there and its requirements.txt line; nothing else is built,
                         resolved or downloaded (with --sdist: no network at all)
  --build-python PY      interpreter that builds the sdists and runs pip (default .venv/bin/python, else python3);
                         it needs torch (any build; CUDA for causal-conv1d), setuptools and packaging
  --torch-version V      the cluster's torch, resolved against but not carried (default: from the skip list,
                         else the build interpreter's torch)
  --triton-version V     likewise for triton
  --keep-work            keep the temporary work folder (printed) for inspection
EOF
}

PYVER=3.12
PLATFORMS=()
OUT=wheelhouse
SKIP_ARGS=()
MINIMAL=0
WITH_CC=0
WITH_TORCH=0
WITH_MAMBA3=0
BUILD_PY=""
TORCH_VERSION=""
TRITON_VERSION=""
KEEP=0
SDIST=""
CUDA_ARCH=""
ONLY_CC=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --python) PYVER=${2:?}; shift 2 ;;
    --platform) PLATFORMS+=("${2:?}"); shift 2 ;;
    --out) OUT=${2:?}; shift 2 ;;
    --minimal) MINIMAL=1; shift ;;
    --skip-present)
      [[ -f ${2:?} ]] || { echo "wheelhouse: error: --skip-present $2: no such file" >&2; exit 2; }
      SKIP_ARGS+=(--skip-present "$(cd "$(dirname "$2")" && pwd)/$(basename "$2")"); shift 2 ;;
    --carry) SKIP_ARGS+=(--carry "${2:?}"); shift 2 ;;
    --with-causal-conv1d) WITH_CC=1; shift ;;
    --sdist)
      [[ -f ${2:?} ]] || { echo "wheelhouse: error: --sdist $2: no such file" >&2; exit 2; }
      SDIST="$(cd "$(dirname "$2")" && pwd)/$(basename "$2")"; shift 2 ;;
    --cuda-arch) CUDA_ARCH=${2:?}; shift 2 ;;
    --only-causal-conv1d) ONLY_CC=1; WITH_CC=1; shift ;;
    --with-torch) WITH_TORCH=1; shift ;;
    --with-mamba3) WITH_MAMBA3=1; shift ;;
    --build-python) BUILD_PY=${2:?}; shift 2 ;;
    --torch-version) TORCH_VERSION=${2:?}; shift 2 ;;
    --triton-version) TRITON_VERSION=${2:?}; shift 2 ;;
    --keep-work) KEEP=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "wheelhouse: error: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
  esac
done
[[ ${#PLATFORMS[@]} -gt 0 ]] || PLATFORMS=(manylinux_2_28_x86_64)
if [[ -z $BUILD_PY ]]; then
  if [[ -x $REPO/.venv/bin/python ]]; then BUILD_PY=$REPO/.venv/bin/python; else BUILD_PY=$(command -v python3); fi
fi
command -v "$BUILD_PY" >/dev/null || { echo "wheelhouse: error: build interpreter '$BUILD_PY' not found" >&2; exit 2; }
if [[ $WITH_CC == 0 && ( -n $SDIST || -n $CUDA_ARCH ) ]]; then
  echo "wheelhouse: error: --sdist and --cuda-arch apply to causal-conv1d: add --with-causal-conv1d (or --only-causal-conv1d)" >&2
  exit 2
fi

die() { echo "wheelhouse: error: $*" >&2; exit 1; }
say() { echo "== $*" >&2; }
helper() { "$BUILD_PY" "$HELPER" "$@"; }
# pip, minus the warnings about this machine's absent local mirrors; keeps pip's exit status.
pipq() { "$BUILD_PY" -m pip "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }; return "${PIPESTATUS[0]}"; }

WORK=$(mktemp -d "${TMPDIR:-/tmp}/wheelhouse.XXXXXX")
if [[ $KEEP == 1 ]]; then say "work folder: $WORK"; else trap 'rm -rf "$WORK"' EXIT; fi
LOCAL=$WORK/local
mkdir -p "$LOCAL" "$WORK/dl" "$WORK/house" "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$REPO"

# causal-conv1d options, checked before anything else (no torch, no network needed for this).
CC_LOCAL_LABEL=""
if [[ $WITH_CC == 1 ]]; then
  CC_SPEC=$(helper spec causal-conv1d)
  CC_VER=${CC_SPEC#*==}
  if [[ -n $CUDA_ARCH ]]; then
    arch_out=$(helper cuda-archs "$CUDA_ARCH") || exit 2
    CUDA_ARCH=${arch_out% *}
    CC_LOCAL_LABEL=${arch_out#* }
  fi
  if [[ -n $SDIST ]]; then helper check-sdist "$SDIST" --spec "$CC_SPEC" || exit 2; fi
fi

read -r -a PLATFORM_ARGS <<<"$(helper expand-platforms "${PLATFORMS[@]}" | sed 's/[^ ][^ ]*/--platform &/g')"
TARGET_ARGS=(--only-binary=:all: --python-version "$PYVER" --implementation cp "${PLATFORM_ARGS[@]}")
PYMM=$(echo "$PYVER" | cut -d. -f1,2)
say "target: CPython $PYVER, ${PLATFORMS[*]}; build interpreter: $BUILD_PY ($("$BUILD_PY" -c 'import sys; print(sys.version.split()[0])'))"

# The build interpreter's torch: mamba-ssm's and causal-conv1d's setup.py import it (hence --no-build-isolation).
TORCH_INFO=$("$BUILD_PY" -c 'import torch, sys; print(torch.__version__.split("+")[0], torch.version.cuda or "none")' 2>/dev/null) \
  || die "$BUILD_PY has no torch; mamba-ssm's setup.py imports it. Run 'make install' or pass --build-python."
LOCAL_TORCH=${TORCH_INFO% *}
LOCAL_CUDA=${TORCH_INFO#* }
LOCAL_TRITON=$("$BUILD_PY" -c 'import triton; print(triton.__version__)' 2>/dev/null || true)

# causal-conv1d's prerequisites, checked before anything is built (unless a wheel of it in --out is reused).
if [[ $WITH_CC == 1 ]]; then
  CC_TAG=cp${PYMM/./}
  # The wheel's version: the pin, plus +sm90... with --cuda-arch (a one-architecture wheel is never reused for
  # the full one, nor the other way round).
  CC_WVER=$CC_VER${CC_LOCAL_LABEL:++$CC_LOCAL_LABEL}
  shopt -s nullglob
  reuse=("$OUT"/causal_conv1d-"$CC_WVER"-"$CC_TAG"-*.whl)
  shopt -u nullglob
  if [[ ${#reuse[@]} == 0 ]]; then
    # A CPython extension against torch's C++ API: it loads only in the interpreter version and the torch
    # version it was built with, so it must be built by a Python $PYMM that holds the cluster's CUDA torch.
    BUILD_MM=$("$BUILD_PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    [[ $BUILD_MM == "$PYMM" ]] || die "--with-causal-conv1d builds a CPython $BUILD_MM extension with $BUILD_PY, \
but the target is $PYMM. Make a Python $PYMM environment holding the cluster's CUDA torch (e.g. torch==2.11.0 built \
for CUDA 13.0) plus setuptools, packaging, ninja, and pass it as --build-python (docs/wheelhouse.md)."
    [[ $LOCAL_CUDA != none ]] || die "--with-causal-conv1d needs a CUDA build of torch in $BUILD_PY \
(it has torch $LOCAL_TORCH, CPU only): causal-conv1d compiles CUDA kernels against it (docs/wheelhouse.md)."
    NVCC=$(command -v nvcc || true)
    [[ -n $NVCC || -x ${CUDA_HOME:-/nonexistent}/bin/nvcc ]] || die "--with-causal-conv1d needs nvcc (CUDA toolkit) \
on PATH or in \$CUDA_HOME/bin, matching torch's CUDA $LOCAL_CUDA."
    if [[ -n $TORCH_VERSION && $TORCH_VERSION != "$LOCAL_TORCH" ]]; then
      echo "wheelhouse: warning: building against torch $LOCAL_TORCH, the cluster runs $TORCH_VERSION: the extension may not load" >&2
    fi
    "$BUILD_PY" -c 'import setuptools, wheel, packaging' 2>/dev/null || die "--with-causal-conv1d needs setuptools, \
wheel and packaging in $BUILD_PY (its setup.py imports them; the build is --no-build-isolation)."
    "$BUILD_PY" -c 'import ninja' 2>/dev/null || echo "wheelhouse: warning: no ninja in $BUILD_PY: torch then \
compiles causal-conv1d's 4 files one after another, without MAX_JOBS" >&2
  fi
fi

# Builds causal-conv1d (the prerequisites above are checked) into $LOCAL: from --sdist, else from the sdist
# downloaded from the index; unpacked in $WORK, its setup.py restricted to --cuda-arch, built from that folder.
build_causal_conv1d() {
  local sdist=$SDIST src
  if [[ -z $sdist ]]; then
    say "downloading the $CC_SPEC sdist (CAUSAL_CONV1D_SKIP_CUDA_BUILD=TRUE: metadata without nvcc)"
    CAUSAL_CONV1D_SKIP_CUDA_BUILD=TRUE pipq download -q --no-deps --no-binary :all: --no-build-isolation \
      -d "$WORK/ccdl" "$CC_SPEC" || die "downloading the $CC_SPEC sdist failed (above); offline: pass --sdist"
    sdist=$(ls "$WORK"/ccdl/causal_conv1d-"$CC_VER".tar.gz 2>/dev/null | head -1)
    [[ -n $sdist ]] || die "pip download gave no causal_conv1d-$CC_VER.tar.gz: $(ls "$WORK/ccdl")"
  fi
  src=$(helper prepare-sdist "$sdist" --spec "$CC_SPEC" --dest "$WORK/ccsrc" ${CUDA_ARCH:+--cuda-arch "$CUDA_ARCH"}) \
    || die "preparing ${sdist##*/} failed (above)"
  if [[ -n $CUDA_ARCH ]]; then
    say "building $CC_SPEC from ${sdist##*/} with CUDA $LOCAL_CUDA for sm_${CUDA_ARCH//,/, sm_} only (version $CC_WVER)"
  else
    say "building $CC_SPEC from ${sdist##*/} with CUDA $LOCAL_CUDA (its 9 GPU architectures; about 12 min with nvcc 13.0)"
  fi
  CAUSAL_CONV1D_FORCE_BUILD=TRUE CAUSAL_CONV1D_LOCAL_VERSION=$CC_LOCAL_LABEL MAX_JOBS=${MAX_JOBS:-$(nproc)} \
    pipq wheel --no-build-isolation --no-deps --no-index --no-cache-dir -w "$LOCAL" "$src" \
    || die "building $CC_SPEC failed (above)"
  ls "$LOCAL"/causal_conv1d-"$CC_WVER"-*.whl >/dev/null 2>&1 \
    || die "the build gave no causal_conv1d-$CC_WVER-*.whl: $(ls "$LOCAL")"
}

if [[ $ONLY_CC == 1 ]]; then
  if [[ ${#reuse[@]} -gt 0 ]]; then
    say "${reuse[0]##*/} is already in $OUT (delete it to rebuild); nothing to do"
    exit 0
  fi
  build_causal_conv1d
  built=$(ls "$LOCAL"/causal_conv1d-"$CC_WVER"-*.whl | head -1)
  rm -f "$OUT"/causal_conv1d-*.whl
  cp "$built" "$OUT/"
  if [[ -f $OUT/requirements.txt ]]; then
    { grep -v -i -E '^causal[-_]conv1d==' "$OUT/requirements.txt" || true; echo "causal-conv1d==$CC_WVER"; } >"$WORK/req.txt"
    cp "$WORK/req.txt" "$OUT/requirements.txt"
  fi
  mkdir -p "$WORK/only"
  cp "$built" "$WORK/only/"
  VERIFY_ARGS=(--python "$PYVER")
  for p in "${PLATFORMS[@]}"; do VERIFY_ARGS+=(--platform "$p"); done
  helper verify "$WORK/only" "${VERIFY_ARGS[@]}" || die "${built##*/} does not install on the target (above)"
  say "built $OUT/${built##*/} ($(du -h "$built" | cut -f1)); the rest of the wheelhouse was not touched"
  exit 0
fi

# ---------------------------------------------------------------------------------------- 1. builds
MAMBA_SPEC=$(helper spec mamba-ssm)
say "building $MAMBA_SPEC as a pure-Python wheel (MAMBA_SKIP_CUDA_BUILD=TRUE)"
MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE \
  pipq wheel -q --no-build-isolation --no-deps --no-cache-dir -w "$LOCAL" "$MAMBA_SPEC" \
  || die "building $MAMBA_SPEC failed (above)"
helper retag "$LOCAL"/mamba_ssm-*.whl

while read -r spec; do
  say "building sdist-only pure-Python dependency $spec"
  pipq wheel -q --no-deps --no-cache-dir -w "$LOCAL" "$spec" || die "building $spec failed (above)"
done < <(helper sdist-only)
for w in "$LOCAL"/*.whl; do
  case "$w" in */mamba_ssm-*) ;; *) helper retag "$w" ;; esac
done

if [[ $WITH_CC == 1 ]]; then
  if [[ ${#reuse[@]} -gt 0 ]]; then
    say "reusing ${reuse[0]##*/} from $OUT (delete it to rebuild)"
    cp "${reuse[0]}" "$LOCAL/"
  else
    build_causal_conv1d
  fi
fi

# ---------------------------------------------------------------------------------------- 2. resolve
PLAN_ARGS=(--pyproject "$REPO/pyproject.toml" --python "$PYVER" --local-dir "$LOCAL" --work "$WORK")
for p in "${PLATFORMS[@]}"; do PLAN_ARGS+=(--platform "$p"); done
[[ $MINIMAL == 1 ]] && PLAN_ARGS+=(--minimal)
[[ $WITH_TORCH == 1 ]] && PLAN_ARGS+=(--with-torch)
[[ $WITH_MAMBA3 == 1 ]] && PLAN_ARGS+=(--with-mamba3)
PLAN_ARGS+=(--torch-version "$TORCH_VERSION" --triton-version "$TRITON_VERSION")
PLAN_ARGS+=(--local-torch-version "$LOCAL_TORCH" --local-triton-version "$LOCAL_TRITON")
say "resolving the dependency closure for the target"
helper plan "${PLAN_ARGS[@]}" ${SKIP_ARGS[@]+"${SKIP_ARGS[@]}"}

# ---------------------------------------------------------------------------------------- 3. download, assemble
if [[ -s $WORK/download.txt ]]; then
  say "downloading $(wc -l <"$WORK/download.txt") wheels"
  pipq download -q --no-deps "${TARGET_ARGS[@]}" -d "$WORK/dl" -r "$WORK/download.txt" || die "pip download failed (above)"
  cp "$WORK"/dl/*.whl "$WORK/house/"
fi
"$BUILD_PY" -c 'import json, shutil, sys
for d in json.load(open(sys.argv[1]))["local"]: shutil.copy(d["path"], sys.argv[2])' "$WORK/plan.json" "$WORK/house"
n_planned=$(( $(wc -l <"$WORK/download.txt") + $("$BUILD_PY" -c 'import json,sys; print(len(json.load(open(sys.argv[1]))["local"]))' "$WORK/plan.json") ))
n_got=$(find "$WORK/house" -name '*.whl' | wc -l)
[[ $n_got == "$n_planned" ]] || die "planned $n_planned wheels, got $n_got: $(ls "$WORK/house")"
rm -f "$OUT"/*.whl
cp "$WORK"/house/*.whl "$OUT/"

# ---------------------------------------------------------------------------------------- 4. verify
say "checking every wheel in $OUT installs on CPython $PYVER ${PLATFORMS[*]}"
VERIFY_ARGS=(--python "$PYVER")
for p in "${PLATFORMS[@]}"; do VERIFY_ARGS+=(--platform "$p"); done
helper verify "$OUT" "${VERIFY_ARGS[@]}"
# pip's own verdict, offline and without this machine's pip configuration. linux_<arch>: what a wheel built
# here (causal-conv1d) is tagged; pip accepts it when it runs on the target itself.
ARCH=$(helper expand-platforms "${PLATFORMS[0]}" | awk '{print $1}' | sed -E 's/^(manylinux_[0-9]+_[0-9]+_|manylinux[0-9]+_|musllinux_[0-9]+_[0-9]+_|linux_)//')
PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS='' PIP_EXTRA_INDEX_URL='' "$BUILD_PY" -m pip install -q --dry-run \
  --ignore-installed --no-index --no-deps --find-links "$OUT" --target "$WORK/dry" "${TARGET_ARGS[@]}" \
  --platform "linux_$ARCH" -r "$OUT/requirements.txt" \
  || die "pip refuses to install the wheelhouse for the target (above)"
say "pip --no-index --dry-run: all $(wc -l <"$OUT/requirements.txt") wheels install on the target"
# Closure, by pip's resolver this time: the wheelhouse plus the target's known packages (stubs) must satisfy every
# requirement. Only possible when every left-out package has a known version; mamba-ssm is left out of it unless
# --with-mamba3 (its Mamba-3 requirements are not carried on purpose).
UNKNOWN=$("$BUILD_PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["unknown_present"])' "$WORK/plan.json")
if [[ $UNKNOWN == 0 ]]; then
  grep -v -E "^mamba[-_]ssm==" "$OUT/requirements.txt" >"$WORK/closure.txt" || true
  [[ $WITH_MAMBA3 == 1 ]] && cp "$OUT/requirements.txt" "$WORK/closure.txt"
  if PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS='' PIP_EXTRA_INDEX_URL='' "$BUILD_PY" -m pip install -q --dry-run \
      --ignore-installed --no-index --find-links "$OUT" --find-links "$WORK/stubs" -c "$WORK/constraints.txt" \
      --target "$WORK/dry2" "${TARGET_ARGS[@]}" --platform "linux_$ARCH" -r "$WORK/closure.txt"; then
    say "pip --no-index --dry-run with dependencies: the wheelhouse is closed over the target's packages"
  else
    echo "wheelhouse: warning: pip finds a requirement unmet (above). pip reads markers for the Python running it \
($("$BUILD_PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')), not $PYVER, so a dependency meant only for that version can show here." >&2
  fi
else
  say "closure check by pip skipped: $UNKNOWN left-out packages have no known version on the target"
fi
say "wheelhouse $OUT: $(du -sh "$OUT" | cut -f1) ($(du -sb "$OUT" | cut -f1) bytes)"
SHOW=$OUT
[[ $OUT == "$REPO"/* ]] && SHOW=${OUT#"$REPO"/}   # inside the checkout: the same relative path on the target
cat >&2 <<EOF
== install on the target (no network):
     python3 -m pip install --no-index --no-deps --find-links $SHOW -r $SHOW/requirements.txt
   or, without touching the system site-packages (our H200 machine; carry $SHOW):
     source scripts/gpu_env.sh $SHOW || exit 1
EOF
