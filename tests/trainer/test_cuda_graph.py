"""CUDA graphs in training, what runs on CPU: the fallback rules, the config switch, a CPU run of ``on`` (eager
with one warning), and the device counters the graphed step relies on (exact on CPU tensors too)."""

from __future__ import annotations

import warnings

import pytest
import torch
import yaml

from nvfp4_train.config import compose_config
from nvfp4_train.cuda_graph import enable_device_counters, fallback_reason, resolve_cuda_graph
from nvfp4_train.trainer import Trainer
from tests.trainer.runs import TINY
from tests.trainer.test_trainer_step import one_process_env  # noqa: F401 (a fixture)

OK = dict(device_type="cuda", pp=1, world_size=1, backend="nccl", overlap_grad_reduce=False,
          overlap_param_gather=False)


def test_a_supported_layout_has_no_reason():
    assert fallback_reason(**OK) is None
    assert fallback_reason(**{**OK, "world_size": 8}) is None  # DP and TP over NCCL


@pytest.mark.parametrize("change, words", [
    (dict(device_type="cpu"), "not on a CUDA device"),
    (dict(pp=2), "pipeline parallelism (parallel.pp=2)"),
    (dict(world_size=2, backend="gloo"), "gloo backend"),
    (dict(overlap_grad_reduce=True), "optim.overlap_grad_reduce=true"),
    (dict(overlap_param_gather=True), "optim.overlap_param_gather=true"),
])
def test_each_unsupported_feature_is_named(change, words):
    assert words in fallback_reason(**{**OK, **change})
    on, warning = resolve_cuda_graph("on", **{**OK, **change})
    assert not on and words in warning and "schedule.cuda_graph=on" in warning


def test_modes():
    assert resolve_cuda_graph("auto", **OK) == (True, None)
    assert resolve_cuda_graph("on", **OK) == (True, None)
    assert resolve_cuda_graph("off", **OK) == (False, None)
    assert resolve_cuda_graph("off", **{**OK, "pp": 2}) == (False, None)
    assert resolve_cuda_graph("auto", **{**OK, "device_type": "cpu"}) == (False, None)  # auto: off on CPU, silently
    on, warning = resolve_cuda_graph("auto", **{**OK, "pp": 2})  # a CUDA run that cannot: warned
    assert not on and "schedule.cuda_graph=auto" in warning
    with pytest.raises(ValueError, match="not one of"):
        resolve_cuda_graph("yes", **OK)


def test_config_field():
    cfg = compose_config("train", ["schedule.cuda_graph=off"])
    assert cfg.schedule.cuda_graph == "off"
    assert compose_config("train", []).schedule.cuda_graph == "auto"
    with pytest.raises(Exception, match="cuda_graph"):
        compose_config("train", ["schedule.cuda_graph=sometimes"])


def _cfg(run_dir, *extra):
    return compose_config("train", [*TINY, "schedule.train_steps=3", "checkpoint.save_at_end=false",
                                    "data.num_workers=0", f"experiment.run_dir={run_dir}", *extra])


def test_on_without_cuda_runs_eager_with_one_warning(tmp_path, one_process_env):  # noqa: F811
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        with Trainer(_cfg(tmp_path / "run", "schedule.cuda_graph=on")) as t:
            assert t.cuda_graph is None
            t.train_step()
    ours = [w for w in rec if "schedule.cuda_graph" in str(w.message)]
    assert len(ours) == 1 and "not on a CUDA device" in str(ours[0].message)
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["schedule"]["cuda_graph"] == "on"
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        with Trainer(_cfg(tmp_path / "auto")) as t:  # auto on CPU: off without a word
            assert t.cuda_graph is None
    assert not [w for w in rec if "schedule.cuda_graph" in str(w.message)]


class _Lctx:
    def __init__(self, calls):
        self.calls, self.call_counter = calls, None


def test_enable_device_counters_starts_from_the_host_counts(monkeypatch):
    layers = [type("L", (), {"lctx": _Lctx(c)})() for c in (0, 7, 2**40)]
    monkeypatch.setattr("nvfp4_train.cuda_graph.quant_layers", lambda module: layers)
    clock = enable_device_counters(torch.nn.Module(), torch.device("cpu"))
    assert [int(m.lctx.call_counter) for m in layers] == [0, 7, 2**40]
    assert all(m.lctx.call_counter.dtype == torch.int64 and m.lctx.call_counter.dim() == 0 for m in layers)
    assert clock.dtype == torch.float64 and float(clock) == 0.0


def test_when_a_step_is_eager_captured_or_replayed(monkeypatch):
    """The graph step's decisions, with the capture and replay stubbed (no CUDA here): warm-up steps, a capture
    and replays while the key holds; a step with another key runs eager and keeps the graph; a key that lasts
    warmup_steps steps is captured anew; micro-batches that do not fit the static buffers run eager (one warning)."""
    from nvfp4_train.cuda_graph import CudaGraphStep

    log = []

    def capture(self, fb, batches, finalize, key):
        self.graph, self.key, self.captures = object(), key, self.captures + 1
        self._static = [{k: v.clone() for k, v in b.items()} for b in batches]
        log.append("capture")

    def replay(self, batches, finalize):
        self._pending = None
        log.append("replay")

    monkeypatch.setattr(CudaGraphStep, "_capture", capture)
    monkeypatch.setattr(CudaGraphStep, "_replay", replay)
    key = ["a"]
    monkeypatch.setattr(CudaGraphStep, "capture_key", lambda self: tuple(key))
    step = CudaGraphStep(torch.nn.Module(), device=torch.device("cpu"), stream=None, warmup_steps=2)
    batches = [{"tokens": torch.zeros(2, 4, dtype=torch.int64)}]

    def fb(it, finalize):
        assert finalize
        log.append("eager")

    def go(n=1, b=batches):
        for _ in range(n):
            step.run(fb, b, lambda: None)

    go(4)
    assert log == ["eager", "eager", "capture", "replay"]
    key[0] = "check on"  # e.g. the step after a skipped one under after_skip
    go()
    key[0] = "a"
    go()
    assert log[4:] == ["eager", "replay"] and step.captures == 1
    key[0] = "switched"  # the precision switch: warm up, capture anew
    go(3)
    assert log[6:] == ["eager", "eager", "capture"] and step.captures == 2
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        go(2, [{"tokens": torch.zeros(2, 5, dtype=torch.int64)}])
    assert log[9:] == ["eager", "eager"] and len(rec) == 1 and "run eager" in str(rec[0].message)
    with pytest.raises(ValueError, match="warmup_steps"):
        CudaGraphStep(torch.nn.Module(), device=torch.device("cpu"), stream=None, warmup_steps=0)
