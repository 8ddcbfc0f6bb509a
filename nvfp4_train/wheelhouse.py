#!/usr/bin/env python3
"""Helper of scripts/wheelhouse.sh (and scripts/gpu_env.sh): the parts that are easier in Python.

Subcommands
  spec NAME             print the pyproject requirement of NAME (project deps or the `gpu` extra)
  plan ...              resolve the dependency closure for the TARGET interpreter/platform and decide
                        what the wheelhouse carries (writes plan.json and download.txt)
  retag WHEEL...        rename a pure-Python wheel that came out interpreter-specific to py3-none-any
  verify DIR ...        check every wheel in DIR installs on the target (tags, one version per name),
                        write DIR/requirements.txt, print sizes
  check-site SITE       (on the GPU machine) warn about requirements of the wheels installed in SITE that
                        the environment (SITE + the image's own packages) does not satisfy
  cuda-archs LIST       validate --cuda-arch (e.g. 90 or 90,100) and print `ARCHS LOCAL_LABEL` (90,100 sm90.sm100)
  check-sdist SDIST --spec REQ   check that SDIST's file name is REQ's name and pinned version
  prepare-sdist SDIST --spec REQ --dest DIR [--cuda-arch LIST]
                        unpack SDIST into DIR (checking its PKG-INFO against REQ), restrict causal-conv1d's setup.py
                        to LIST's GPU architectures (restrict_gencode), print the source folder

How `plan` resolves: `pip install --dry-run --report` with --python-version/--platform/--implementation and
--only-binary=:all: (pip's own resolver, the one `pip download` uses; it fetches only metadata). Packages the
cluster already has at a KNOWN version (and torch/triton, which are never carried by default) are fed to the
resolver as empty "stub" wheels of exactly that version: the closure is then computed against the cluster's
versions and pip never descends into torch's CUDA dependency tree. pip evaluates environment markers against the
interpreter running it, not --python-version, so the closure is recomputed here with the target's marker
environment, and anything the target needs that pip skipped is added as a root and resolved again.
"""
from __future__ import annotations

import argparse
import ast
import base64
import csv
import hashlib
import io
import json
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.tags import compatible_tags, cpython_tags
    from packaging.utils import InvalidSdistFilename, canonicalize_name, parse_sdist_filename, parse_wheel_filename
    from packaging.version import Version
except ImportError:  # pip always vendors packaging
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.specifiers import SpecifierSet
    from pip._vendor.packaging.tags import compatible_tags, cpython_tags
    from pip._vendor.packaging.utils import (InvalidSdistFilename, canonicalize_name, parse_sdist_filename,
                                             parse_wheel_filename)
    from pip._vendor.packaging.version import Version

# ---------------------------------------------------------------------------------------------------------------
# What the project's H200 machine already has (the image's list of preinstalled Python packages, read on
# 2026-11-17), with the versions its "pip list" gives (2026-11). Packages with a known version are resolved against that
# exact version; the others are assumed compatible (scripts/gpu_env.sh warns at install time if they are not).
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

# Never carried unless --with-torch: the cluster brings its own CUDA build of these.
TORCH_GROUP = ("torch", "triton", "nvidia-*", "cuda-*", "pytorch-triton*")
# Hard requirements of mamba-ssm 2.3.2.post1 that only its Mamba-3 modules import, inside try/except ImportError
# (mamba_ssm/modules/mamba3.py). Mamba-2 does not need them; --with-mamba3 carries them.
MAMBA3_GROUP = ("tilelang", "apache-tvm-ffi", "quack-kernels")
# Sdist-only pure-Python dependencies: built here into py3-none-any wheels and offered to the resolver.
# hydra-core 1.3.x pins antlr4-python3-runtime==4.9.*, whose only release file on PyPI is a 4.9.3 sdist.
SDIST_ONLY_PURE = ("antlr4-python3-runtime==4.9.*",)
# Requirements that check-site does not warn about when absent (see MAMBA3_GROUP; causal-conv1d is optional).
OPTIONAL_AT_RUNTIME = set(MAMBA3_GROUP) | {"causal-conv1d"}

STUB_LOCAL = "whstub"


