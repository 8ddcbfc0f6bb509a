"""``rotary_follows_model``: a model with RoPE moved to the CPU computes its rotary embedding there, also where
megatron-core would move the frequencies to a GPU (it does so whenever ``inv_freq`` lies on the CPU)."""

from __future__ import annotations

import pytest
import torch

from nvfp4_train.models.config import model_config
from tests.precision.mcore_util import megatron_single_rank


def _model():
    from nvfp4_train.export.checkpoint_io import build_model_single

    torch.manual_seed(0)
    mc = model_config("tiny").replace(position_embedding="rope", pattern="M*-*", num_layers=4)
    return build_model_single(mc, dtype=torch.float32)


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None], attention_mask=None)


def test_a_model_moved_to_the_cpu_keeps_its_rotary_embedding_there(monkeypatch):
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(1))
    with megatron_single_rank():
        want = _logits(_model(), ids)  # megatron's own get_emb (on this machine its device move stays on the CPU)
        # where a GPU exists megatron moves the frequencies to torch.cuda.current_device(): stand it in by "meta",
        # a device the CPU computation cannot use
        monkeypatch.setattr(torch.cuda, "current_device", lambda: "meta")
        with pytest.raises((RuntimeError, NotImplementedError)):
            _logits(_model(), ids)  # not moved by .to(): megatron's move, and the forward mixes devices
        type(_model().rotary_pos_emb).forward.cache_clear()
        model = _model().to("cpu")
        assert model.rotary_pos_emb.inv_freq.device.type == "cpu"
        got = _logits(model, ids)
        assert model.rotary_pos_emb.inv_freq.device.type == "cpu"
        torch.testing.assert_close(got, want, rtol=0, atol=0)  # the same arithmetic: bitwise


def test_the_frequencies_follow_the_model_and_the_cache_is_dropped():
    with megatron_single_rank():
        model = _model()
        emb = model.rotary_pos_emb(8)
        model.to(torch.device("meta"))  # another device: the frequencies follow, the cached embedding is dropped
        assert model.rotary_pos_emb.inv_freq.device.type == "meta"
        assert model.rotary_pos_emb(8).device.type == "meta" and emb.device.type == "cpu"
        assert "get_emb" not in vars(model.rotary_pos_emb)  # off the CPU: megatron's own get_emb again
