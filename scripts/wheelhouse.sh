#!/usr/bin/env bash
# Build an offline wheelhouse of this project's Python dependencies for another interpreter and platform, so that
# an air-gapped GPU machine installs with `pip install --no-index --no-deps --find-links DIR -r DIR/requirements.txt`
# (or `source scripts/gpu_env.sh DIR` on our H200 machine). docs/wheelhouse.md explains it.
#   1. builds here what PyPI has only as sdists (mamba-ssm as a pure-Python wheel, antlr4-python3-runtime, and with
#      --with-causal-conv1d the CUDA extension causal-conv1d);
#   2. resolves pyproject.toml ([project.dependencies] + the `gpu` extra) for the target with `uv pip compile`,
#      leaving out what the target already has (torch and triton always, unless --with-torch);
#   3. downloads that set with `pip download --no-deps` into --out, writes --out/requirements.txt, and has pip
#      check offline that every wheel installs on the target.
#
# usage: scripts/wheelhouse.sh [options]
#   --python X.Y[.Z]       target CPython version (default 3.12)
#   --platform TAG         target platform, manylinux_2_N_ARCH (default manylinux_2_28_x86_64)
#   --out DIR              where the wheels go (default wheelhouse/); its old *.whl files are replaced
#   --minimal              leave out what our H200 image already has (its package list in nvfp4_train/wheelhouse.py)
#   --skip-present FILE    leave out what FILE lists: the target's `python3 -m pip list --format=freeze` (exact:
#                          resolves against those versions) or bare names (assumed compatible); repeatable
#   --carry NAME           carry NAME although the skip list says the target has it; repeatable
#   --with-torch           also carry torch, triton and their CUDA libraries (default: the cluster's own)
#   --with-mamba3          also carry tilelang, apache-tvm-ffi, quack-kernels (only mamba-ssm's Mamba-3 imports them)
#   --with-causal-conv1d   build causal-conv1d==<pyproject pin> as a CUDA extension (needs --build-python with
#                          Python X.Y and a CUDA torch of the cluster's version, and nvcc). A wheel of it already in
#                          --out is reused.
#   --sdist FILE           build causal-conv1d from this local sdist (causal_conv1d-<pin>.tar.gz), no download
#   --cuda-arch LIST       build causal-conv1d for these GPU architectures only (90 = sm_90, the H200; 90,100);
#                          the wheel's version gets a local label (1.7.0+sm90). Default: its own 9
#   --only-causal-conv1d   build just the causal-conv1d wheel into --out, replacing a causal_conv1d wheel there and
#                          its requirements.txt line; nothing else is built, resolved or downloaded
#   --build-python PY      interpreter that builds the sdists and runs pip (default .venv/bin/python, else python3);
#                          it needs torch (any build; CUDA for causal-conv1d), setuptools and packaging
#   --torch-version V      the cluster's torch, resolved against but not carried (default: from the skip list,
#                          else the build interpreter's torch)
#   --triton-version V     likewise for triton
#   --keep-work            keep the temporary work folder (printed) for inspection
# Needs uv (the dev extra; next to --build-python, on PATH, or as `PY -m uv`), except --only-causal-conv1d.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
HELPER="$REPO/nvfp4_train/wheelhouse.py"
# Sdist-only pure-Python dependencies, built here: hydra-core 1.3 pins antlr4-python3-runtime==4.9.*, whose only
# release file on PyPI is a 4.9.3 sdist.
SDIST_ONLY_PURE=("antlr4-python3-runtime==4.9.*")
usage() { sed -n 's/^# \{0,1\}//; /^usage:/,/^Needs uv/p' "${BASH_SOURCE[0]}"; }
# The pin NAME==VERSION of NAME in pyproject.toml (its dependencies or the gpu extra).
pin() {
  grep -o -E "\"$1==[^\"]+\"" "$REPO/pyproject.toml" | tr -d '"' | grep . \
    || { echo "wheelhouse: error: no \"$1==VERSION\" in $REPO/pyproject.toml" >&2; exit 2; }
}