def cname(name: str) -> str:
    return canonicalize_name(name)


def matches(name: str, patterns) -> bool:
    n = cname(name)
    for p in patterns:
        p = cname(p.rstrip("*")) + ("*" if p.endswith("*") else "")
        if p.endswith("*") and n.startswith(p[:-1]) or n == p:
            return True
    return False


def die(msg: str, code: int = 1):
    print(f"wheelhouse: error: {msg}", file=sys.stderr)
    sys.exit(code)


def note(msg: str):
    print(f"wheelhouse: {msg}", file=sys.stderr)


# --------------------------------------------------------------------------------------------- pyproject
def load_pyproject(path: Path) -> dict:
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        from pip._vendor import tomli as tomllib
    with open(path, "rb") as f:
        return tomllib.load(f)


def project_requirements(pyproject: Path, extras=("gpu",)) -> list[Requirement]:
    proj = load_pyproject(pyproject)["project"]
    reqs = [Requirement(r) for r in proj.get("dependencies", [])]
    for extra in extras:
        if extra not in proj.get("optional-dependencies", {}):
            die(f"{pyproject} has no optional-dependencies extra '{extra}'")
        reqs += [Requirement(r) for r in proj["optional-dependencies"][extra]]
    return reqs


def cmd_spec(a):
    for r in project_requirements(Path(a.pyproject)):
        if cname(r.name) == cname(a.name):
            print(str(r))
            return
    die(f"{a.name} is not in {a.pyproject} (dependencies or the gpu extra)")


# --------------------------------------------------------------------------------------------- targets
def expand_platforms(platforms: list[str]) -> list[str]:
    """manylinux_2_N_ARCH -> every manylinux_2_M_ARCH with 5 <= M <= N plus the legacy aliases, best first.

    pip matches --platform tags exactly, so a lone manylinux_2_28 would miss wheels tagged only 2_17 or 2_24."""
    legacy = {"manylinux2014": 17, "manylinux2010": 12, "manylinux1": 5}
    out: list[str] = []
    for p in platforms:
        lm = re.fullmatch(r"(manylinux2014|manylinux2010|manylinux1)_(\w+)", p)
        if lm:
            p = f"manylinux_2_{legacy[lm.group(1)]}_{lm.group(2)}"
        m = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", p)
        if not m:
            out.append(p)
            continue
        top, arch = int(m.group(1)), m.group(2)
        for minor in range(top, 4, -1):
            out.append(f"manylinux_2_{minor}_{arch}")
            out += [f"{alias}_{arch}" for alias, lminor in legacy.items()
                    if lminor == minor and (alias == "manylinux2014" or arch in ("x86_64", "i686"))]
    return list(dict.fromkeys(out))


def target_env(python: str, platforms: list[str]) -> dict:
    parts = python.split(".")
    if len(parts) < 2 or not all(x.isdigit() for x in parts):
        die(f"--python wants X.Y or X.Y.Z, got {python!r}")
    full = python if len(parts) == 3 else f"{python}.0"
    arch = re.sub(r"^(manylinux_\d+_\d+_|manylinux\d+_|musllinux_\d+_\d+_|linux_)", "", platforms[0])
    return {
        "implementation_name": "cpython", "implementation_version": full, "os_name": "posix",
        "platform_machine": arch, "platform_release": "", "platform_system": "Linux", "platform_version": "",
        "python_full_version": full, "python_version": ".".join(parts[:2]),
        "platform_python_implementation": "CPython", "sys_platform": "linux",
    }


def applies(req: Requirement, env: dict, extras=frozenset()) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate(dict(env, extra=e)) for e in ({""} | set(extras)))


def supported_tags(python: str, platforms: list[str]) -> set[str]:
    pv = tuple(int(x) for x in python.split(".")[:2])
    tags = set(cpython_tags(pv, platforms=platforms))
    tags |= set(compatible_tags(pv, interpreter=f"cp{pv[0]}{pv[1]}", platforms=platforms))
    return {str(t) for t in tags}


