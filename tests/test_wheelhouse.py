"""scripts/wheelhouse.sh's causal-conv1d options (--sdist, --cuda-arch, --only-causal-conv1d) and the helpers in
nvfp4_train/wheelhouse.py behind them and behind the resolution's inputs (what the target has -> uv's excludes,
constraints and dependency-metadata). CPU only, no network: neither uv, pip's index nor the CUDA build runs here."""

from __future__ import annotations

import ast
import io
import os
import re
import subprocess
import sys
import tarfile
import types
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from nvfp4_train import wheelhouse as wh

ROOT = Path(__file__).resolve().parents[1]

FIXTURE = ROOT / "tests" / "fixtures" / "causal_conv1d-1.7.0-setup-excerpt.py.txt"
PAIR = re.compile(r"arch=compute_(\w+),code=sm_(\w+)")
ALL_1_7_0_CUDA13 = ["75", "80", "87", "90", "100", "120", "103", "110", "121"]


def _setup_text() -> str:
    return FIXTURE.read_text()


def _cc_flags(text: str, cuda: str) -> list[str]:
    """Run the setup.py excerpt with stand-ins for torch and nvcc (CUDA `cuda`); its cc_flag list."""
    ns = {
        "torch": types.SimpleNamespace(__version__="2.11.0", version=types.SimpleNamespace(hip=None)),
        "SKIP_CUDA_BUILD": False, "CUDA_HOME": "/usr/local/cuda", "PACKAGE_NAME": "causal_conv1d",
        "Version": Version, "check_if_cuda_home_none": lambda name: None,
        "get_cuda_bare_metal_version": lambda cuda_dir: ("", Version(cuda)),
    }
    exec(compile(text, str(FIXTURE), "exec"), ns)
    return ns["cc_flag"]


def test_fixture_is_causal_conv1d_1_7_0_with_its_nine_architectures(capsys):
    flags = _cc_flags(_setup_text(), "13.0")
    assert flags[0::2] == ["-gencode"] * 9
    assert [PAIR.fullmatch(f).group(1) for f in flags[1::2]] == ALL_1_7_0_CUDA13
    assert len(_cc_flags(_setup_text(), "12.4")) == 2 * 4  # sm_75/80/87/90 only before CUDA 12.8


@pytest.mark.parametrize("archs", [["90"], ["90", "100"], ["100", "90a"]])
@pytest.mark.parametrize("cuda", ["12.4", "13.0"])
def test_restrict_gencode_keeps_only_the_requested_architectures(archs, cuda, capsys):
    text = _setup_text()
    out = wh.restrict_gencode(text, archs, "setup.py")
    ast.parse(out)
    assert [m.groups() for m in PAIR.finditer(out)] == [(a, a) for a in archs]
    assert out.count('"-gencode"') == len(archs)
    assert "bare_metal_version >= Version" not in out  # the version ifs of the block went with it
    # Everything before and after the block is kept as it was.
    first = text.index('        cc_flag.append("-gencode")')
    last = text.index('code=sm_121")\n') + len('code=sm_121")\n')
    assert out.startswith(text[:first]) and out.endswith(text[last:])
    assert "bare_metal_version < Version(\"11.6\")" in out
    # And it runs: exactly these flags, whatever the CUDA version.
    assert _cc_flags(out, cuda) == [f for a in archs for f in ("-gencode", f"arch=compute_{a},code=sm_{a}")]


def test_restrict_gencode_fails_loudly_without_the_pattern():
    loop = ('cc_flag = []\nfor arch in ["80", "90"]:\n'
            '    cc_flag += ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]\n')
    for text in ("cc_flag = []\n", loop):
        with pytest.raises(wh.GencodeError, match=r"causal_conv1d-9\.9\.9/setup\.py: expected .*cc_flag\.append"
                                                  r"\(\"-gencode\"\).*Refusing"):
            wh.restrict_gencode(text, ["90"], "causal_conv1d-9.9.9/setup.py")


