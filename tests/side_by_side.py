"""Run independent test subprocesses side by side. Each is one thread (``OMP_NUM_THREADS=1``), so on a machine
of two cores two of them take about the time of one; a fixture runs them and several tests assert on them."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable

PARALLEL = max(2, min(4, os.cpu_count() or 2))


def side_by_side(jobs: dict[str, Callable[[], subprocess.Popen]], *, parallel: int = PARALLEL,
                 timeout: float = 300) -> dict[str, int]:
    """Start each job (a function that starts one process), ``parallel`` at a time, and wait for all of them;
    returns their exit statuses. ``timeout``: seconds for each process; on one, every process is killed."""
    pending, running, codes = list(jobs.items()), {}, {}
    try:
        while pending or running:
            while pending and len(running) < parallel:
                name, start = pending.pop(0)
                running[name] = (start(), time.time())
            for name, (p, t0) in list(running.items()):
                if p.poll() is not None:
                    codes[name] = p.returncode
                    del running[name]
                elif time.time() - t0 > timeout:
                    raise subprocess.TimeoutExpired(p.args, timeout)
            time.sleep(0.02)
    finally:
        for p, _ in running.values():
            p.kill()
            p.wait()
    return codes


def captured(args: list[str], out: Path, *, cwd: Path, env: dict, **popen) -> Callable[[], subprocess.Popen]:
    """A job running ``python args``, its stdout and stderr in ``out.stdout`` / ``out.stderr``."""
    def start() -> subprocess.Popen:
        with open(f"{out}.stdout", "w") as so, open(f"{out}.stderr", "w") as se:
            return subprocess.Popen([sys.executable, *args], cwd=cwd, env=env, stdout=so, stderr=se, **popen)
    return start


def completed(out: Path, returncode: int) -> subprocess.CompletedProcess:
    """What ``subprocess.run(..., capture_output=True, text=True)`` returns, for a job of :func:`captured`."""
    return subprocess.CompletedProcess([], returncode, Path(f"{out}.stdout").read_text(),
                                       Path(f"{out}.stderr").read_text())


def in_threads(jobs: dict[str, Callable[[], object]], *, parallel: int = PARALLEL) -> dict[str, Future]:
    """Run each job (a function that runs processes one after another and returns what the tests check) in
    a thread, ``parallel`` at a time, and wait for all of them: ``{name: future}``; ``.result()`` re-raises a
    job's error."""
    with ThreadPoolExecutor(parallel) as pool:
        return {name: pool.submit(job) for name, job in jobs.items()}


def for_selected_tests(request, jobs: dict[str, Callable[[], object]], **kw) -> dict[str, Future]:
    """:func:`in_threads` of the jobs keyed by the name of a test function this session runs (``-k`` or a
    node id: only those)."""
    names = {getattr(item, "originalname", item.name) for item in request.session.items}
    return in_threads({name: job for name, job in jobs.items() if name in names}, **kw)
