#!/usr/bin/env python3
"""Helper of scripts/wheelhouse.sh (and scripts/gpu_env.sh): what uv and pip cannot do themselves.

Subcommands
  inputs --work DIR ... write DIR/excludes.txt, DIR/constraints.txt and DIR/uv.toml for `uv pip compile` from what
                        the target already has; print the packages it must not emit (one a line)
  check-site SITE       (on the GPU machine) warn about requirements of the wheels installed in SITE that
                        the environment (SITE + the image's own packages) does not satisfy
  cuda-archs LIST       validate --cuda-arch (e.g. 90 or 90,100) and print `ARCHS LOCAL_LABEL` (90,100 sm90.sm100)
  check-sdist SDIST --spec REQ   check that SDIST's file name is REQ's name and pinned version
  prepare-sdist SDIST --spec REQ --dest DIR [--cuda-arch LIST]
                        unpack SDIST into DIR (checking its PKG-INFO against REQ), restrict causal-conv1d's setup.py
                        to LIST's GPU architectures (restrict_gencode), print the source folder
"""
from __future__ import annotations

import argparse
import ast
import re
import sys
import tarfile
from pathlib import Path

try:
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import InvalidSdistFilename, canonicalize_name, parse_sdist_filename
    from packaging.version import InvalidVersion, Version
except ImportError:  # pip always vendors packaging
    from pip._vendor.packaging.requirements import InvalidRequirement, Requirement
    from pip._vendor.packaging.utils import InvalidSdistFilename, canonicalize_name, parse_sdist_filename
    from pip._vendor.packaging.version import InvalidVersion, Version

# ---------------------------------------------------------------------------------------------------------------
# What the project's H200 machine already has (the image's list of preinstalled Python packages, read on
# 2026-11-17), with the versions its "pip list" gives (2026-11). Packages with a known version are resolved against that
# exact version (without their own requirements); the others are left out of the resolution, assumed compatible
# (scripts/gpu_env.sh warns at install time if they are not).
# Replace this with the cluster's own `python3 -m pip list --format=freeze` via --skip-present FILE when you can.
H200_PRESENT_NAMES = """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy
peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile
tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm
transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel
wrapt xarray xxhash yarl zipp
""".split()
H200_PRESENT_VERSIONS = {
    "accelerate": "1.15.0", "botorch": "0.18.1", "cupy-cuda13x": "14.2.0", "gpytorch": "1.15.2",
    "huggingface-hub": "1.33.0", "jax": "0.11.2", "jax-cuda13-pjrt": "0.11.2", "jax-cuda13-plugin": "0.11.2",
    "jaxlib": "0.11.2", "jaxtyping": "0.3.11", "numpy": "2.5.2", "numpyro": "0.21.0", "onnx": "1.23.1",
    "onnx-ir": "1.0.0", "onnxruntime": "1.30.0", "onnxscript": "0.7.2", "pytorch-lightning": "2.6.6",
    "safetensors": "0.8.0", "sentence-transformers": "6.0.1", "sentencepiece": "0.2.2", "tiktoken": "0.14.0",
    "tokenizers": "0.23.2", "torch": "2.11.0", "torch-geometric": "2.8.0.post1", "torchaudio": "2.11.0",
    "torchdiffeq": "0.2.5", "torchmetrics": "1.9.0", "torchvision": "0.26.0", "transformers": "5.17.0",
    "triton": "3.6.0",
}

# Resolved as present unless --with-torch: the cluster brings its own CUDA build of these.
TORCH_GROUP = ("torch", "triton")
# Hard requirements of mamba-ssm 2.3.2.post1 that only its Mamba-3 modules import, inside try/except ImportError
# (mamba_ssm/modules/mamba3.py). Mamba-2 does not need them; --with-mamba3 carries them.
MAMBA3_GROUP = ("tilelang", "apache-tvm-ffi", "quack-kernels")
# Requirements that check-site does not warn about when absent (see MAMBA3_GROUP; causal-conv1d is optional).
OPTIONAL_AT_RUNTIME = set(MAMBA3_GROUP) | {"causal-conv1d"}


