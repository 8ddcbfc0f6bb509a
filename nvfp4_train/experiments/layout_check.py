"""Multi-GPU check: the same training continues identically under other parallel layouts, a checkpoint saved
under one layout resumes under another, and tokens/s per layout (scaling from 1 GPU to the world size).

1. The reference: ``train.py`` on one process for ``--steps`` steps, saving a checkpoint at ``--save-at``.
2. Every other layout resumes a checkpoint (``checkpoint.resume=<step dir>``) under torchrun with its TP/PP/DP
   (and sequence parallelism) and trains to ``--steps``; its per-step losses are compared with the
   reference's (megatron reshards the model and the optimizer state; the data order follows the consumed
   samples). ``NAME`` resumes the reference's step ``--save-at``; ``NAME:FROM`` resumes the checkpoint that
   layout ``FROM`` saved at step ``--save-at2`` (``FROM`` must come earlier in ``--layouts``), i.e. a
   checkpoint written under one multi-GPU layout continues under another.
3. Tokens/s of each layout: the median over its steps after resuming, without the first (it warms up).

``--concurrent`` starts every layout whose checkpoint exists at once, in waves (the layouts resuming the reference,
then those resuming them): the loss check is the same, the tokens/s are not a throughput (the runs share the GPUs),
and the compile and autotune caches warm up in parallel; a sequential run afterwards measures clean tokens/s.
``--prewarm`` first trains every layout (the reference's too) from scratch for one step, all at once, without a
checkpoint: the kernels compile and autotune in parallel (on a fresh machine the largest cost, ~115 s for the
``small`` hybrid on an H200, and a PP=2 process compiles its own set), so the checked runs start warm, one at a
time, and their tokens/s stay clean.

A layout is ``1`` (one process) or tpN / ppN / dpN parts with an optional ``sp`` (sequence parallelism, with
TP), e.g. ``tp2``, ``tp2sp``, ``tp2pp2``; the world size is the product. Extra Hydra overrides after ``--`` go
to every run. The global batch is the same for every layout (DP divides the gradient-accumulation steps), so
tokens/s across layouts is strong scaling.

    python3 scripts/layout_check.py --out runs/layout --layouts 1 tp2 pp2 dp2:tp2 -- model=small precision=nvfp4
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository root

_PART = re.compile(r"(tp|pp|dp)(\d+)|(sp)")


@dataclass(frozen=True)
class Layout:
    name: str
    tp: int = 1
    pp: int = 1
    dp: int = 1
    sp: bool = False
    resume_from: str | None = None  # another layout's name; None: the reference checkpoint

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp


def parse_layout(text: str) -> Layout:
    """``1``, or tpN/ppN/dpN parts and an optional ``sp``, optionally ``:FROM``."""
    name, _, src = text.partition(":")
    if name == "1":
        if src:
            raise ValueError(f"layout {text!r}: the one-process reference resumes nothing")
        return Layout("1")
    parts = list(_PART.finditer(name))
    if not parts or "".join(m.group(0) for m in parts) != name:
        raise ValueError(f"layout {text!r}: use '1' or tpN/ppN/dpN parts with an optional 'sp', e.g. tp2sp "
                         f"or tp2pp2, optionally ':FROM' (resume layout FROM's checkpoint)")
    sizes = {m.group(1): int(m.group(2)) for m in parts if m.group(1)}
    sp = any(m.group(3) for m in parts)
    if any(v < 1 for v in sizes.values()):
        raise ValueError(f"layout {text!r}: sizes must be >= 1")
    if sp and sizes.get("tp", 1) < 2:
        raise ValueError(f"layout {text!r}: sequence parallelism ('sp') needs tp >= 2")
    lay = Layout(name, sizes.get("tp", 1), sizes.get("pp", 1), sizes.get("dp", 1), sp, src or None)
    if lay.world == 1:
        raise ValueError(f"layout {text!r} has one process: that is the reference, '1'")
    return lay


@dataclass
class Launched:
    """A training run started in the background, its output going to ``log``."""

    proc: subprocess.Popen
    log: object
    t_start: float

    def wait(self, timeout: float) -> int:
        """Its exit code, or -9 after killing it when it runs past ``timeout`` seconds from its start."""
        try:
            rc = self.proc.wait(timeout=max(self.t_start + timeout - time.time(), 0.0))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            rc = -9
        self.log.close()
        return rc


def start(cmd: list[str], log: Path, env: dict) -> Launched:
    print(" ".join(shlex.quote(c) for c in cmd), flush=True)
    f = open(log, "w")
    return Launched(subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env), f, time.time())


def tokens_per_s(recs: list[dict]) -> float:
    vals = [r["tokens_per_s"] for r in recs[1:] if r.get("tokens_per_s")]
    return statistics.median(vals) if vals else float("nan")


def compare(recs: list[dict], ref: dict[int, dict]) -> dict:
    """Largest relative loss and grad-norm differences to the reference over the same steps."""
    missing = [r["step"] for r in recs if r["step"] not in ref]
    if missing or not recs:
        return dict(error=f"steps {missing or 'none'} have no reference")
    rel = max(abs(r["loss"] - ref[r["step"]]["loss"]) / abs(ref[r["step"]]["loss"]) for r in recs)
    gn = [abs(r["grad_norm"] - ref[r["step"]]["grad_norm"]) / abs(ref[r["step"]]["grad_norm"])
          for r in recs if r.get("grad_norm") and ref[r["step"]].get("grad_norm")]
    return dict(max_rel=rel, max_rel_grad_norm=max(gn) if gn else float("nan"),
                losses=[(r["step"], r["loss"], ref[r["step"]]["loss"]) for r in recs])


def main() -> int:
    argv = sys.argv[1:]
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--layouts", nargs="+", default=["1", "tp2", "pp2", "dp2:tp2"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--save-at", type=int, default=8, help="the reference's checkpoint every layout resumes")
    ap.add_argument("--save-at2", type=int, help="the step at which layouts save the checkpoints that "
                    "'NAME:FROM' layouts resume (default: halfway between --save-at and --steps)")
    ap.add_argument("--rtol", type=float, default=1e-2,
                    help="relative loss difference allowed per step (TP/DP change bf16 summation orders; "
                         "stochastic rounding draws per local shard)")
    ap.add_argument("--run-timeout", type=float, default=1800, help="seconds per training run")
    ap.add_argument("--keep-checkpoints", action="store_true")
    ap.add_argument("--prewarm", action="store_true",
                    help="first train every layout (the reference's too) from scratch for one step, all at once "
                         "(no checkpoint), so that kernels compile and autotune in parallel and the checked runs "
                         "start warm; sets TRITON_CACHE_AUTOTUNING=1 unless set")
    ap.add_argument("--concurrent", action="store_true",
                    help="start every layout whose checkpoint exists at once (waves); losses are checked, tokens/s "
                         "are not a throughput (shared GPUs)")
    ap.add_argument("--ckpt-root", type=Path, help="write each layout's checkpoints under this folder instead of "
                    "its run folder (e.g. /dev/shm: a 1.2B checkpoint with its optimizer state is ~17 GB)")
    a = ap.parse_args(argv)
    from nvfp4_train.metrics import load_metrics

    layouts = [parse_layout(t) for t in a.layouts]
    if layouts[0].name != "1" or any(lay.name == "1" for lay in layouts[1:]):
        ap.error("the first layout must be the reference '1' (and only the first)")
    names = [lay.name for lay in layouts]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        ap.error(f"layout {', '.join(twice)} given twice (with different sources?): each layout runs in its own "
                 f"folder named after it; e.g. resume another layout's checkpoint under tp2sp instead of tp2")
    for i, lay in enumerate(layouts):
        if lay.resume_from is not None and lay.resume_from not in names[1:i]:
            ap.error(f"layout {lay.name}:{lay.resume_from}: {lay.resume_from} must be an earlier multi-process "
                     f"layout")
    save2 = a.save_at2 if a.save_at2 is not None else (a.save_at + a.steps) // 2
    if not 0 < a.save_at < save2 < a.steps:
        ap.error(f"need 0 < --save-at ({a.save_at}) < --save-at2 ({save2}) < --steps ({a.steps})")
    sources = {lay.resume_from for lay in layouts if lay.resume_from}
    ckpt_root = a.ckpt_root if a.ckpt_root is not None else a.out

    def ckpt_dir(name: str) -> Path:
        return ckpt_root / name / "checkpoints"

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    quiet = ["logging.wandb=disabled", "logging.tensorboard=false", "logging.progress=lines",
             "checkpoint.save_at_end=false"]
    common = [f"schedule.train_steps={a.steps}", *quiet, *extra]
    if a.prewarm:
        env.setdefault("TRITON_CACHE_AUTOTUNING", "1")  # autotuning results on disk, shared by later processes

    def torchrun(lay: Layout, overrides: list[str]) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={lay.world}",
                "train.py", *overrides, f"parallel.tp={lay.tp}", f"parallel.pp={lay.pp}",
                f"parallel.sequence_parallel={str(lay.sp).lower()}"]

    if a.prewarm:
        # one step of every distinct layout (the reference's included) from scratch, all at once, before the
        # timed runs: the run length keys of the extra overrides are replaced (one step, no warmup or decay),
        # everything that shapes the kernels is kept. A failed warm-up only costs the checked run its compiles.
        short = [x for x in extra if not x.startswith(("schedule.train_", "schedule.warmup_", "schedule.decay_"))]
        warm: list[tuple[str, Launched]] = []
        seen: set[tuple] = set()
        for lay in layouts:
            if (lay.tp, lay.pp, lay.dp, lay.sp) in seen:
                continue
            seen.add((lay.tp, lay.pp, lay.dp, lay.sp))
            d = a.out / "prewarm" / lay.name
            d.mkdir(parents=True, exist_ok=True)
            overrides = ["schedule.train_steps=1", "schedule.warmup_steps=0", "schedule.decay_fraction=0",
                         *quiet, "checkpoint.interval=0", "checkpoint.save_on_signal=false",
                         f"checkpoint.dir={d / 'checkpoints'}", *short, f"experiment.run_dir={d}",
                         f"experiment.name=prewarm_{lay.name}"]
            cmd = [sys.executable, "train.py", *overrides] if lay.world == 1 else torchrun(lay, overrides)
            warm.append((lay.name, start(cmd, d / "stdout.log", env)))
        for name, run in warm:
            wrc = run.wait(a.run_timeout)
            print(f"prewarm {name}: " + ("done" if wrc == 0 else f"exit {wrc}, see {a.out / 'prewarm' / name}")
                  + f", {time.time() - run.t_start:.0f} s", flush=True)
    ref_dir = a.out / "1"
    ref_dir.mkdir(parents=True, exist_ok=True)
    ref_run = start([sys.executable, "train.py", *common, f"checkpoint.interval={a.save_at}",
                     f"checkpoint.dir={ckpt_dir('1')}", f"experiment.run_dir={ref_dir}", "experiment.name=layout_1"],
                    ref_dir / "stdout.log", env)
    rc = ref_run.wait(a.run_timeout)
    if rc != 0:
        print(f"reference run failed ({rc}); see {ref_dir / 'stdout.log'}")
        return 1
    ref_recs = load_metrics(ref_dir)
    ref = {r["step"]: r for r in ref_recs}
    results = [dict(layout="1", gpus=1, resumed="-", max_rel=0.0, max_rel_grad_norm=0.0,
                    tokens_per_s=tokens_per_s([r for r in ref_recs if r["step"] > a.save_at]),
                    wall_s=time.time() - ref_run.t_start)]
    print(f"layout 1: {results[0]['tokens_per_s']:,.0f} tokens/s, {results[0]['wall_s']:.0f} s", flush=True)
    (a.out / "layout_check.json").write_text(json.dumps(results, indent=1))
    ok = True

    def resume_point(lay: Layout) -> tuple[str, int]:
        """The layout whose checkpoint ``lay`` resumes, and its step."""
        return (lay.resume_from, save2) if lay.resume_from else ("1", a.save_at)

    def launch(lay: Layout) -> Launched:
        d = a.out / lay.name
        d.mkdir(parents=True, exist_ok=True)
        src, step = resume_point(lay)
        cmd = torchrun(lay, [*common, f"checkpoint.resume={ckpt_dir(src) / f'step_{step:07d}'}",
                             f"checkpoint.interval={save2 if lay.name in sources else 0}",
                             f"checkpoint.dir={ckpt_dir(lay.name)}", f"experiment.run_dir={d}",
                             f"experiment.name=layout_{lay.name}"])
        return start(cmd, d / "stdout.log", env)

    def finish(lay: Layout, run: Launched) -> dict:
        rc = run.wait(a.run_timeout)
        d = a.out / lay.name
        src, step = resume_point(lay)
        row = dict(layout=lay.name, gpus=lay.world, resumed=f"{src} @ {step}", wall_s=time.time() - run.t_start,
                   shared_gpus=a.concurrent)
        if rc != 0:
            row["error"] = f"exit {rc}, see {d / 'stdout.log'}"
        else:
            recs = [r for r in load_metrics(d) if r["step"] > step]
            row.update(compare(recs, ref), tokens_per_s=tokens_per_s(recs))
        return row

    # sequential: one run at a time (tokens/s are clean). --concurrent: every layout whose checkpoint exists
    # starts at once, in waves (layouts resuming the reference, then those resuming them, ...): the losses are
    # still checked, the tokens/s are not a throughput (the runs share the GPUs), and compile/autotune caches
    # warm up in parallel.
    pending = list(layouts[1:])
    done: set[str] = set()
    while pending:
        if a.concurrent:
            wave = [lay for lay in pending if lay.resume_from is None or lay.resume_from in done]
        else:
            wave = pending[:1]
        pending = [lay for lay in pending if lay not in wave]
        running = [(lay, launch(lay)) for lay in wave]
        for lay, run in running:
            row = finish(lay, run)
            done.add(lay.name)
            ok &= "error" not in row and row["max_rel"] <= a.rtol
            results.append(row)
            print(f"layout {lay.name}: " + (row.get("error") or
                  f"max rel loss diff {row['max_rel']:.2e}, {row['tokens_per_s']:,.0f} tokens/s")
                  + f", {row['wall_s']:.0f} s", flush=True)
            (a.out / "layout_check.json").write_text(json.dumps(results, indent=1))
    if not a.keep_checkpoints:
        import shutil

        for lay in layouts:
            shutil.rmtree(ckpt_dir(lay.name), ignore_errors=True)
    (a.out / "layout_check.json").write_text(json.dumps(results, indent=1))
    base = results[0]["tokens_per_s"]
    if a.concurrent:
        print("\n(--concurrent: the layouts shared the GPUs; their tokens/s are not a throughput)")
    print("\n| layout | GPUs | resumed from | max rel. loss diff vs 1 GPU | max rel. grad-norm diff | tokens/s "
          "| vs 1 GPU |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['layout']} | {r['gpus']} | {r['resumed']} | {r['error']} | | | |")
        else:
            print(f"| {r['layout']} | {r['gpus']} | {r['resumed']} | {r['max_rel']:.2e} | "
                  f"{r['max_rel_grad_norm']:.2e} | {r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / base:.2f}× |")
    print(f"\nall layouts within rtol {a.rtol}: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