def test_restrict_gencode_fails_on_flags_outside_the_block_or_an_odd_block():
    text = _setup_text()
    stray = text + '\ncc_flag.append("-gencode")\ncc_flag.append("arch=compute_89,code=sm_89")\n'
    with pytest.raises(wh.GencodeError, match=r"setup\.py: .*more outside it at line .*sm_89"):
        wh.restrict_gencode(stray, ["90"], "setup.py")
    odd = text.replace('        cc_flag.append("arch=compute_80,code=sm_80")\n', "")  # two -gencode in a row
    with pytest.raises(wh.GencodeError, match=r"setup\.py:\d+-\d+: expected .*sequence"):
        wh.restrict_gencode(odd, ["90"], "setup.py")
    deeper = text.replace('            cc_flag.append("arch=compute_121,code=sm_121")\n',
                          '            cc_flag.append("arch=compute_121,code=sm_121")\n            x = 1\n')
    with pytest.raises(wh.GencodeError, match=r"indented deeper"):
        wh.restrict_gencode(deeper, ["90"], "setup.py")
    mismatched = text.replace("arch=compute_80,code=sm_80", "arch=compute_80,code=sm_86")
    with pytest.raises(wh.GencodeError, match=r"one XX"):
        wh.restrict_gencode(mismatched, ["90"], "setup.py")
    for bad in ([], ["9.0"], ["sm_90"]):
        with pytest.raises(ValueError):
            wh.restrict_gencode(text, bad, "setup.py")


def test_parse_cuda_archs():
    assert wh.parse_cuda_archs("90") == ["90"]
    assert wh.parse_cuda_archs("90, 100,90") == ["90", "100"]
    assert wh.parse_cuda_archs("90a,100f") == ["90a", "100f"]
    assert wh.arch_local_version(["90", "100"]) == "sm90.sm100"
    for bad in ("", "9.0", "sm_90", "90,", "compute_90", "9"):
        with pytest.raises(ValueError, match="--cuda-arch"):
            wh.parse_cuda_archs(bad)
    # The local label makes a valid version that the pyproject pin still accepts.
    assert Version("1.7.0+sm90.sm100") in SpecifierSet("==1.7.0")


def _sdist(directory: Path, filename: str, top: str, name: str, version: str, setup: str) -> Path:
    path = directory / filename
    with tarfile.open(path, "w:gz") as t:
        for member, text in ((f"{top}/PKG-INFO", f"Metadata-Version: 2.4\nName: {name}\nVersion: {version}\n\nx\n"),
                             (f"{top}/setup.py", setup)):
            data = text.encode()
            info = tarfile.TarInfo(member)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    return path


def test_prepare_sdist_unpacks_checks_and_restricts(tmp_path, capsys):
    sdist = _sdist(tmp_path, "causal_conv1d-1.7.0.tar.gz", "causal_conv1d-1.7.0", "causal_conv1d", "1.7.0",
                   _setup_text())
    wh.main(["prepare-sdist", str(sdist), "--spec", "causal-conv1d==1.7.0", "--dest", str(tmp_path / "src"),
             "--cuda-arch", "90"])
    src = Path(capsys.readouterr().out.strip())
    assert src == tmp_path / "src" / "causal_conv1d-1.7.0"
    assert [m.group(1) for m in PAIR.finditer((src / "setup.py").read_text())] == ["90"]
    # Without --cuda-arch the setup.py is left as it is.
    wh.main(["prepare-sdist", str(sdist), "--spec", "causal-conv1d==1.7.0", "--dest", str(tmp_path / "full")])
    assert (tmp_path / "full" / "causal_conv1d-1.7.0" / "setup.py").read_text() == _setup_text()