PYVER=3.12 PLATFORM=manylinux_2_28_x86_64 OUT=wheelhouse BUILD_PY="" SDIST="" CUDA_ARCH="" KEEP=0 ONLY_CC=0 WITH_CC=0
INPUT_ARGS=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --python) PYVER=${2:?}; shift 2 ;;
    --platform) PLATFORM=${2:?}; shift 2 ;;
    --out) OUT=${2:?}; shift 2 ;;
    --minimal|--with-torch|--with-mamba3) INPUT_ARGS+=("$1"); shift ;;
    --skip-present)
      [[ -f ${2:?} ]] || { echo "wheelhouse: error: --skip-present $2: no such file" >&2; exit 2; }
      INPUT_ARGS+=(--skip-present "$(cd "$(dirname "$2")" && pwd)/$(basename "$2")"); shift 2 ;;
    --carry|--torch-version|--triton-version) INPUT_ARGS+=("$1" "${2:?}"); shift 2 ;;
    --with-causal-conv1d) WITH_CC=1; shift ;;
    --sdist)
      [[ -f ${2:?} ]] || { echo "wheelhouse: error: --sdist $2: no such file" >&2; exit 2; }
      SDIST="$(cd "$(dirname "$2")" && pwd)/$(basename "$2")"; shift 2 ;;
    --cuda-arch) CUDA_ARCH=${2:?}; shift 2 ;;
    --only-causal-conv1d) ONLY_CC=1; WITH_CC=1; shift ;;
    --build-python) BUILD_PY=${2:?}; shift 2 ;;
    --keep-work) KEEP=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "wheelhouse: error: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
  esac
done
if [[ -z $BUILD_PY ]]; then
  if [[ -x $REPO/.venv/bin/python ]]; then BUILD_PY=$REPO/.venv/bin/python; else BUILD_PY=$(command -v python3); fi
fi
command -v "$BUILD_PY" >/dev/null || { echo "wheelhouse: error: build interpreter '$BUILD_PY' not found" >&2; exit 2; }
if [[ $WITH_CC == 0 && ( -n $SDIST || -n $CUDA_ARCH ) ]]; then
  echo "wheelhouse: error: --sdist and --cuda-arch apply to causal-conv1d: add --with-causal-conv1d" \
    "(or --only-causal-conv1d)" >&2
  exit 2
fi
# uv names the platform ARCH-manylinux_2_N; pip download matches tags exactly, so it gets every older manylinux
# (manylinux2014 stands for 2_17 and brings 2010 and 1 with it) and linux_ARCH (a wheel built here).
[[ $PLATFORM =~ ^manylinux_2_([0-9]+)_(x86_64|aarch64)$ ]] \
  || { echo "wheelhouse: error: --platform wants manylinux_2_N_x86_64 or manylinux_2_N_aarch64, got '$PLATFORM'" >&2
       exit 2; }
ARCH=${BASH_REMATCH[2]}
UV_PLATFORM=$ARCH-manylinux_2_${BASH_REMATCH[1]}
TARGET_ARGS=(--only-binary=:all: --python-version "$PYVER" --implementation cp)
for m in $(seq "${BASH_REMATCH[1]}" -1 17); do TARGET_ARGS+=(--platform "manylinux_2_${m}_$ARCH"); done
TARGET_ARGS+=(--platform "manylinux2014_$ARCH" --platform "linux_$ARCH")
PYMM=$(echo "$PYVER" | cut -d. -f1,2)