# --------------------------------------------------------------------------------------------- wheels
def wheel_metadata(path: Path) -> tuple[str, str, list[str]]:
    with zipfile.ZipFile(path) as z:
        meta = [n for n in z.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)]
        if len(meta) != 1:
            die(f"{path.name}: expected one */METADATA, found {meta}")
        text = z.read(meta[0]).decode("utf-8")
    return core_metadata(text)


def core_metadata(text: str) -> tuple[str | None, str | None, list[str]]:
    """Name, Version and the Requires-Dist lines of a core-metadata file (a wheel's METADATA, an sdist's
    PKG-INFO): the headers up to the first blank line."""
    name = version = None
    reqs = []
    for line in text.split("\n"):
        if line == "":
            break  # headers end at the first blank line
        k, _, v = line.partition(": ")
        if k == "Name":
            name = v.strip()
        elif k == "Version":
            version = v.strip()
        elif k == "Requires-Dist":
            reqs.append(v.strip())
    return name, version, reqs


def write_stub_wheel(directory: Path, name: str, version: str) -> Path:
    """An empty wheel that says 'NAME VERSION is installed' to the resolver (no files, no requirements)."""
    dist = re.sub(r"[-_.]+", "_", name)
    info = f"{dist}-{version}.dist-info"
    files = {
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        f"Summary: resolver stub written by scripts/wheelhouse.sh (present on the target; never installed)\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: wheelhouse.sh\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    path = directory / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        record = []
        for n, t in files.items():
            data = t.encode()
            z.writestr(n, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{n},sha256={digest},{len(data)}")
        record.append(f"{info}/RECORD,,")
        z.writestr(f"{info}/RECORD", "\n".join(record) + "\n")
    return path


def cmd_retag(a):
    for w in a.wheels:
        retag_if_pure(Path(w))


def retag_if_pure(path: Path) -> Path:
    """Pure Python (Root-Is-Purelib, no compiled files) but tagged for one interpreter -> py3-none-any."""
    name, ver, pyt, abi, plat = path.name[:-4].split("-")[:2] + path.name[:-4].split("-")[-3:]
    if (pyt, abi, plat) == ("py3", "none", "any"):
        print(f"{path.name}: already py3-none-any")
        return path
    with zipfile.ZipFile(path) as z:
        names = z.namelist()
        wheel_file = [n for n in names if re.fullmatch(r"[^/]+\.dist-info/WHEEL", n)][0]
        wheel_text = z.read(wheel_file).decode()
        compiled = [n for n in names if re.search(r"\.(so|pyd|dylib)(\.|$)", n)]
        pure = re.search(r"^Root-Is-Purelib:\s*true", wheel_text, re.M | re.I) is not None
        if compiled or not pure:
            die(f"{path.name} is tagged {pyt}-{abi}-{plat} and is not pure Python "
                f"(Root-Is-Purelib {pure}, compiled files {compiled[:3]}): it can only be built for the target")
        new_wheel = re.sub(r"^Tag:.*\n?", "", wheel_text, flags=re.M).rstrip("\n") + "\nTag: py3-none-any\n"
        new_path = path.with_name(f"{name}-{ver}-py3-none-any.whl")
        with zipfile.ZipFile(new_path, "w", zipfile.ZIP_DEFLATED) as out:
            record_name = None
            for info in z.infolist():
                if info.filename.endswith(".dist-info/RECORD"):
                    record_name = info.filename
                    continue
                data = new_wheel.encode() if info.filename == wheel_file else z.read(info)
                out.writestr(info, data)
            rows = list(csv.reader(io.StringIO(z.read(record_name).decode())))
            buf = io.StringIO()
            wr = csv.writer(buf, lineterminator="\n")
            for row in rows:
                if row and row[0] == wheel_file:
                    digest = base64.urlsafe_b64encode(hashlib.sha256(new_wheel.encode()).digest()).rstrip(b"=")
                    row = [wheel_file, f"sha256={digest.decode()}", str(len(new_wheel.encode()))]
                wr.writerow(row)
            out.writestr(record_name, buf.getvalue())
    path.unlink()
    print(f"{path.name}: pure Python, retagged -> {new_path.name}")
    return new_path


# --------------------------------------------------------------------------------------------- present list
def read_present(files: list[str], minimal: bool) -> dict[str, str | None]:
    """name -> version (None when unknown). Accepts `pip list --format=freeze` / `pip freeze` output or bare names."""
    present: dict[str, str | None] = {}
    if minimal:
        for n in H200_PRESENT_NAMES:
            present[cname(n)] = None
        for n, v in H200_PRESENT_VERSIONS.items():
            present[cname(n)] = v
    for f in files:
        for raw in Path(f).read_text().splitlines():
            line = raw.split("#", 1)[0].strip()
            if not line or line.startswith("-"):
                continue
            m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:===?\s*(\S+))?", line)
            if m:
                present[cname(m.group(1))] = m.group(2)
                continue
            m = re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?\s*@", line)
            if m:  # `name @ url`: present, version unknown
                present.setdefault(cname(m.group(1)), None)
                continue
            m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)\s+(\S+)", line)  # `pip list` columns
            if m and m.group(1).lower() != "package" and not set(m.group(2)) <= {"-"}:
                present[cname(m.group(1))] = m.group(2)
                continue
            die(f"{f}: cannot read line {raw!r} (want NAME, NAME==VERSION or `pip list` columns)")
    return present


