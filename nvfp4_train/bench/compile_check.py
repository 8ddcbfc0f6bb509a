"""Every Triton launch the kernel tests make, compiled for an NVIDIA GPU on a machine that has none.

The interpreter (``TRITON_INTERPRET=1``) runs the kernels' CPU paths; the GPU paths (``NATIVE``, ``NATIVE_CVT``,
``ASM``: the hardware conversions, inline PTX) and the Triton version of the GPU machine are only met there. This
tool closes part of that gap before a GPU is at hand:

1. ``record``: runs the Triton test tier under the interpreter with a recorder that writes, for every distinct
   launch, the kernel, its arguments' Triton types (a tensor's element type, ``i32``/``i64`` for integers), its
   constexpr values, the arguments the runtime would specialize as divisible by 16 and the launch options, one
   JSON object per line;
2. ``compile``: compiles each recorded launch for sm_``arch`` with the GPU-path flags switched on, with whatever
   Triton is imported (put another version first on ``PYTHONPATH``, e.g. the GPU machine's:
   ``pip install --target /tmp/triton36 triton==3.6.0``), in parallel processes, and reports every failure with
   Triton's message. Exit status 1 when one fails.

It checks that the kernels compile (front end, layouts, ``ptxas``), not what they compute: a GPU run still has
the last word. Usage (repo root)::

    python3 scripts/compile_check.py record --out launches.jsonl          # the Triton tier: ~5 min on 2 cores
    python3 scripts/compile_check.py record -- -m triton tests/kernels/test_fp8.py   # pytest arguments after --
    PYTHONPATH=/tmp/triton36 python3 scripts/compile_check.py compile launches.jsonl --jobs 2   # ~6 min on 2 cores
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

GPU_FLAGS = ("NATIVE", "NATIVE_CVT", "ASM")  # constexpr switches of the kernels' GPU paths
RECORD_ENV = "NVFP4_TRAIN_LAUNCH_RECORD"  # the recorder's output file, set by ``record`` for its pytest process


def _triton_type(v) -> tuple[str | None, bool]:
    """(Triton type or None for a constexpr-like value, divisible by 16 as the runtime would specialize it)."""
    import torch

    if isinstance(v, torch.Tensor):
        name = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64",
                torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8",
                torch.bool: "i1", torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"}[v.dtype]
        return "*" + name, v.data_ptr() % 16 == 0
    if isinstance(v, bool):
        return "i1", False
    if isinstance(v, int):
        return ("i32" if -2**31 <= v < 2**31 else "i64"), v != 0 and v % 16 == 0
    if isinstance(v, float):
        return "fp32", False
    return None, False


def launch_record(fn, args: tuple, kwargs: dict) -> dict:
    """What ``compile`` needs of one launch of the ``@triton.jit`` function ``fn`` (its Python function)."""
    sig = inspect.signature(fn)
    names = list(sig.parameters)
    bound = dict(zip(names, args))
    bound.update((k, v) for k, v in kwargs.items() if k in names)
    types, consts, div = {}, {}, []
    for n in names:
        p = sig.parameters[n]
        v = bound.get(n, p.default)
        ann = p.annotation if isinstance(p.annotation, str) else getattr(p.annotation, "__name__", "")
        t, d = _triton_type(v)
        if "constexpr" in ann or t is None:
            consts[n] = v if isinstance(v, (int, float, bool, str, type(None))) else str(v)
        else:
            types[n] = t
            if d:
                div.append(n)
    opts = {k: v for k, v in kwargs.items() if k not in names and isinstance(v, (int, float, bool, str))}
    return dict(module=fn.__module__, name=fn.__name__, types=types, consts=consts, div=div, opts=opts)


def install_recorder(out: Path) -> None:
    """Wrap the interpreter's launch so that every distinct launch is appended to ``out`` (then run as before)."""
    from triton.runtime import interpreter

    seen: set[str] = set()
    run = interpreter.InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        line = json.dumps(launch_record(self.fn, args, kwargs), sort_keys=True)
        if line not in seen:
            seen.add(line)
            with open(out, "a") as f:
                f.write(line + "\n")
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    interpreter.InterpretedFunction.run = recording_run