def cname(name: str) -> str:
    return canonicalize_name(name)


def die(msg: str, code: int = 1):
    print(f"wheelhouse: error: {msg}", file=sys.stderr)
    sys.exit(code)


def note(msg: str):
    print(f"wheelhouse: {msg}", file=sys.stderr)


# --------------------------------------------------------------------------------------------- what the target has
def read_present(files: list[str], minimal: bool) -> dict[str, str | None]:
    """name -> version (None when unknown): with `minimal` the H200 image's list, then each file's lines
    (`pip list --format=freeze` / `pip freeze` output: NAME==VERSION, NAME @ URL, or a bare NAME)."""
    present: dict[str, str | None] = {}
    if minimal:
        present.update((cname(n), None) for n in H200_PRESENT_NAMES)
        present.update((cname(n), v) for n, v in H200_PRESENT_VERSIONS.items())
    for f in files:
        for raw in Path(f).read_text().splitlines():
            line = raw.split("#", 1)[0].strip()
            if not line or line.startswith("-"):
                continue
            try:
                req = Requirement(line)
            except InvalidRequirement:
                die(f"{f}: cannot read line {raw!r} (want NAME, NAME==VERSION or NAME @ URL)")
            pins = [x.version for x in req.specifier if x.operator in ("==", "===")]
            present[cname(req.name)] = pins[0] if len(pins) == 1 and not req.url else None
    return present


def uv_inputs(present: dict[str, str | None], *, carry=(), with_torch=False, with_mamba3=False,
              with_causal_conv1d=False, torch_version="", triton_version="") -> tuple[list[str], dict[str, str]]:
    """What `uv pip compile` needs for a target that already has `present` (name -> version or None):
    (excludes, pins). Excludes are left out of the resolution: what the target has at an unknown version, mamba-ssm's
    Mamba-3 requirements unless with_mamba3, causal-conv1d unless with_causal_conv1d. Pins (name -> public version)
    are what the target has at a known version: resolved against exactly that version, without its requirements,
    and not emitted. torch and triton are pins (torch_version/triton_version, else present's) unless with_torch:
    then they are carried with their CUDA libraries (nvidia-*, cuda-*). `carry` names are resolved and carried."""
    drop = {cname(c) for c in carry}
    present = {cname(n): v for n, v in present.items() if cname(n) not in drop}
    if with_torch:
        present = {n: v for n, v in present.items() if n not in TORCH_GROUP and not n.startswith(("nvidia-", "cuda-"))}
    else:
        present.update(torch=torch_version or present.get("torch"), triton=triton_version or present.get("triton"))
        for n in TORCH_GROUP:
            if not present[n]:
                die(f"no {n} version to resolve against: pass --{n}-version (the cluster's {n})")
    excludes = {n for n, v in present.items() if not v} | ({"causal-conv1d"} if not with_causal_conv1d else set())
    pins = {}
    for n, v in sorted(present.items()):
        if v:
            try:
                pins[n] = Version(v).public  # 2.11.0+cu130 -> 2.11.0, the release the index has
            except InvalidVersion:
                die(f"the target's {n}=={v} is not a PEP 440 version (give it without a version)")
    return sorted(excludes | (set() if with_mamba3 else set(MAMBA3_GROUP))), pins


def cmd_inputs(a):
    present = read_present(a.skip_present, a.minimal)
    for n, local in (("torch", a.local_torch_version), ("triton", a.local_triton_version)):
        present[n] = present.get(n) or local or None  # the skip list's, else the build interpreter's
    excludes, pins = uv_inputs(present, carry=a.carry, with_torch=a.with_torch, with_mamba3=a.with_mamba3,
                               with_causal_conv1d=a.with_causal_conv1d, torch_version=a.torch_version,
                               triton_version=a.triton_version)
    work = Path(a.work)
    (work / "excludes.txt").write_text("".join(f"{n}\n" for n in excludes))
    (work / "constraints.txt").write_text("".join(f"{n}=={v}\n" for n, v in pins.items()))
    (work / "uv.toml").write_text("".join(f'[[dependency-metadata]]\nname = "{n}"\nversion = "{v}"\n'
                                          f'requires-dist = []\n\n' for n, v in pins.items()))
    for n in TORCH_GROUP if not a.with_torch else ():
        note(f"resolving against {n}=={pins[n]} (not carried)")
    if not a.with_causal_conv1d:
        note("causal-conv1d left out (CUDA build; pass --with-causal-conv1d). Mamba-2 runs without it.")
    print("\n".join(pins))