die() { echo "wheelhouse: error: $*" >&2; exit 1; }
say() { echo "== $*" >&2; }
helper() { "$BUILD_PY" "$HELPER" "$@"; }
# pip, minus the warnings about this machine's absent local mirrors; keeps pip's exit status.
pipq() { "$BUILD_PY" -m pip "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }; return "${PIPESTATUS[0]}"; }
# uv, minus its warning that this machine has no Python of the target's version to build with (it builds nothing).
uvq() { "${UV[@]}" "$@" 2>&1 | { grep -v -E "requested Python version|will be used to build" || true; }; return "${PIPESTATUS[0]}"; }

WORK=$(mktemp -d "${TMPDIR:-/tmp}/wheelhouse.XXXXXX")
if [[ $KEEP == 1 ]]; then say "work folder: $WORK"; else trap 'rm -rf "$WORK"' EXIT; fi
LOCAL=$WORK/local
mkdir -p "$LOCAL" "$WORK/dl" "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$REPO"

# causal-conv1d options, checked before anything else (no torch, no network needed for this).
CC_LOCAL_LABEL=""
if [[ $WITH_CC == 1 ]]; then
  CC_SPEC=$(pin causal-conv1d)
  CC_VER=${CC_SPEC#*==}
  if [[ -n $CUDA_ARCH ]]; then
    arch_out=$(helper cuda-archs "$CUDA_ARCH") || exit 2
    CUDA_ARCH=${arch_out% *}
    CC_LOCAL_LABEL=${arch_out#* }
  fi
  if [[ -n $SDIST ]]; then helper check-sdist "$SDIST" --spec "$CC_SPEC" || exit 2; fi
fi
say "target: CPython $PYVER, $PLATFORM; build interpreter: $BUILD_PY ($("$BUILD_PY" -c 'import sys; print(sys.version.split()[0])'))"

# The build interpreter's torch: mamba-ssm's and causal-conv1d's setup.py import it (hence --no-build-isolation).
TORCH_INFO=$("$BUILD_PY" -c 'import torch; print(torch.__version__.split("+")[0], torch.version.cuda or "none")' 2>/dev/null) \
  || die "$BUILD_PY has no torch; mamba-ssm's setup.py imports it. Run 'make install' or pass --build-python."
LOCAL_TORCH=${TORCH_INFO% *}
LOCAL_CUDA=${TORCH_INFO#* }

# causal-conv1d's prerequisites, checked before anything is built (unless a wheel of it in --out is reused).
if [[ $WITH_CC == 1 ]]; then
  # The wheel's version: the pin, plus +sm90... with --cuda-arch (a one-architecture wheel is never reused for
  # the full one, nor the other way round).
  CC_WVER=$CC_VER${CC_LOCAL_LABEL:++$CC_LOCAL_LABEL}
  shopt -s nullglob
  reuse=("$OUT"/causal_conv1d-"$CC_WVER"-cp${PYMM/./}-*.whl)
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
    [[ -n $(command -v nvcc) || -x ${CUDA_HOME:-/nonexistent}/bin/nvcc ]] || die "--with-causal-conv1d needs nvcc \
(CUDA toolkit) on PATH or in \$CUDA_HOME/bin, matching torch's CUDA $LOCAL_CUDA."
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
  local archs="its 9 GPU architectures"
  [[ -z $CUDA_ARCH ]] || archs="sm_${CUDA_ARCH//,/, sm_} only"
  say "building $CC_SPEC from ${sdist##*/} with CUDA $LOCAL_CUDA for $archs (version $CC_WVER)"
  CAUSAL_CONV1D_FORCE_BUILD=TRUE CAUSAL_CONV1D_LOCAL_VERSION=$CC_LOCAL_LABEL MAX_JOBS=${MAX_JOBS:-$(nproc)} \
    pipq wheel --no-build-isolation --no-deps --no-index --no-cache-dir -w "$LOCAL" "$src" \
    || die "building $CC_SPEC failed (above)"
  ls "$LOCAL"/causal_conv1d-"$CC_WVER"-*.whl >/dev/null 2>&1 \
    || die "the build gave no causal_conv1d-$CC_WVER-*.whl: $(ls "$LOCAL")"
}

# pip's own verdict, offline and without this machine's pip configuration: every line of REQS installs on the target.
verify() {  # DIR REQS
  PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS='' PIP_EXTRA_INDEX_URL='' "$BUILD_PY" -m pip install -q --dry-run \
    --ignore-installed --no-index --no-deps --find-links "$1" --target "$WORK/dry" "${TARGET_ARGS[@]}" -r "$2" \
    || die "pip refuses to install the wheels of $1 on CPython $PYVER $PLATFORM (above)"
}

if [[ $ONLY_CC == 1 ]]; then
  if [[ ${#reuse[@]} -gt 0 ]]; then
    say "${reuse[0]##*/} is already in $OUT (delete it to rebuild); nothing to do"
    exit 0
  fi
  build_causal_conv1d
  built=$(ls "$LOCAL"/causal_conv1d-"$CC_WVER"-*.whl | head -1)
  echo "causal-conv1d==$CC_WVER" >"$WORK/cc.txt"
  verify "$LOCAL" "$WORK/cc.txt"
  rm -f "$OUT"/causal_conv1d-*.whl
  cp "$built" "$OUT/"
  if [[ -f $OUT/requirements.txt ]]; then
    { grep -v -i -E '^causal[-_]conv1d==' "$OUT/requirements.txt" || true; cat "$WORK/cc.txt"; } >"$WORK/req.txt"
    cp "$WORK/req.txt" "$OUT/requirements.txt"
  fi
  say "built $OUT/${built##*/} ($(du -h "$built" | cut -f1)); the rest of the wheelhouse was not touched"
  exit 0
fi

UV=("$(dirname "$BUILD_PY")/uv")
[[ -x ${UV[0]} ]] || UV=("$(command -v uv || true)")
[[ -n ${UV[0]} ]] || UV=("$BUILD_PY" -m uv)
"${UV[@]}" --version >/dev/null 2>&1 || die "no uv (next to $BUILD_PY, on PATH, or as '$BUILD_PY -m uv'): \
it resolves for the target. Install it: $BUILD_PY -m pip install uv (it is in the dev extra)"

# ---------------------------------------------------------------------------------------------------- 1. builds
MAMBA_SPEC=$(pin mamba-ssm)
say "building $MAMBA_SPEC as a pure-Python wheel (MAMBA_SKIP_CUDA_BUILD=TRUE)"
MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE \
  pipq wheel -q --no-build-isolation --no-deps --no-cache-dir -w "$LOCAL" "$MAMBA_SPEC" \
  || die "building $MAMBA_SPEC failed (above)"
for spec in "${SDIST_ONLY_PURE[@]}"; do
  say "building sdist-only pure-Python dependency $spec"
  pipq wheel -q --no-deps --no-cache-dir -w "$LOCAL" "$spec" || die "building $spec failed (above)"
done
for w in "$LOCAL"/*.whl; do
  [[ $w =~ -py3-none-any\.whl$|-py2\.py3-none-any\.whl$ ]] || die "${w##*/} came out tagged for this interpreter, \
not pure Python: it can only be built on the target"
done
if [[ $WITH_CC == 1 ]]; then
  if [[ ${#reuse[@]} -gt 0 ]]; then
    say "reusing ${reuse[0]##*/} from $OUT (delete it to rebuild)"
    cp "${reuse[0]}" "$LOCAL/"
  else
    build_causal_conv1d
  fi
  INPUT_ARGS+=(--with-causal-conv1d)
fi

# ---------------------------------------------------------------------------------------------------- 2. resolve
LOCAL_TRITON=$("$BUILD_PY" -c 'import triton; print(triton.__version__)' 2>/dev/null || true)
NO_EMIT=$(helper inputs --work "$WORK" --local-torch-version "$LOCAL_TORCH" --local-triton-version "$LOCAL_TRITON" \
  ${INPUT_ARGS[@]+"${INPUT_ARGS[@]}"}) || exit 1
UV_ARGS=()
for n in $NO_EMIT; do UV_ARGS+=(--no-emit-package "$n"); done
say "resolving for the target with uv pip compile (left out: $(wc -l <"$WORK/excludes.txt") packages; resolved \
against the target's version, not carried: $(wc -l <"$WORK/constraints.txt"))"
# --config-file: the pinned packages' metadata (no requirements of their own); uv's index settings then come
# from UV_INDEX_URL / UV_DEFAULT_INDEX.
uvq pip compile pyproject.toml --extra gpu --python-version "$PYVER" --python-platform "$UV_PLATFORM" \
  --no-build --find-links "$LOCAL" --excludes "$WORK/excludes.txt" -c "$WORK/constraints.txt" \
  --config-file "$WORK/uv.toml" --no-python-downloads --quiet --no-header --no-annotate "${UV_ARGS[@]}" \
  -o "$WORK/requirements.txt" || die "uv could not resolve the dependencies for the target (above). A package the \
target has at a version the index lacks or that conflicts shows up here: correct or drop its line in the skip list."

# ---------------------------------------------------------------------------------------------------- 3. download
N=$(grep -c . "$WORK/requirements.txt")
say "downloading $N wheels (the ones built here from $LOCAL)"
pipq download -q --no-deps "${TARGET_ARGS[@]}" --find-links "$LOCAL" -d "$WORK/dl" -r "$WORK/requirements.txt" \
  || die "pip download failed (above)"
[[ $(find "$WORK/dl" -name '*.whl' | wc -l) == "$N" ]] || die "resolved $N packages, got these wheels: $(ls "$WORK/dl")"
rm -f "$OUT"/*.whl
cp "$WORK"/dl/*.whl "$WORK/requirements.txt" "$OUT/"
verify "$OUT" "$OUT/requirements.txt"
say "pip --no-index --dry-run: all $N wheels install on CPython $PYVER $PLATFORM"
say "wheelhouse $OUT: $(du -sh "$OUT" | cut -f1) ($(du -sb "$OUT" | cut -f1) bytes)"
SHOW=$OUT
[[ $OUT == "$REPO"/* ]] && SHOW=${OUT#"$REPO"/}   # inside the checkout: the same relative path on the target
say "install on the target (no network): python3 -m pip install --no-index --no-deps --find-links $SHOW -r \
$SHOW/requirements.txt, or on our H200 machine (carry $SHOW): source scripts/gpu_env.sh $SHOW || exit 1"