def pytest_configure(config) -> None:
    """pytest entry point (``-p nvfp4_train.bench.compile_check``): record into the file ``record`` named."""
    out = os.environ.get(RECORD_ENV)
    if out:
        install_recorder(Path(out))


def compile_launch(line: str, arch: int = 90) -> tuple[str, str | None]:
    """(kernel name, None if it compiled for sm_``arch`` with the GPU-path flags on, else Triton's message)."""
    import importlib

    from nvfp4_train.bench.sass import compile_for_gpu

    rec = json.loads(line)
    kernel = getattr(importlib.import_module(rec["module"]), rec["name"])
    consts = {n: (True if n in GPU_FLAGS else v) for n, v in rec["consts"].items()}
    opts = {k: v for k, v in rec["opts"].items() if k in ("num_warps", "num_stages", "enable_fp_fusion",
                                                            "enable_reflect_ftz")}
    try:
        compile_for_gpu(kernel, rec["types"], consts, rec["div"], arch, opts)
    except Exception as e:  # Triton's CompilationError and ptxas failures alike: reported, not raised
        return rec["name"], f"{type(e).__name__}: {e}\nconstexprs: {json.dumps(consts)}"
    return rec["name"], None


def _compile_one(job: tuple[str, int]) -> tuple[str, str | None]:
    try:
        return compile_launch(*job)
    except Exception as e:  # the kernel's module did not import, a record is malformed: one launch's failure
        return json.loads(job[0]).get("name", "?"), f"{type(e).__name__}: {e}"


def compile_all(lines: list[str], arch: int, jobs: int) -> tuple[Counter, list[tuple[str, str]]]:
    """(launches per kernel, [(kernel, message)] of those that failed) over distinct recorded launches."""
    from concurrent.futures import ProcessPoolExecutor

    lines = list(dict.fromkeys(lines))
    if jobs > 1:
        with ProcessPoolExecutor(jobs) as ex:
            results = list(ex.map(_compile_one, [(line, arch) for line in lines]))
    else:
        results = [_compile_one((line, arch)) for line in lines]
    return Counter(name for name, _ in results), [(n, m) for n, m in results if m is not None]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record", help="run the Triton tests under the interpreter, recording every launch")
    rec.add_argument("--out", type=Path, default=Path("launches.jsonl"))
    rec.add_argument("pytest_args", nargs="*", default=["-m", "triton", "tests"],
                     help="what pytest runs, after -- (default: -m triton tests)")
    com = sub.add_parser("compile", help="compile every recorded launch for an NVIDIA GPU")
    com.add_argument("launches", type=Path)
    com.add_argument("--arch", type=int, default=90, help="compute capability as an integer (90 = sm_90)")
    com.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    a = ap.parse_args(argv)
    if a.cmd == "record":
        a.out.unlink(missing_ok=True)
        env = dict(os.environ, TRITON_INTERPRET="1", **{RECORD_ENV: str(a.out.resolve())})
        rc = subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "nvfp4_train.bench.compile_check",
                              *a.pytest_args], env=env)
        n = len(a.out.read_text().splitlines()) if a.out.exists() else 0
        print(f"{n} distinct launches recorded in {a.out} (pytest exit status {rc})")
        return 0 if rc == 0 and n else 1
    import triton

    if not a.launches.is_file():
        print(f"compile_check: {a.launches} does not exist; write it first with `compile_check.py record --out "
              f"{a.launches}`", file=sys.stderr)
        return 2
    lines = a.launches.read_text().splitlines()
    sys.path.insert(0, os.getcwd())  # kernels defined in the tests (module ``tests...``): run from the repo root
    per_kernel, failed = compile_all(lines, a.arch, a.jobs)
    print(f"triton {triton.__version__}, sm_{a.arch}: {sum(per_kernel.values())} launches of {len(per_kernel)} "
          f"kernels, {len(failed)} failed to compile")
    for name, n in sorted(per_kernel.items()):
        bad = sum(1 for k, _ in failed if k == name)
        print(f"  {name}: {n}" + (f", {bad} FAILED" if bad else ""))
    shown = set()
    for name, msg in failed:
        head = msg.split("\nconstexprs:")[0]
        if (name, head) not in shown:  # one message per kernel and error
            shown.add((name, head))
            print(f"\n--- {name}\n{msg}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