# --------------------------------------------------------------------------------------------- plan
def run_resolver(a, roots: list[str], find_links: list[Path], constraints: Path, report: Path, platforms):
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
           "--report", str(report), "--only-binary=:all:", "--python-version", a.python,
           "--implementation", "cp", "--target", str(report.parent / "target"), "-c", str(constraints)]
    for p in platforms:
        cmd += ["--platform", p]
    for fl in find_links:
        cmd += ["--find-links", str(fl)]
    cmd += roots
    proc = subprocess.run(cmd, capture_output=True, text=True)
    err = "\n".join(l for l in proc.stderr.splitlines() if "is ignored: it is neither a file nor" not in l)
    if proc.returncode != 0:
        print(err, file=sys.stderr)
        die("pip could not resolve the dependencies for the target (above). A package the target has at a version "
            "that conflicts shows up here: correct or drop its line in the --skip-present list.")
    return json.loads(report.read_text())


def cmd_plan(a):
    work = Path(a.work)
    stubs = work / "stubs"
    stubs.mkdir(parents=True, exist_ok=True)
    local = Path(a.local_dir)
    platforms = expand_platforms(a.platform)
    env = target_env(a.python, platforms)

    present = read_present(a.skip_present, a.minimal)
    for n in a.carry:  # carried although the target has it (its version there is too old, say)
        present.pop(cname(n), None)
    excluded = list(MAMBA3_GROUP if not a.with_mamba3 else ()) + list(TORCH_GROUP if not a.with_torch else ())

    # Roots: the project's requirements (dependencies + gpu extra) for the target's markers.
    roots = [r for r in project_requirements(Path(a.pyproject)) if applies(r, env)]
    local_wheels = {}  # canonical name -> (path, version, requires)
    for w in sorted(local.glob("*.whl")):
        n, v, reqs = wheel_metadata(w)
        local_wheels[cname(n)] = (w, v, reqs)
    resolver_roots: list[Requirement] = []
    carried_local = {}
    dropped: dict[str, set] = {}  # excluded requirements of the wheels built here -> who wanted them
    dropped_wants: dict[str, set] = {}
    for r in roots:
        n = cname(r.name)
        if n in local_wheels and n in {"mamba-ssm", "causal-conv1d"}:
            w, v, reqs = local_wheels[n]
            if v not in r.specifier:
                die(f"{w.name} is version {v}, pyproject wants {r}")
            carried_local[n] = (w, v)
            # Its requirements become roots (minus the excluded groups); the wheel itself is not re-resolved.
            for q in map(Requirement, reqs):
                if not applies(q, env, r.extras):
                    continue
                if matches(q.name, excluded):
                    dropped.setdefault(cname(q.name), set()).add(n)
                    dropped_wants.setdefault(cname(q.name), set()).add(str(q.specifier) or "any")
                else:
                    resolver_roots.append(q)
        elif n == "causal-conv1d":
            note("causal-conv1d left out (CUDA build; pass --with-causal-conv1d). Mamba-2 runs without it.")
        else:
            resolver_roots.append(r)

    # Stubs for what the target has at a known version, and for torch/triton when they are not carried.
    stub_versions: dict[str, str] = {}
    for n, v in present.items():
        if v:
            stub_versions[n] = v
    if not a.with_torch:
        # The cluster's torch/triton: --torch-version, else the skip list, else the build interpreter's.
        for n, explicit, local_v in (("torch", a.torch_version, a.local_torch_version),
                                     ("triton", a.triton_version, a.local_triton_version)):
            v = explicit or stub_versions.get(n) or local_v
            if not v:
                die(f"no {n} version to resolve against: pass --{n}-version (the cluster's {n})")
            stub_versions[n] = v
            note(f"resolving against {n}=={v} (not carried)")
    constraints = work / "constraints.txt"
    lines = []
    for n, v in sorted(stub_versions.items()):
        pub = v.split("+")[0]
        try:
            Version(v)
        except Exception:
            die(f"present version {n}=={v} is not a PEP 440 version")
        stub_v = v if "+" in v else f"{v}+{STUB_LOCAL}"
        write_stub_wheel(stubs, n, stub_v)
        lines.append(f"{n}=={pub}" if "+" not in v else f"{n}=={v}")
    constraints.write_text("\n".join(lines) + "\n")

    extra_roots: list[str] = []
    for attempt in range(5):
        texts = [str(r) for r in resolver_roots] + extra_roots
        report = run_resolver(a, texts, [local, stubs], constraints, work / f"report{attempt}.json", platforms)
        nodes = {}
        for item in report["install"]:
            md = item["metadata"]
            url = item["download_info"]["url"]
            nodes[cname(md["name"])] = {
                "name": md["name"], "version": md["version"], "requires": md.get("requires_dist", []) or [],
                "url": url, "stub": url.startswith(stubs.resolve().as_uri() + "/"),
                "local": url.startswith(local.resolve().as_uri() + "/"),
            }
        # Closure for the TARGET's markers, stopping at what the target has or what is excluded.
        carry: dict[str, dict] = {}
        skipped_reached: dict[str, set] = {}
        missing: list[str] = []
        need = {}  # name -> list of (requirer, specifier) for the report
        queue = [("<pyproject>", q, frozenset(q.extras)) for q in resolver_roots]
        queue += [("<pyproject>", Requirement(t), frozenset()) for t in extra_roots]
        done: dict[str, set] = {}
        while queue:
            who, req, extras = queue.pop()
            n = cname(req.name)
            need.setdefault(n, []).append((who, str(req.specifier) or "any"))
            if n in present or matches(n, excluded) or n in carried_local:
                skipped_reached.setdefault(n, set()).add(who)
                continue
            if n not in nodes:
                missing.append(str(Requirement(str(req).split(";")[0])))
                continue
            node = nodes[n]
            have = done.setdefault(n, set())
            new = ({""} | set(req.extras)) - have
            if not new and n in carry:
                continue
            have |= new
            carry[n] = node
            for d in node["requires"]:
                q = Requirement(d)
                if any(q.marker is None or q.marker.evaluate(dict(env, extra=e)) for e in new):
                    queue.append((node["name"], q, frozenset(q.extras)))
        if not missing:
            break
        note(f"pip skipped {sorted(set(missing))} (its markers follow the interpreter running pip, "
             f"Python {sys.version_info.major}.{sys.version_info.minor}); resolving again with them as roots")
        extra_roots += sorted(set(missing) - set(extra_roots))
    else:
        die(f"the closure does not settle; still missing {missing}")

    for n, node in carry.items():
        if node["stub"]:
            die(f"internal: stub {n} reached as a carried package")
        ver = Version(node["version"])
        for who, spec in need.get(n, []):
            if spec != "any" and not SpecifierSet(spec).contains(ver, prereleases=True):
                die(f"{who} wants {n}{spec} but the resolver chose {node['version']}")

    plan = {"download": [], "local": [], "present": [], "excluded": []}
    for n, node in sorted(carry.items()):
        if node["local"]:
            path = Path(node["url"][len("file://"):]) if node["url"].startswith("file://") else None
            plan["local"].append({"name": node["name"], "version": node["version"], "path": str(path)})
        else:
            plan["download"].append({"name": node["name"], "version": node["version"],
                                     "file": node["url"].rsplit("/", 1)[-1]})
    for n, (w, v) in sorted(carried_local.items()):
        plan["local"].append({"name": n, "version": v, "path": str(w)})
    for n, whos in sorted(skipped_reached.items()):
        if n in carried_local:
            continue
        entry = {"name": n, "wanted_by": sorted(whos), "wants": sorted({s for _, s in need.get(n, [])})}
        if n in present:
            entry["version"] = present[n]
            plan["present"].append(entry)
        else:
            plan["excluded"].append(entry)
    for n, whos in sorted(dropped.items()):
        if n not in skipped_reached:
            plan["excluded"].append({"name": n, "wanted_by": sorted(whos), "wants": sorted(dropped_wants[n])})
    plan["unknown_present"] = sum(1 for e in plan["present"] if not e["version"])
    (work / "plan.json").write_text(json.dumps(plan, indent=1))
    (work / "download.txt").write_text("".join(f"{d['name']}=={d['version']}\n" for d in plan["download"]))

    print(f"Carried ({len(plan['download']) + len(plan['local'])}):")
    for d in plan["download"]:
        print(f"  {d['name']}=={d['version']}  ({d['file']})")
    for d in plan["local"]:
        print(f"  {d['name']}=={d['version']}  (built here: {Path(d['path']).name})")
    if plan["present"]:
        print("Left out, the target has them:")
        for e in plan["present"]:
            ver = e["version"] or "version unknown, assumed to satisfy"
            print(f"  {e['name']} ({ver}); wanted: {', '.join(e['wants'])}")
    if plan["excluded"]:
        print("Left out on purpose (" + ("" if a.with_torch else "--with-torch; ")
              + ("" if a.with_mamba3 else "--with-mamba3") + "):")
        for e in plan["excluded"]:
            print(f"  {e['name']}; wanted by {', '.join(e['wanted_by'])}")


