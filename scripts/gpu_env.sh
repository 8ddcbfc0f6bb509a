# shellcheck shell=bash
# Source at the start of a command on an offline GPU machine (our H200):
#     source scripts/gpu_env.sh [WHEEL_DIR] || exit 1
# Installs the wheelhouse made by scripts/wheelhouse.sh (default WHEEL_DIR: <repo>/.whl) into /tmp/site without
# touching the machine's own packages (its CUDA torch, triton, ...), puts /tmp/site and the repository root
# first on PYTHONPATH, and installs the project itself editable into the interpreter's environment (pip -e,
# offline: what `make install` does), which maps nvfp4_train.kernels/.precision/.models to kernels/, precision/,
# models/. Idempotent: a second call with the same wheels only sets PYTHONPATH again (and installs the project
# only if that interpreter does not already map it to this checkout). Every failure prints "gpu_env: error: ..."
# and returns non-zero.
#
# Variables: GPU_ENV_SITE (default /tmp/site), GPU_PY (default python3: on the H200 that is the interpreter holding
# torch). docs/wheelhouse.md explains the whole path.

_gpu_env() {
  local repo dir site py stamp have_stamp n_whl
  repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd) || return 1
  dir=${1:-$repo/.whl}
  site=${GPU_ENV_SITE:-/tmp/site}
  py=${GPU_PY:-python3}

  command -v "$py" >/dev/null 2>&1 || { echo "gpu_env: error: no '$py' interpreter (set GPU_PY)" >&2; return 1; }
  [[ -d $dir ]] || { echo "gpu_env: error: no wheel folder '$dir': build it with scripts/wheelhouse.sh --minimal --out .whl and name .whl in the run's carry" >&2; return 1; }
  dir=$(cd "$dir" && pwd)
  local wheels=("$dir"/*.whl)
  [[ -e ${wheels[0]} ]] || { echo "gpu_env: error: no *.whl in $dir" >&2; return 1; }
  n_whl=${#wheels[@]}

  # The stamp names every wheel with its size and the interpreter: same stamp -> nothing to install.
  stamp=$( { "$py" -c 'import sys; print(sys.version)'; for w in "${wheels[@]}"; do printf '%s %s\n' "${w##*/}" "$(wc -c <"$w")"; done; } | cksum | cut -d' ' -f1)
  have_stamp=$(cat "$site/.gpu_env_stamp" 2>/dev/null || true)
  if [[ $stamp != "$have_stamp" ]]; then
    if [[ -n $have_stamp ]]; then rm -rf "$site"; fi   # a site we made for other wheels: start clean
    mkdir -p "$site" || { echo "gpu_env: error: cannot create $site" >&2; return 1; }
    echo "gpu_env: installing $n_whl wheels from $dir into $site" >&2
    if ! "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" "${wheels[@]}"; then
      echo "gpu_env: error: pip could not install the wheels of $dir into $site (above)" >&2
      return 1
    fi
    # mamba-ssm is carried as pure Python: its package __init__ imports the Mamba-1 CUDA extension
    # selective_scan_cuda unconditionally. A stand-in lets `import mamba_ssm` (and Mamba-2) work; using a
    # Mamba-1 op raises with the reason.
    if [[ -d $site/mamba_ssm ]] && ! PYTHONPATH="$site" "$py" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("selective_scan_cuda") is None)' 2>/dev/null; then
      cat >"$site/selective_scan_cuda.py" <<'EOF'
"""Stand-in written by scripts/gpu_env.sh: mamba-ssm was installed as a pure-Python wheel, without its Mamba-1
CUDA extension. mamba_ssm/__init__ imports this module unconditionally; Mamba-2 never calls it."""


def __getattr__(name):
    raise AttributeError(f"selective_scan_cuda.{name}: mamba-ssm's Mamba-1 CUDA extension is not built "
                         "(pure-Python wheel from scripts/wheelhouse.sh); Mamba-2 does not need it")
EOF
    fi
    echo "$stamp" >"$site/.gpu_env_stamp"
  fi

  # /tmp/site first (its packages win over the image's older or missing ones), then the repository root.
  local p=":${PYTHONPATH:-}:"
  p=${p//:$site:/:}
  p=${p//:$repo:/:}
  p=${p#:}
  p=${p%:}
  export PYTHONPATH="$site:$repo${p:+:$p}"

  if [[ $stamp != "$have_stamp" ]]; then
    # Requirements of the installed wheels that this environment does not meet (warnings, not errors: the
    # skip list of --minimal assumes some of the image's versions).
    "$py" "$repo/nvfp4_train/wheelhouse.py" check-site "$site" >&2 \
      || echo "gpu_env: warning: the requirement check itself failed (above)" >&2
  fi
  # The project, editable: nvfp4_train.kernels etc. live in kernels/ etc., which only the installed package maps
  # (the repository root on PYTHONPATH gives nvfp4_train but not them). Skipped when this checkout is mapped.
  if ! (cd / && "$py" -c 'import importlib.util as u, sys; s = u.find_spec("nvfp4_train.kernels")
sys.exit(s is None or s.origin != sys.argv[1])' "$repo/kernels/__init__.py") 2>/dev/null; then
    echo "gpu_env: installing the project (editable) from $repo" >&2
    if ! "$py" -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir -e "$repo"; then
      echo "gpu_env: error: pip could not install $repo editable (above; it needs setuptools >= 68 in $py's environment)" >&2
      return 1
    fi
  fi
  echo "gpu_env: PYTHONPATH=$PYTHONPATH" >&2
  return 0
}

if [[ ${BASH_SOURCE[0]} == "$0" ]]; then
  echo "gpu_env: error: source this file (source scripts/gpu_env.sh [WHEEL_DIR]); running it cannot set PYTHONPATH" >&2
  exit 1
fi
_gpu_env "$@"
_gpu_env_rc=$?
unset -f _gpu_env
return "$_gpu_env_rc"
