"""Training with CUDA graphs equals eager training bit for bit (one GPU, NVFP4 with stochastic rounding): the
same seed gives the same losses, gradient norms, validation losses and final parameters, across an evaluation
between steps, a precision switch (a new capture) and a resume; on two GPUs (NCCL), under DP=2 and TP=2 with
sequence parallelism, ``train.py``'s losses, gradient norms and validation losses.

Bitwise comparisons need deterministic kernels: the first test also runs eager twice and fails, saying so, when
those two differ. Attention and MLP blocks (``ATTN``) are deterministic on the H200; the hybrid model's Mamba
blocks are with ``MAMBA_DETERMINISTIC=1`` and without the causal-conv1d CUDA extension (whose backward sums with
atomics; docs/training.md, "First steps on a GPU")."""

from __future__ import annotations

import pytest
import torch

from nvfp4_train.config import compose_config
from nvfp4_train.metrics import load_metrics
from nvfp4_train.trainer import Trainer
from tests.trainer.runs import _TOKENS, events, run, tail
from tests.trainer.test_trainer_step import one_process_env  # noqa: F401 (a fixture)

pytestmark = pytest.mark.gpu

BASE = [
    "model=tiny", "precision=nvfp4", "data=text_cpu", "data.seq_length=128", "data.num_workers=0",
    f"data.train_prefixes=[{_TOKENS / 'text_train'}]", f"data.valid_prefixes=[{_TOKENS / 'text_validation'}]",
    f"data.cache_dir={_TOKENS / 'index_cache'}",
    # 2 micro-batches of 2 per step (gradient accumulation 2)
    "schedule.global_batch_size=4", "schedule.micro_batch_size=2", "schedule.warmup_steps=2",
    "schedule.eval_interval=0", "schedule.eval_batches=1", "schedule.lr=1e-3",
    "checkpoint.interval=0", "checkpoint.save_at_end=false",
    "logging.wandb=disabled", "logging.progress=lines", "logging.tensorboard=false",
]


ATTN = ["model.pattern=*-*-", "model.num_layers=4"]  # attention and MLP blocks only
MODELS = {"attention": ATTN, "hybrid": []}


def _cfg(run_dir, graph: str, *extra):
    return compose_config("train", [*BASE, f"schedule.cuda_graph={graph}", f"experiment.run_dir={run_dir}", *extra])


def _steps(t: Trainer, n: int, eval_after: tuple[int, ...] = ()) -> list:
    """``n`` steps, an evaluation after the steps in ``eval_after``: (loss, grad norm, skipped) per step and the
    validation losses."""
    rec = []
    for _ in range(n):
        out = t.train_step()
        rec.append((out.loss, None if out.grad_norm is None else float(out.grad_norm), out.skipped))
        if t.step in eval_after:
            rec.append(("val", t.evaluate()))
    return rec


def _state(t: Trainer) -> tuple[list[torch.Tensor], list[int]]:
    """The parameters and the stochastic-rounding call counts; the device counters checked against the counts."""
    from nvfp4_train.trainer import quant_rng_counters

    counts = list(quant_rng_counters(t.ddp.module).values())
    if t.cuda_graph is not None:
        for m in t.cuda_graph.layers:
            assert int(m.lctx.call_counter) == m.lctx.calls
    return [p.detach().cpu().clone() for p in t.ddp.module.parameters()], counts


def _same(a, b) -> None:
    """The same parameters (bitwise) and call counts; a failure names the parameters that differ."""
    assert len(a[0]) == len(b[0])
    differ = [f"#{i} {tuple(x.shape)}: {int((x != y).sum())} elements" for i, (x, y) in enumerate(zip(a[0], b[0]))
              if not torch.equal(x, y)]
    assert not differ, f"{len(differ)} of {len(a[0])} parameters differ: {differ[:6]}"
    assert a[1] == b[1]


def _first_step_differing(got: list, want: list) -> str:
    i = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), min(len(got), len(want)))
    return f"first difference at record {i}: {got[i:i + 1]} != {want[i:i + 1]} (got {len(got)}, want {len(want)})"


