"""Helpers of the trainer tests: run ``train.py`` with the GPTModel stand-in in a subprocess."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def build_test_tokens() -> Path:
    """Token files for the trainer tests (``<dir>/text_{train,validation}``), built once per machine from
    ``tests/data/sample_text.txt`` with the committed tokenizer: a clean clone (CI) has no ``data/`` folder,
    and the tests must not depend on ``make data``."""
    src = ROOT / "tests" / "data" / "sample_text.txt"
    tok = ROOT / "nvfp4_train" / "data" / "tokenizer.json"
    key = hashlib.sha256(src.read_bytes() + tok.read_bytes()).hexdigest()[:12]
    out = Path(tempfile.gettempdir()) / f"nvfp4_train_test_tokens_{key}"
    if (out / "done").exists():
        return out
    from nvfp4_train.data.prepare import prepare

    paragraphs = [p.strip() for p in src.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    n = len(paragraphs)
    docs = ["\n\n".join(paragraphs[(i + j) % n] for j in range(1 + i % 4)) for i in range(200)]
    tmp = Path(tempfile.mkdtemp(prefix="nvfp4_train_test_tokens_tmp_"))
    for name, part in (("train", docs[:180]), ("valid", docs[180:])):
        with open(tmp / f"{name}.jsonl", "w", encoding="utf-8") as f:
            for d in part:
                f.write(json.dumps({"text": d}) + "\n")
    prepare([tmp / "train.jsonl"], tmp / "text", valid_inputs=[tmp / "valid.jsonl"], log=lambda *a, **k: None)
    (tmp / "done").write_text("ok\n")
    try:
        os.replace(tmp, out)  # atomic; another process may have won the race, then its copy is used
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


_TOKENS = build_test_tokens()

# 4 blocks of a 32-wide GPT (the stand-in reads the sizes from cfg.model); the vocabulary must hold the
# committed tokenizer's 32768 ids. 32-token samples, 4 per step in 2 micro-batches.
TINY = [
    "experiment.model_provider=tests.trainer.standin:gpt_provider",
    "model.vocab_size=32768", "model.hidden_size=32", "model.ffn_hidden_size=64", "model.kv_channels=8",
    "model.pattern=*-*-", "model.num_layers=4",
    "data=text_cpu", "data.seq_length=32",
    f"data.train_prefixes=[{_TOKENS / 'text_train'}]", f"data.valid_prefixes=[{_TOKENS / 'text_validation'}]",
    f"data.cache_dir={_TOKENS / 'index_cache'}",
    "schedule.global_batch_size=4", "schedule.micro_batch_size=2", "schedule.warmup_steps=2",
    "schedule.eval_interval=0", "schedule.eval_batches=1", "schedule.lr=1e-3",
    "checkpoint.interval=0",
    "logging.wandb=disabled", "logging.progress=lines", "logging.tensorboard=false",
]


RENDEZVOUS_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@contextlib.contextmanager
def one_process_environ():
    """``setup_parallel`` writes the one-process rendezvous into ``os.environ``: undo it when the block ends (the
    ``one_process_env`` fixtures of the in-process trainer tests)."""
    saved = {k: os.environ.pop(k) for k in RENDEZVOUS_KEYS if k in os.environ}
    try:
        yield
    finally:
        for k in RENDEZVOUS_KEYS:
            os.environ.pop(k, None)
        os.environ.update(saved)


def env(**extra) -> dict:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    e.setdefault("OMP_NUM_THREADS", "1")
    for k in RENDEZVOUS_KEYS:
        e.pop(k, None)
    e.update(extra)
    return e


def start(args: list[str], *, nproc: int = 1, log: Path, new_session: bool = False, **extra_env) -> subprocess.Popen:
    if nproc == 1:
        cmd = [sys.executable, str(ROOT / "train.py"), *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               str(ROOT / "train.py"), *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=env(**extra_env), stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=new_session)


def run(args: list[str], *, log: Path, timeout: float = 300, **kw) -> int:
    p = start(args, log=log, **kw)
    try:
        return p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        raise


def events(run_dir: Path, *names: str) -> list[dict]:
    """The event records of a run's ``metrics.jsonl`` in the order written; only those named ``names``, if given."""
    recs = (json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip())
    return [r for r in recs if r["type"] == "event" and (not names or r["event"] in names)]

def tail(log: Path, n: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-n:])