def test_prepare_sdist_refuses_a_wrong_sdist(tmp_path, capsys):
    spec = "causal-conv1d==1.7.0"
    old = _sdist(tmp_path, "causal_conv1d-1.6.0.tar.gz", "causal_conv1d-1.6.0", "causal_conv1d", "1.6.0", "")
    other = _sdist(tmp_path, "mamba_ssm-1.7.0.tar.gz", "mamba_ssm-1.7.0", "mamba_ssm", "1.7.0", "")
    zipped = tmp_path / "causal_conv1d-1.7.0.zip"
    zipped.write_bytes(b"")
    for bad in (old, other, zipped, tmp_path / "causal_conv1d-1.7.0.tar.gz"):
        with pytest.raises(SystemExit) as e:
            wh.main(["check-sdist", str(bad), "--spec", spec])
        assert e.value.code == 2
    assert "causal_conv1d-1.6.0.tar.gz is causal-conv1d 1.6.0, but pyproject pins causal-conv1d==1.7.0" \
        in capsys.readouterr().err
    # A renamed file: the name passes, its PKG-INFO does not.
    (tmp_path / "d").mkdir()
    renamed = _sdist(tmp_path / "d", "causal_conv1d-1.7.0.tar.gz", "causal_conv1d-1.6.0", "causal_conv1d", "1.6.0",
                     _setup_text())
    with pytest.raises(SystemExit):
        wh.main(["prepare-sdist", str(renamed), "--spec", spec, "--dest", str(tmp_path / "src")])
    assert "PKG-INFO says causal_conv1d 1.6.0" in capsys.readouterr().err
    # A setup.py without the known block: a loud error, not a build of every architecture.
    (tmp_path / "e").mkdir()
    future = _sdist(tmp_path / "e", "causal_conv1d-1.7.0.tar.gz", "causal_conv1d-1.7.0", "causal_conv1d", "1.7.0",
                    "cc_flag = []\n")
    with pytest.raises(SystemExit) as e:
        wh.main(["prepare-sdist", str(future), "--spec", spec, "--dest", str(tmp_path / "src2"), "--cuda-arch", "90"])
    assert e.value.code == 1
    assert "causal_conv1d-1.7.0.tar.gz:causal_conv1d-1.7.0/setup.py: expected" in capsys.readouterr().err