def pkg_info_name_version(text: str) -> tuple[str | None, str | None]:
    """Name and Version of a core-metadata file (an sdist's PKG-INFO): its headers end at the first blank line."""
    headers = dict(line.partition(": ")[::2] for line in text.split("\n\n", 1)[0].split("\n"))
    return headers.get("Name"), headers.get("Version")


# --------------------------------------------------------------------------------------------- causal-conv1d sdist
CUDA_ARCH_RE = re.compile(r"\d{2,3}[af]?")  # 90, 100, 90a, 100f: compute capability without the dot
_GENCODE = 'cc_flag.append("-gencode")'
_ARCH_LINE = re.compile(r'cc_flag\.append\("arch=compute_(\w+),code=sm_(\w+)"\)')
_VERSION_IF = re.compile(r'if bare_metal_version >= Version\("[\d.]+"\):')


class GencodeError(ValueError):
    """setup.py does not have the -gencode block restrict_gencode knows (causal-conv1d 1.7.0's)."""


def parse_cuda_archs(text: str) -> list[str]:
    """'90' / '90,100' / '90a' -> ['90', '100', ...] (order kept, duplicates dropped); ValueError otherwise."""
    archs = [x.strip() for x in text.split(",")]
    if not text.strip() or not all(CUDA_ARCH_RE.fullmatch(x) for x in archs):
        raise ValueError(f"--cuda-arch wants compute capabilities without the dot, comma-separated (90 for the "
                         f"H200's sm_90, 90,100 for sm_90 and sm_100, 90a for sm_90a), got {text!r}")
    return list(dict.fromkeys(archs))


def arch_local_version(archs: list[str]) -> str:
    """The wheel's local version label for a restricted build: ['90', '100'] -> 'sm90.sm100'."""
    return ".".join(f"sm{a}" for a in archs)


