"""Hugging Face Nemotron-H export and import: transformers' model computes our logits, the 12B maps onto the
released config key for key, export(import(x)) is bitwise x, an imported checkpoint resumes, bad input is a
clear error."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest
import torch

from nvfp4_train.models.config import model_config
from nvfp4_train.export.hf import (ARCHITECTURE_FIELDS, expected_hf_shapes, from_hf_state, hf_config,
                                   model_config_from_hf, to_hf_state)
from tests.export.conftest import HYBRID_TINY, nemotron_h
from tests.export.test_nvfp4 import assert_no_third_party_warning
from tests.precision.mcore_util import megatron_single_rank
from tests.trainer.runs import ROOT, env, run, tail

transformers = pytest.importorskip("transformers")
FIXTURES = ROOT / "tests" / "export" / "fixtures"


@pytest.fixture
def single_rank():
    with megatron_single_rank():
        yield


def _ours(mc, gen, *, perturb: bool = True):
    """Our model (fp32, bf16 recipe: no quantization) with random weights; norms, D, dt_bias and A_log
    perturbed away from their constant inits so that a swapped or dropped one shows."""
    from nvfp4_train.export.checkpoint_io import build_model_single

    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
    model = build_model_single(mc, dtype=torch.float32)
    if perturb:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("norm.weight", "layernorm.weight", ".D", ".dt_bias", ".A_log")):
                    p.add_(0.2 * torch.randn(p.shape, generator=gen))
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    return model, state


def _hf_model(mc, tensors, dtype="float32"):
    NemotronHConfig, NemotronHForCausalLM = nemotron_h()

    cfg = {k: v for k, v in hf_config(mc, dtype=dtype).items() if k not in ("architectures", "model_type")}
    model = NemotronHForCausalLM(NemotronHConfig(**cfg)).eval()
    model.load_state_dict(tensors, strict=True)  # every tensor has its place, none is left over
    return model


def _logits_ours(model, ids):
    pos = torch.arange(ids.shape[1])[None].expand_as(ids)
    with torch.no_grad():
        return model(input_ids=ids, position_ids=pos, attention_mask=None).float()


def _assert_same_function(ours: torch.Tensor, hf_model, ids) -> None:
    """Our fp32 logits equal transformers' fp32 logits up to fp32 rounding.

    Bound: both evaluate the same real-valued function (same weights, same operations) in fp32, in different
    summation orders. Let e_hf = max |hf_fp32 - hf_fp64| be transformers' own fp32 rounding error on these
    inputs (its fp64 evaluation is exact to ~1e-16 relative, negligible here). Our evaluation rounds the same
    operations (same GEMM lengths, same norms and scan) in another order, so its error e_ours is of the same
    size; allowing e_ours <= 3 e_hf, |ours - hf_fp32| <= e_ours + e_hf <= 4 e_hf. A mapping error (a swapped
    q/k row, a missing gate, a wrong eps or norm group, an un-applied clamp) changes logits by far more than
    rounding. Measured (2026-12-01, CPU): tiny |ours - hf| 6.0e-7 vs e_hf 7.7e-7; small 2.4e-6 vs 2.7e-6."""
    with torch.no_grad():
        hf32 = hf_model(input_ids=ids).logits.float()
        hf64 = hf_model.double()(input_ids=ids).logits
        hf_model.float()
    e_hf = (hf32.double() - hf64).abs().max().item()
    diff = (ours.double() - hf32.double()).abs().max().item()
    assert ours.shape == hf32.shape
    assert e_hf > 0 and diff <= 4 * e_hf, f"max |ours - transformers| = {diff:.3e} > 4 x {e_hf:.3e}"


@pytest.mark.parametrize("size,seq,variant", [
    ("tiny", 48, {}),
    ("tiny", 40, {"untie_embeddings_and_output_weights": False}),
    ("small", 24, {}),  # the 12B's block order at a short sequence (CPU time)
])
def test_transformers_computes_our_logits(single_rank, gen, size, seq, variant):
    mc = model_config(size).replace(**variant)
    ours, state = _ours(mc, gen)
    tensors = to_hf_state(mc, state)
    # the shapes the import checks from safetensors headers before it allocates anything: the built model's
    assert [(k, tuple(v.shape)) for k, v in tensors.items()] == list(expected_hf_shapes(mc).items())
    hf = _hf_model(mc, tensors)
    ids = torch.randint(0, mc.vocab_size, (2, seq), generator=gen)
    _assert_same_function(_logits_ours(ours, ids), hf, ids)


def test_state_mapping_round_trip_is_exact(single_rank, gen):
    mc = model_config("tiny")
    _, state = _ours(mc, gen)
    back = from_hf_state(mc, to_hf_state(mc, state))
    assert back.keys() == state.keys()
    assert all(torch.equal(back[k], state[k]) for k in state)


def test_our_12b_maps_onto_the_released_12b_config_key_for_key():
    released = json.loads((FIXTURES / "nemotron_nano_12b_v2_base_config.json").read_text())
    ours = hf_config(model_config("12b"))
    # initialisation-only and clamp keys differ on purpose (nvfp4_train.export.hf docstring)
    init_only = {"initializer_range", "time_step_min", "max_position_embeddings"}
    for key, value in released.items():
        if key.startswith("_") or key in init_only:
            continue
        assert key in ours, f"our config.json lacks {key!r}"
        assert ours[key] == value, f"{key}: ours {ours[key]!r}, released {value!r}"
    with pytest.warns(UserWarning, match="time_step_min"):
        derived = model_config_from_hf(released)
    target = model_config("12b")
    assert {f: getattr(derived, f) for f in ARCHITECTURE_FIELDS} == {f: getattr(target, f) for f in ARCHITECTURE_FIELDS}


@pytest.mark.parametrize("variant,match", [
    ({"position_embedding": "rope"}, "position embedding"),
    ({"activation": "swiglu"}, "no gate"),
    ({"add_bias_linear": True}, "bias"),
])
def test_unexportable_architectures_are_named(variant, match):
    with pytest.raises(ValueError, match=match):
        hf_config(model_config("tiny").replace(**variant))


def test_foreign_config_is_refused():
    with pytest.raises(ValueError, match="model_type='llama'"):
        model_config_from_hf({"model_type": "llama", "hidden_size": 8})
    with pytest.raises(ValueError, match="mixture-of-experts"):
        model_config_from_hf({"model_type": "nemotron_h", "hybrid_override_pattern": "ME*", "hidden_size": 8,
                              "vocab_size": 8})


def _cli(*args, timeout=300):
    e = env()
    e.pop("PYTHONWARNINGS", None)  # the user's warning filters would switch the routing off
    return subprocess.run([sys.executable, "-m", "nvfp4_train.export", *map(str, args)], cwd=ROOT, env=e,
                          capture_output=True, text=True, timeout=timeout)


def test_export_loads_in_transformers_import_round_trips_and_resumes(trained_tiny, tmp_path, single_rank, gen):
    _, NemotronHForCausalLM = nemotron_h()
    from safetensors.torch import load_file

    from nvfp4_train.export.checkpoint_io import build_model_single, load_checkpoint_model
    from nvfp4_train.export.hf import export_hf

    out = export_hf(trained_tiny, tmp_path / "hf")
    info, state = load_checkpoint_model(trained_tiny)
    # transformers loads the folder; its fp32 logits are ours (the trained bf16 weights, upcast exactly)
    hf = NemotronHForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ours = build_model_single(info.model, dtype=torch.float32)
    ours.load_state_dict(state, strict=False)
    ids = torch.randint(0, info.model.vocab_size, (1, 32), generator=gen)
    _assert_same_function(_logits_ours(ours, ids), hf, ids)

    # import, export again: bitwise the same folder
    r = _cli("import", "hf", out, tmp_path / "imported", "--model", "tiny")
    assert r.returncode == 0, r.stderr[-3000:]
    assert_no_third_party_warning(r.stderr)  # megatron-core's are routed as train.py routes them
    ckpt = tmp_path / "imported" / "step_0000000"
    again = export_hf(ckpt, tmp_path / "hf2")
    a, b = load_file(str(out / "model.safetensors")), load_file(str(again / "model.safetensors"))
    assert a.keys() == b.keys()
    assert all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    assert json.loads((out / "config.json").read_text()) == json.loads((again / "config.json").read_text())

    # train.py continues from the imported checkpoint
    log = tmp_path / "resume.log"
    rc = run([*HYBRID_TINY, f"experiment.run_dir={tmp_path / 'resumed'}", f"checkpoint.resume={ckpt}"], log=log)
    assert rc == 0, tail(log)
    assert "resum" in log.read_text().lower(), tail(log)


def test_bad_inputs_are_named(trained_tiny, tmp_path, single_rank):
    from nvfp4_train.export.checkpoint_io import load_checkpoint_model
    from nvfp4_train.export.hf import load_hf

    # an HF folder of another model
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="model_type='llama'"):
        load_hf(tmp_path / "llama")
    # a checkpoint whose weights do not have its config's shapes
    ckpt = tmp_path / "ckpt"
    shutil.copytree(sorted((trained_tiny / "checkpoints").glob("step_*"))[-1], ckpt)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["meta"]["model"]["ffn_hidden_size"] = 256
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="does not fit its model config"):
        load_checkpoint_model(ckpt)
    with pytest.raises(ValueError, match="is not a checkpoint"):
        load_checkpoint_model(tmp_path / "llama")


@pytest.mark.dist
def test_a_tensor_parallel_checkpoint_exports(tmp_path, single_rank, gen):
    """A TP=2 checkpoint (two gloo ranks) exports: megatron reshards it to TP=1 on load, and transformers
    computes what our TP=1 model computes with those weights."""
    _, NemotronHForCausalLM = nemotron_h()

    from nvfp4_train.export.checkpoint_io import build_model_single, load_checkpoint_model
    from nvfp4_train.export.hf import export_hf
    from tests.export.conftest import train_tiny

    run_dir = train_tiny(tmp_path / "tp2", "parallel.tp=2", nproc=2)
    info, state = load_checkpoint_model(run_dir)
    assert json.loads((info.path / "manifest.json").read_text())["meta"]["layout"]["tp"] == 2
    out = export_hf(run_dir, tmp_path / "hf")
    hf = NemotronHForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ours = build_model_single(info.model, dtype=torch.float32)
    ours.load_state_dict(state, strict=False)
    ids = torch.randint(0, info.model.vocab_size, (1, 32), generator=gen)
    _assert_same_function(_logits_ours(ours, ids), hf, ids)


# ------------------------------------------------------------------------------------------------ import-hf
def _hf_folder(path, mc, *, config: dict | None = None, shapes: dict | None = None, drop: tuple = (),
               extra: dict | None = None):
    """A Nemotron-H folder of ``mc`` (constant bf16 tensors), with config.json keys, tensor shapes changed."""
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    want = {**expected_hf_shapes(mc), **(shapes or {})}
    tensors = {k: torch.full(s, 0.25, dtype=torch.bfloat16) for k, s in want.items() if k not in drop}
    tensors.update(extra or {})
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({**hf_config(mc), **(config or {})}))
    return path


@pytest.fixture
def no_model_built(monkeypatch):
    """Fails the test if the import allocates a model or reads tensor data."""
    import nvfp4_train.export.checkpoint_io as cio
    import nvfp4_train.export.hf as hfmod

    def refuse(*a, **k):
        raise AssertionError("the import built a model or read tensor data before checking the shapes")

    monkeypatch.setattr(cio, "build_model_single", refuse)
    monkeypatch.setattr(cio, "write_training_checkpoint", refuse)
    monkeypatch.setattr(hfmod, "_load_tensors", refuse)


def _import_error(folder, out, **kw) -> str:
    from nvfp4_train.export.hf import import_hf

    with pytest.raises(ValueError) as e:
        import_hf(folder, out, **kw)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_import_checks_every_shape_from_the_headers_first(tmp_path, no_model_built):
    """Each problem: one line naming the file, the tensor, expected vs found and the fix, before any tensor data
    is read or a model allocated (hidden_size 262144 would allocate a 17 GB model)."""
    mc = model_config("tiny")
    st = "model.safetensors"
    # a config.json whose hidden_size is not the weights'
    bad = _hf_folder(tmp_path / "wide", mc, config={"hidden_size": 262144})
    msg = _import_error(bad, tmp_path / "o1")
    assert msg.startswith(f"{bad / st}: tensor model.embeddings.weight has shape [32768, 128], config.json "
                          f"gives it [32768, 262144]: "), msg
    assert "more problem" in msg and "config.json does not describe these weights" in msg
    # a wrong q_proj (was a RuntimeError inside the q/k/v assembly)
    q = "model.layers.2.mixer.q_proj.weight"
    bad = _hf_folder(tmp_path / "q", mc, shapes={q: (mc.attention_q_width - 8, mc.hidden_size)})
    msg = _import_error(bad, tmp_path / "o2", model="tiny")
    assert msg.startswith(f"{bad / st}: tensor {q} has shape [{mc.attention_q_width - 8}, 128], config.json "
                          f"gives it [{mc.attention_q_width}, 128]"), msg
    # a missing and a foreign tensor, a quantized dtype
    bad = _hf_folder(tmp_path / "miss", mc, drop=("model.norm_f.weight",))
    assert _import_error(bad, tmp_path / "o3").startswith(f"{bad}: no file has tensor model.norm_f.weight, which "
                                                          f"config.json gives shape [128]")
    bad = _hf_folder(tmp_path / "extra", mc, extra={"model.layers.9.mixer.D": torch.zeros(8)})
    assert _import_error(bad, tmp_path / "o4").startswith(f"{bad / st}: tensor model.layers.9.mixer.D [8] is not part")
    bad = _hf_folder(tmp_path / "u8", mc, drop=("model.norm_f.weight",),
                     extra={"model.norm_f.weight": torch.zeros(128, dtype=torch.uint8)})
    assert "tensor model.norm_f.weight is U8, not a floating-point type" in _import_error(bad, tmp_path / "o5")
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 6))


@pytest.mark.parametrize("damage,match", [
    (lambda b: b[:5], r"shorter than a safetensors header's 8-byte length"),
    (lambda b: (10**12).to_bytes(8, "little") + b[8:], r"header length field says 1000000000000 bytes"),
    (lambda b: b[:8] + b"{" * int.from_bytes(b[:8], "little") + b[8 + int.from_bytes(b[:8], "little"):],
     r"the safetensors header is not valid JSON"),
    (lambda b: b[:-100], r"truncated; re-download or re-save the file"),
])
def test_import_names_a_damaged_safetensors_file(tmp_path, no_model_built, damage, match):
    mc = model_config("tiny")
    folder = _hf_folder(tmp_path / "hf", mc)
    f = folder / "model.safetensors"
    f.write_bytes(damage(f.read_bytes()))
    msg = _import_error(folder, tmp_path / "out")
    assert msg.startswith(f"{f}: ") and re.search(match, msg), msg


def test_import_cli_error_is_one_line(tmp_path):
    mc = model_config("tiny")
    folder = _hf_folder(tmp_path / "hf", mc, config={"hidden_size": 262144})
    r = _cli("import-hf", folder, tmp_path / "out")
    assert r.returncode == 2, r.stderr[-3000:]
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and "model.embeddings.weight" in lines[0] and "Traceback" not in r.stderr, r.stderr
    assert str(folder / "model.safetensors") in lines[0]
    assert not (tmp_path / "out").exists()


def test_an_export_folder_must_be_new_or_empty(tmp_path):
    """No file already in the folder is overwritten (an export writes tokenizer.json, hf_quant_config.json, ...)."""
    from nvfp4_train.export.hf import check_new_folder

    assert check_new_folder(tmp_path / "new") == tmp_path / "new"
    (tmp_path / "empty").mkdir()
    assert check_new_folder(tmp_path / "empty") == tmp_path / "empty"
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match=r"used is not empty \(tokenizer\.json, \.\.\.\): give a new or empty folder"):
        check_new_folder(tmp_path / "used")
