"""A kernel's launch configurations swept: each checked bit for bit against a reference, then timed.

The harness of ``nvfp4_train.bench.fp8_casts`` and ``nvfp4_train.bench.fp4_dequant``: per case it makes the inputs
once, computes the reference's outputs, then runs the library's default launch ("default": the call without launch
arguments) and each configuration of the case's sweep. A configuration whose outputs differ from the reference, or
that fails to compile, is reported and makes the sweep fail; the default launch must run. Time:
``triton.testing.do_bench`` median on the GPU (one wall-clock call on the CPU, a smoke test); GB/s counts the bytes
the case must move and is given as a fraction of the measured device-to-device copy bandwidth (bytes read +
written); "vs default" is each row's time over the default launch's.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

Config = tuple[int, int, int] | None  # (block_m, block_k, num_warps); None: the library's default launch


@dataclass(frozen=True)
class Case:
    """One input of a sweep: ``fields`` identify it in the JSON rows, ``cells`` in the printed table; ``make()``
    builds its inputs, ``reference(inputs)`` their expected outputs; ``nbytes`` is what a launch must move."""

    fields: dict
    cells: tuple[str, ...]
    make: Callable[[], object]
    reference: Callable[[object], object]
    configs: Sequence[Config]
    nbytes: int


def time_ms(fn, device: torch.device) -> float:
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    import time

    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def copy_bandwidth(device: torch.device, quick: bool) -> float:
    src = torch.empty((2**20 if quick else 2**29), dtype=torch.bfloat16, device=device).uniform_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device)
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9


def config_label(cfg: Config) -> str:
    return "default" if cfg is None else f"{cfg[0]}x{cfg[1]}, {cfg[2]}"


def run_sweep(cases: Sequence[Case], launch: Callable[[object, Config], object],
              same: Callable[[object, object], bool], header: Sequence[str], device: torch.device,
              quick: bool) -> tuple[list[dict], bool]:
    """Every case under the default launch and its configurations; prints a markdown table (``header``: the names
    of the cases' cells) and returns (rows, every check passed)."""
    copy_gbs = copy_bandwidth(device, quick)
    rows_out, ok = [], True
    print(f"device-to-device copy: {copy_gbs:.0f} GB/s (bytes read + written)\n")
    print("| " + " | ".join(header) + " | BM x BK, warps | us | GB/s | % of copy | vs default |")
    print("|" + "---|" * len(header) + "---|---:|---:|---:|---:|")
    for case in cases:
        inputs = case.make()
        ref = case.reference(inputs)
        base_us = None
        for cfg in [None, *case.configs]:
            label = config_label(cfg)
            row = {**case.fields, "launch": label}
            prefix = "| " + " | ".join(case.cells) + f" | {label} |"
            try:
                good = same(launch(inputs, cfg), ref)
                us = time_ms(lambda: launch(inputs, cfg), device) * 1e3 if good else None
            except Exception as e:  # noqa: BLE001 - a configuration that fails to compile (resources) is reported
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
                good = cfg is not None  # only the default launch must run
            else:
                if not good:
                    row["error"] = "outputs differ from the reference"
            if "error" in row:
                ok = ok and good
                print(f"{prefix} {row['error']} | | | |")
                rows_out.append(row)
                continue
            gbs = case.nbytes / (us * 1e-6) / 1e9
            base_us = base_us if base_us is not None else us
            row.update(us=us, gbs=gbs, copy_fraction=gbs / copy_gbs, vs_default=us / base_us)
            rows_out.append(row)
            print(f"{prefix} {us:.1f} | {gbs:.0f} | {100 * gbs / copy_gbs:.0f}% | {us / base_us:.2f} |", flush=True)
    return rows_out, ok


def sweep_main(argv, description: str, run: Callable[[argparse.Namespace], tuple[list[dict], bool]]) -> int:
    """The command line of a sweep: ``--quick`` (tiny shapes, two configurations each), ``--json``, ``--seed``."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--quick", action="store_true", help="tiny shapes, two configurations each (CPU smoke test)")
    ap.add_argument("--json", type=Path, help="also write the rows to this JSON file")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rows, ok = run(args)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0 if ok else 1