# --------------------------------------------------------------------------------------------- verify
def cmd_verify(a):
    d = Path(a.dir)
    platforms = expand_platforms(a.platform) + [f"linux_{target_env(a.python, a.platform)['platform_machine']}"]
    ok_tags = supported_tags(a.python, platforms)
    wheels = sorted(d.glob("*.whl"))
    if not wheels:
        die(f"no wheels in {d}")
    problems, names, total = [], {}, 0
    rows = []
    for w in wheels:
        name, ver, _, tags = parse_wheel_filename(w.name)
        tagset = {str(t) for t in tags}
        good = sorted(tagset & ok_tags)
        size = w.stat().st_size
        total += size
        rows.append((w.name, size, good[0] if good else "NOT INSTALLABLE"))
        if not good:
            problems.append(f"{w.name}: none of its tags {sorted(tagset)} installs on cp{a.python} {a.platform}")
        names.setdefault(name, []).append(w.name)
    for n, files in names.items():
        if len(files) > 1:
            problems.append(f"{n}: {len(files)} versions {files} (pip --no-index would refuse the install)")
    width = max(len(r[0]) for r in rows)
    for fname, size, tag in rows:
        print(f"  {fname:<{width}}  {size / 2**20:7.2f} MiB  {tag}")
    print(f"  {len(wheels)} wheels, {total / 2**20:.1f} MiB in total ({total} bytes)")
    (d / "requirements.txt").write_text(
        "".join(f"{parse_wheel_filename(w.name)[0]}=={parse_wheel_filename(w.name)[1]}\n" for w in wheels))
    if problems:
        for p in problems:
            print(f"wheelhouse: error: {p}", file=sys.stderr)
        sys.exit(1)


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
    """Rewrite causal-conv1d's setup.py so that the nvcc `-gencode` flags it appends are exactly
    `arch=compute_XX,code=sm_XX` for XX in archs.

    causal-conv1d 1.7.0 appends them as one block of `cc_flag.append("-gencode")` /
    `cc_flag.append("arch=compute_XX,code=sm_XX")` lines, some under `if bare_metal_version >= Version("..."):`
    (sm_75 ... sm_121 with CUDA 13). That whole block, the ifs included, is replaced by the same kind of lines for
    archs only; everything else is kept. Anything unexpected (no such block, a line inside it of another kind, an
    `if` whose body goes on past the block, gencode flags elsewhere in the file) raises GencodeError naming the file,
    rather than letting a future version build all its architectures silently. torch's cpp_extension adds no
    architecture flags of its own when the nvcc flags already name one (`arch` in a flag), so these are the only
    ones compiled."""
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
    """Unpack SDIST into DEST (refusing paths outside it), check its PKG-INFO against the pin, return its folder."""
    req, pin = pinned(spec)
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "r:gz") as t:
        members = t.getmembers()
        tops = {m.name.split("/")[0] for m in members}
        if len(tops) != 1:
            die(f"{path.name}: expected one top folder, found {sorted(tops)[:5]}")
        for m in members:
            if m.name.startswith("/") or ".." in m.name.split("/") or m.issym() or m.islnk() or m.isdev():
                die(f"{path.name}: refusing member {m.name!r} (absolute, '..', link or device)")
        if hasattr(tarfile, "data_filter"):
            t.extractall(dest, filter="data")
        else:
            t.extractall(dest)
    src = dest / tops.pop()
    pkg_info = src / "PKG-INFO"
    if not pkg_info.is_file():
        die(f"{path.name}: no PKG-INFO in {src.name}/: not an sdist")
    name, version, _ = core_metadata(pkg_info.read_text(encoding="utf-8"))
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

    s = sub.add_parser("spec")
    s.add_argument("name")
    s.add_argument("--pyproject", default="pyproject.toml")
    s.set_defaults(fn=cmd_spec)

    s = sub.add_parser("sdist-only")
    s.set_defaults(fn=lambda a: print("\n".join(SDIST_ONLY_PURE)))

    s = sub.add_parser("plan")
    s.add_argument("--pyproject", default="pyproject.toml")
    s.add_argument("--python", required=True)
    s.add_argument("--platform", action="append", required=True)
    s.add_argument("--local-dir", required=True, help="wheels built here (mamba-ssm, sdist-only deps, ...)")
    s.add_argument("--work", required=True)
    s.add_argument("--skip-present", action="append", default=[])
    s.add_argument("--minimal", action="store_true")
    s.add_argument("--carry", action="append", default=[])
    s.add_argument("--with-torch", action="store_true")
    s.add_argument("--with-mamba3", action="store_true")
    s.add_argument("--torch-version", default="")
    s.add_argument("--triton-version", default="")
    s.add_argument("--local-torch-version", default="")
    s.add_argument("--local-triton-version", default="")
    s.set_defaults(fn=cmd_plan)

    s = sub.add_parser("retag")
    s.add_argument("wheels", nargs="+")
    s.set_defaults(fn=cmd_retag)

    s = sub.add_parser("verify")
    s.add_argument("dir")
    s.add_argument("--python", required=True)
    s.add_argument("--platform", action="append", required=True)
    s.set_defaults(fn=cmd_verify)

    s = sub.add_parser("expand-platforms")
    s.add_argument("platform", nargs="+")
    s.set_defaults(fn=lambda a: print(" ".join(expand_platforms(a.platform))))

    s = sub.add_parser("check-site")
    s.add_argument("site")
    s.set_defaults(fn=cmd_check_site)

    s = sub.add_parser("cuda-archs")
    s.add_argument("archs")
    s.set_defaults(fn=cmd_cuda_archs)

    s = sub.add_parser("check-sdist")
    s.add_argument("sdist")
    s.add_argument("--spec", required=True)
    s.set_defaults(fn=cmd_check_sdist)

    s = sub.add_parser("prepare-sdist")
    s.add_argument("sdist")
    s.add_argument("--spec", required=True)
    s.add_argument("--dest", required=True)
    s.add_argument("--cuda-arch", default="")
    s.set_defaults(fn=cmd_prepare_sdist)

    a = p.parse_args(argv)
    a.fn(a)


if __name__ == "__main__":
    main()