@pytest.mark.parametrize("model", sorted(MODELS))
def test_graphed_training_equals_eager(tmp_path, one_process_env, model):  # noqa: F811
    runs = []
    for name, graph in (("eager", "off"), ("eager2", "off"), ("graph", "on")):
        with Trainer(_cfg(tmp_path / name, graph, *MODELS[model])) as t:
            assert (t.cuda_graph is None) == (graph == "off")
            runs.append((_steps(t, 6, eval_after=(3,)), _state(t)))
            if graph == "on":
                assert t.cuda_graph.captures == 1
                assert t.cuda_graph.replays == 4  # steps 1, 2 eager (warm-up), 3 captured and replayed, 4-6 replayed
    (want, want_state), (again, again_state), (got, got_state) = runs
    assert again == want, "two eager runs differ: a nondeterministic kernel (see the module docstring)"
    _same(again_state, want_state)
    assert got == want, _first_step_differing(got, want)
    assert not any(r[-1] for r in got if r[0] != "val")
    _same(got_state, want_state)


def test_precision_switch_recaptures_and_equals_eager(tmp_path, one_process_env):  # noqa: F811
    switch = [*ATTN, "precision.switch.at_step=4", "precision.switch.mode=fprop_bf16"]
    with Trainer(_cfg(tmp_path / "eager", "off", *switch)) as e:
        want, want_state = _steps(e, 9), _state(e)
    with Trainer(_cfg(tmp_path / "graph", "on", *switch)) as g:
        got = _steps(g, 9)
        # steps 1-2 eager, 3 captured, 4 replayed; the switch at step 5: 5-6 eager, 7 captured, 8-9 replayed
        assert g.cuda_graph.captures == 2 and g.cuda_graph.replays == 5
        got_state = _state(g)
    assert got == want, _first_step_differing(got, want)
    _same(got_state, want_state)


@pytest.mark.parametrize("before,after", [("on", "on"), ("off", "on"), ("on", "off")])
def test_resume_equals_an_uninterrupted_run(tmp_path, one_process_env, before, after):  # noqa: F811
    """A run saved at step 3 and resumed ends where an uninterrupted eager run does: graphed and resumed graphed (the
    counts restored into the device counters), and across ``schedule.cuda_graph`` modes (an eager checkpoint
    resumed graphed, a graphed one resumed eager)."""
    with Trainer(_cfg(tmp_path / "eager", "off", *ATTN)) as e:
        want, want_state = _steps(e, 6), _state(e)
    with Trainer(_cfg(tmp_path / "run", before, *ATTN)) as t:
        first = _steps(t, 3)
        t.save()
    with Trainer(_cfg(tmp_path / "run", after, *ATTN)) as t:
        assert t.step == 3 and t.resumed_from and (t.cuda_graph is None) == (after == "off")
        rest = _steps(t, 3)
        got_state = _state(t)
    assert first + rest == want, _first_step_differing(first + rest, want)
    _same(got_state, want_state)


# two ranks over NCCL: the hybrid `tiny` data-parallel; attention and MLP blocks under TP=2 with sequence
# parallelism (TP collectives and the quantized layers' amax all-reduces inside the graph)
LAYOUTS = {"dp2": [], "tp2sp": [*ATTN, "parallel.tp=2", "parallel.sequence_parallel=true"]}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_two_gpus_graphed_training_equals_eager(tmp_path, layout):
    """``train.py`` on two GPUs, eager and graphed, 6 steps with an evaluation after step 3: the same losses,
    gradient norms and validation losses (as logged: a float's shortest round-trip repr, so bit for bit), and
    the graphed run captured once and replayed steps 3-6 (no fallback)."""
    runs = {}
    for graph in ("off", "on"):
        out, log = tmp_path / graph, tmp_path / f"{graph}.log"
        args = [*BASE, *LAYOUTS[layout], f"schedule.cuda_graph={graph}", "schedule.train_steps=6",
                "schedule.eval_interval=3", f"experiment.run_dir={out}"]
        rc = run(args, nproc=2, log=log, timeout=900, MAMBA_DETERMINISTIC="1")
        assert rc == 0, tail(log)
        train = [(r["step"], r["loss"], r["grad_norm"], r.get("skipped_steps")) for r in load_metrics(out)]
        evals = [(r["step"], r["val_loss"]) for r in load_metrics(out, "eval")]
        runs[graph] = (train, evals, events(out, "end", "cuda_graph_fallback"))
    (want, want_eval, eager_events), (got, got_eval, graph_events) = runs["off"], runs["on"]
    assert [s for s, *_ in want] == list(range(1, 7)) and [s for s, _ in want_eval] == [3, 6]
    assert [e["event"] for e in eager_events] == ["end"] and "cuda_graph_captures" not in eager_events[0]
    assert [e["event"] for e in graph_events] == ["end"], graph_events  # no fallback
    assert (graph_events[0]["cuda_graph_captures"], graph_events[0]["cuda_graph_replays"]) == (1, 4)
    assert got == want
    assert got_eval == want_eval