def _script(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, TMPDIR=str(tmp_path))
    return subprocess.run(["bash", str(ROOT / "scripts" / "wheelhouse.sh"), "--out", str(tmp_path / "out"), *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_script_validates_the_causal_conv1d_options(tmp_path):
    good = _sdist(tmp_path, "causal_conv1d-1.7.0.tar.gz", "causal_conv1d-1.7.0", "causal_conv1d", "1.7.0",
                  _setup_text())
    old = _sdist(tmp_path, "causal_conv1d-1.6.0.tar.gz", "causal_conv1d-1.6.0", "causal_conv1d", "1.6.0", "")
    cases = [
        (["--cuda-arch", "90"], "add --with-causal-conv1d"),
        (["--sdist", str(good)], "add --with-causal-conv1d"),
        (["--with-causal-conv1d", "--cuda-arch", "9.0"], "--cuda-arch wants compute capabilities"),
        (["--with-causal-conv1d", "--sdist", str(tmp_path / "nope.tar.gz")], "no such file"),
        (["--only-causal-conv1d", "--sdist", str(old)], "is causal-conv1d 1.6.0, but pyproject pins"),
        (["--platform", "win_amd64"], "--platform wants manylinux_2_N_x86_64"),
    ]
    for args, msg in cases:
        p = _script(args, tmp_path)
        assert p.returncode == 2, (args, p.stderr[-2000:])
        assert msg in p.stderr, (args, p.stderr[-2000:])
    assert "--sdist FILE" in _script(["--help"], tmp_path).stdout


def test_script_only_causal_conv1d_checks_the_build_prerequisites_first(tmp_path):
    """With valid options it gets to the CUDA prerequisites and stops there on this CPU machine, before any
    download or build (no network needed to get this far)."""
    sdist = _sdist(tmp_path, "causal_conv1d-1.7.0.tar.gz", "causal_conv1d-1.7.0", "causal_conv1d", "1.7.0",
                   _setup_text())
    pyver = "%d.%d" % sys.version_info[:2]
    p = _script(["--only-causal-conv1d", "--sdist", str(sdist), "--cuda-arch", "90", "--python", pyver,
                 "--build-python", sys.executable], tmp_path)
    import torch

    if torch.version.cuda is not None:
        pytest.skip("this interpreter has a CUDA torch: the prerequisites may pass")
    assert p.returncode == 1, p.stderr[-2000:]
    assert "needs a CUDA build of torch" in p.stderr
    assert "building" not in p.stderr and not list((tmp_path / "out").glob("*.whl"))


def test_script_reuses_only_a_wheel_of_the_same_architectures(tmp_path):
    pyver = "%d.%d" % sys.version_info[:2]
    tag = "cp%d%d" % sys.version_info[:2]
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / f"causal_conv1d-1.7.0+sm90-{tag}-{tag}-linux_x86_64.whl").write_bytes(b"")
    args = ["--only-causal-conv1d", "--python", pyver, "--build-python", sys.executable]
    p = _script([*args, "--cuda-arch", "90"], tmp_path)
    assert p.returncode == 0 and "is already in" in p.stderr, p.stderr[-2000:]
    p = _script(args, tmp_path)  # the full build is not the sm_90 one: it goes on to the build's prerequisites
    assert "is already in" not in p.stderr


def test_read_present_reads_freeze_lines(tmp_path, capsys):
    freeze = tmp_path / "freeze.txt"
    freeze.write_text("# pip list --format=freeze\nNumPy==2.5.2\ntorch==2.11.0+cu130\nfoo_bar\n"
                      "baz @ file:///wheels/baz-1.0-py3-none-any.whl\n-e git+https://x/y.git#egg=y\n\n")
    assert wh.read_present([str(freeze)], minimal=False) == {
        "numpy": "2.5.2", "torch": "2.11.0+cu130", "foo-bar": None, "baz": None}
    minimal = wh.read_present([str(freeze)], minimal=True)
    assert minimal["transformers"] == "5.17.0" and minimal["pyarrow"] is None and minimal["baz"] is None
    (tmp_path / "bad.txt").write_text("numpy 2.5.2\n")  # `pip list` columns: not a requirement line
    with pytest.raises(SystemExit):
        wh.read_present([str(tmp_path / "bad.txt")], minimal=False)
    assert "bad.txt: cannot read line 'numpy 2.5.2'" in capsys.readouterr().err


def test_uv_inputs_pins_known_versions_and_excludes_the_rest(capsys):
    present = {"numpy": "2.5.2", "Torch": "2.11.0+cu130", "triton": "3.6.0", "pyarrow": None,
               "typing_extensions": None, "nvidia-nccl-cu13": None}
    excludes, pins = wh.uv_inputs(present)
    assert pins == {"numpy": "2.5.2", "torch": "2.11.0", "triton": "3.6.0"}  # local label dropped
    assert excludes == sorted(["pyarrow", "typing-extensions", "nvidia-nccl-cu13", "causal-conv1d",
                               "tilelang", "apache-tvm-ffi", "quack-kernels"])
    # The explicit cluster versions win; --carry resolves a present package; the optional groups come back.
    excludes, pins = wh.uv_inputs(present, carry=["PyArrow", "numpy"], with_mamba3=True, with_causal_conv1d=True,
                                  torch_version="2.10.0", triton_version="3.5.1")
    assert pins == {"torch": "2.10.0", "triton": "3.5.1"}
    assert excludes == ["nvidia-nccl-cu13", "typing-extensions"]
    # --with-torch: torch, triton and the CUDA libraries are resolved and carried, not taken from the target.
    excludes, pins = wh.uv_inputs(present, with_torch=True)
    assert pins == {"numpy": "2.5.2"} and "nvidia-nccl-cu13" not in excludes
    with pytest.raises(SystemExit):
        wh.uv_inputs({"triton": "3.6.0"})
    assert "no torch version to resolve against: pass --torch-version" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        wh.uv_inputs({"numpy": "two", "torch": "2.11.0", "triton": "3.6.0"})
    assert "numpy==two is not a PEP 440 version" in capsys.readouterr().err


def test_inputs_command_writes_what_uv_pip_compile_reads(tmp_path, capsys):
    import tomllib

    wh.main(["inputs", "--work", str(tmp_path), "--minimal", "--local-torch-version", "2.13.0"])
    no_emit = capsys.readouterr().out.split()
    constraints = dict(line.split("==") for line in (tmp_path / "constraints.txt").read_text().splitlines())
    metadata = tomllib.loads((tmp_path / "uv.toml").read_text())["dependency-metadata"]
    assert constraints == {m["name"]: m["version"] for m in metadata} == {
        wh.cname(n): v for n, v in wh.H200_PRESENT_VERSIONS.items()}  # the image's torch, not the local one
    assert all(m["requires-dist"] == [] for m in metadata) and no_emit == list(constraints)
    excludes = (tmp_path / "excludes.txt").read_text().split()
    assert "pyarrow" in excludes and "causal-conv1d" in excludes and not set(excludes) & set(constraints)