def restrict_gencode(setup_py_text: str, archs: list[str], filename: str = "setup.py") -> str:
    """Rewrite causal-conv1d 1.7.0's setup.py so that the nvcc `-gencode` flags it appends are exactly
    `arch=compute_XX,code=sm_XX` for XX in archs: its one block of `cc_flag.append("-gencode")` /
    `cc_flag.append("arch=compute_XX,code=sm_XX")` lines, the `if bare_metal_version >= Version("..."):` among them
    included, becomes such lines for archs only; everything else is kept. Anything unexpected raises GencodeError
    naming the file rather than letting another version build all its architectures (docs/wheelhouse.md)."""
    if not archs:
        raise ValueError("restrict_gencode: no architectures given")
    for a in archs:
        if not CUDA_ARCH_RE.fullmatch(a):
            raise ValueError(f"restrict_gencode: bad architecture {a!r} (want e.g. '90')")
    what = (f'the block of `{_GENCODE}` / `cc_flag.append("arch=compute_XX,code=sm_XX")` lines '
            f'(optionally under `if bare_metal_version >= Version("X.Y"):`) of causal-conv1d 1.7.0\'s setup.py')
    lines = setup_py_text.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line.strip() == _GENCODE]
    if not starts:
        raise GencodeError(f"{filename}: expected {what}, found no `{_GENCODE}` line. A causal-conv1d version "
                           f"other than 1.7.0? Refusing to build with its own (all) architectures.")
    start = starts[0]
    indent = lines[start][: len(lines[start]) - len(lines[start].lstrip())]
    end, kinds, found = start, [], []
    i = start
    while i < len(lines):
        line = lines[i]
        s = line.strip()
        ind = line[: len(line) - len(line.lstrip())]
        if s == "":
            i += 1
            continue
        if not ind.startswith(indent):
            break
        m = _ARCH_LINE.fullmatch(s)
        if s == _GENCODE:
            kinds.append("g")
        elif m:
            if m.group(1) != m.group(2):
                raise GencodeError(f"{filename}:{i + 1}: expected arch=compute_XX,code=sm_XX with one XX, got {s}")
            kinds.append("a")
            found.append(m.group(1))
        elif _VERSION_IF.fullmatch(s) and ind == indent:
            kinds.append("i")
        else:
            break
        i += 1
        end = i
    if kinds[-1] == "i" or "".join(k for k in kinds if k != "i").replace("ga", "") != "":
        raise GencodeError(f"{filename}:{start + 1}-{end}: expected {what}: `-gencode` lines each followed by one "
                           f"`arch=` line, no `if` left without its body; got the sequence {''.join(kinds)!r}")
    nxt = next((ln for ln in lines[end:] if ln.strip()), "")
    if len(nxt) - len(nxt.lstrip()) > len(indent):
        raise GencodeError(f"{filename}:{end + 1}: expected the end of {what}, but the next line is indented deeper "
                           f"(the body of an `if` of the block?): {nxt.strip()!r}")
    stray = [f"{n + 1}: {ln.strip()}" for n, ln in enumerate(lines)
             if not start <= n < end and re.search(r"-gencode|arch=compute_|code=sm_", ln)]
    if stray:
        raise GencodeError(f"{filename}: expected {what} to hold all of its -gencode flags; more outside it at "
                           f"line {'; '.join(stray)}")
    new = [f"{indent}# scripts/wheelhouse.sh --cuda-arch {','.join(archs)}: only these GPU architectures "
           f"(causal-conv1d's own list: {', '.join('sm_' + a for a in found)})\n"]
    for a in archs:
        new += [f"{indent}{_GENCODE}\n", f'{indent}cc_flag.append("arch=compute_{a},code=sm_{a}")\n']
    out = "".join(lines[:start] + new + lines[end:])
    try:
        ast.parse(out, filename)
    except SyntaxError as e:
        raise GencodeError(f"{filename}: the rewritten file does not parse ({e}); not building it") from e
    return out


def pinned(spec: str) -> tuple[Requirement, str]:
    req = Requirement(spec)
    pins = [s.version for s in req.specifier if s.operator in ("==", "===")]
    if len(pins) != 1 or "*" in pins[0]:
        die(f"{spec}: expected one exact pin (NAME==VERSION) in pyproject")
    return req, pins[0]


def check_sdist(path: Path, spec: str) -> None:
    """SDIST's file name must be NAME-VERSION.tar.gz with NAME and VERSION those of the pin `spec`."""
    req, pin = pinned(spec)
    if not path.is_file():
        die(f"--sdist {path}: no such file", 2)
    if not path.name.endswith(".tar.gz"):
        die(f"--sdist {path}: expected an sdist NAME-VERSION.tar.gz (e.g. causal_conv1d-{pin}.tar.gz)", 2)
    try:
        name, version = parse_sdist_filename(path.name)
    except InvalidSdistFilename as e:
        die(f"--sdist {path}: not an sdist file name ({e})", 2)
    if cname(name) != cname(req.name) or not req.specifier.contains(version, prereleases=True):
        die(f"--sdist {path.name} is {name} {version}, but pyproject pins {spec} (get that one: docs/wheelhouse.md, "
            f"'Building causal-conv1d on an offline GPU machine')", 2)


def unpack_sdist(path: Path, spec: str, dest: Path) -> Path:
    """Unpack SDIST into DEST, check its PKG-INFO against the pin, return its folder."""
    req, pin = pinned(spec)
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "r:gz") as t:
        members = t.getmembers()
        tops = {m.name.split("/")[0] for m in members}
        if len(tops) != 1:
            die(f"{path.name}: expected one top folder, found {sorted(tops)[:5]}")
        t.extractall(dest, filter="data")  # refuses absolute paths, '..', links out of dest, devices
    src = dest / tops.pop()
    pkg_info = src / "PKG-INFO"
    if not pkg_info.is_file():
        die(f"{path.name}: no PKG-INFO in {src.name}/: not an sdist")
    name, version = pkg_info_name_version(pkg_info.read_text(encoding="utf-8"))
    if cname(name or "") != cname(req.name) or version != pin:
        die(f"{path.name}: its PKG-INFO says {name} {version}, pyproject pins {spec}")
    if not (src / "setup.py").is_file():
        die(f"{path.name}: no setup.py in {src.name}/")
    return src


def _archs_or_die(text: str) -> list[str]:
    """parse_cuda_archs for the command line: a bad list exits 2 with its message."""
    try:
        return parse_cuda_archs(text)
    except ValueError as e:
        die(str(e), 2)


def cmd_cuda_archs(a):
    archs = _archs_or_die(a.archs)
    print(",".join(archs), arch_local_version(archs))


def cmd_check_sdist(a):
    check_sdist(Path(a.sdist), a.spec)


def cmd_prepare_sdist(a):
    sdist = Path(a.sdist)
    check_sdist(sdist, a.spec)
    src = unpack_sdist(sdist, a.spec, Path(a.dest))
    if a.cuda_arch:
        archs = _archs_or_die(a.cuda_arch)
        setup = src / "setup.py"
        try:
            setup.write_text(restrict_gencode(setup.read_text(encoding="utf-8"), archs,
                                              f"{sdist.name}:{src.name}/setup.py"), encoding="utf-8")
        except GencodeError as e:
            die(str(e))
        note(f"{src.name}/setup.py restricted to {', '.join('sm_' + x for x in archs)}")
    print(src)


# --------------------------------------------------------------------------------------------- check-site
def cmd_check_site(a):
    """Warn (never fail) about requirements of the wheels installed in SITE that this environment lacks."""
    from importlib import metadata

    site = Path(a.site)
    warnings = 0
    for info in sorted(site.glob("*.dist-info")):
        md = metadata.Distribution.at(info)
        for line in md.requires or []:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            n = cname(req.name)
            try:
                have = metadata.version(req.name)
            except metadata.PackageNotFoundError:
                if n not in OPTIONAL_AT_RUNTIME:
                    print(f"gpu_env: warning: {md.metadata['Name']} needs {req}, which is not installed")
                    warnings += 1
                continue
            if req.specifier and not req.specifier.contains(Version(have), prereleases=True):
                print(f"gpu_env: warning: {md.metadata['Name']} needs {req}, found {have}")
                warnings += 1
    if warnings:
        print(f"gpu_env: {warnings} unmet requirement(s) above: carry that package (drop it from the "
              f"skip list of scripts/wheelhouse.sh) if the import fails")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    def command(name, fn, *args):
        s = sub.add_parser(name)
        s.set_defaults(fn=fn)
        for flags, kw in args:
            s.add_argument(*flags.split(), **kw)

    flag, many, req = dict(action="store_true"), dict(action="append", default=[]), dict(required=True)
    command("inputs", cmd_inputs, ("--work", req), ("--minimal", flag), ("--skip-present", many), ("--carry", many),
            ("--with-torch", flag), ("--with-mamba3", flag), ("--with-causal-conv1d", flag),
            *((f"--{x}", dict(default="")) for x in ("torch-version", "triton-version", "local-torch-version",
                                                      "local-triton-version")))
    command("check-site", cmd_check_site, ("site", {}))
    command("cuda-archs", cmd_cuda_archs, ("archs", {}))
    command("check-sdist", cmd_check_sdist, ("sdist", {}), ("--spec", req))
    command("prepare-sdist", cmd_prepare_sdist, ("sdist", {}), ("--spec", req), ("--dest", req),
            ("--cuda-arch", dict(default="")))
    a = p.parse_args(argv)
    a.fn(a)


if __name__ == "__main__":
    main()
