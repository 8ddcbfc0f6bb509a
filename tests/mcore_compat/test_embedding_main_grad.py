"""The word embedding's gradient added into ``main_grad`` row by row (``nvfp4_train.mcore_compat.embedding``) is
bitwise the unfused path: ``F.embedding``'s dense gradient of the whole table, then megatron's DDP hook
``main_grad.add_(grad)``."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from nvfp4_train.mcore_compat.embedding import add_embedding_grad_rows, embedding_rows_into_main_grad
from tests.precision.mcore_util import megatron_single_rank

V, H = 257, 24


def _ids(kind: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    if kind == "random":
        return torch.randint(0, V, shape, generator=gen)
    if kind == "few":  # many repeats of a few ids: long segments in the sorted order
        return torch.randint(0, 5, shape, generator=gen) * 61
    if kind == "one":
        return torch.full(shape, V - 1)
    if kind == "distinct":
        return torch.randperm(V, generator=gen)[: torch.Size(shape).numel()].reshape(shape)
    raise AssertionError(kind)


def _unfused(w0: torch.Tensor, ids: torch.Tensor, dy: torch.Tensor, main_grad: torch.Tensor):
    w = torch.nn.Parameter(w0.clone())
    out = F.embedding(ids, w)
    out.backward(dy)
    return out.detach(), main_grad.clone().add_(w.grad)


def _rows(w0: torch.Tensor, ids: torch.Tensor, dy: torch.Tensor, main_grad: torch.Tensor):
    """The row path's output and weight (its main_grad updated, its dummy gradient set)."""
    w = torch.nn.Parameter(w0.clone())
    w.main_grad = main_grad.clone()
    w.grad_added_to_main_grad = False
    out = embedding_rows_into_main_grad(ids, w)
    out.backward(dy)
    return out.detach(), w


@pytest.mark.parametrize("kind", ["random", "few", "one", "distinct"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_rows_into_main_grad_is_the_full_add(gen, kind, grad_dtype):
    w0 = torch.randn(V, H, generator=gen).to(torch.bfloat16)
    main_grad0 = torch.randn(V, H, generator=gen).to(grad_dtype)
    main_grad0[::3] = 0.0  # rows that stay +0 unless touched
    for micro_batch in range(2):  # the second adds onto the first
        ids = _ids(kind, (3, 41), gen)
        dy = torch.randn(3, 41, H, generator=gen).to(torch.bfloat16)
        out0, expect = _unfused(w0, ids, dy, main_grad0)
        out, w = _rows(w0, ids, dy, main_grad0)
        assert torch.equal(out, out0)
        assert w.grad_added_to_main_grad and w.grad.shape == w.shape  # megatron's dummy: the hook drops it
        assert torch.equal(w.main_grad, expect)  # bits: the values and every zero's sign
        assert torch.equal(torch.signbit(w.main_grad), torch.signbit(expect))
        main_grad0 = expect


def test_without_main_grad_the_dense_gradient_is_returned(gen):
    w0 = torch.randn(V, H, generator=gen).to(torch.bfloat16)
    ids = _ids("random", (2, 33), gen)
    dy = torch.randn(2, 33, H, generator=gen).to(torch.bfloat16)
    w_ref = torch.nn.Parameter(w0.clone())
    F.embedding(ids, w_ref).backward(dy)
    w = torch.nn.Parameter(w0.clone())
    embedding_rows_into_main_grad(ids, w).backward(dy)
    assert torch.equal(w.grad, w_ref.grad)
    assert not getattr(w, "grad_added_to_main_grad", False)


def test_no_tokens_add_nothing():
    main_grad = torch.randn(V, H)
    before = main_grad.clone()
    add_embedding_grad_rows(main_grad, torch.empty(0, H, dtype=torch.bfloat16), torch.empty(0, dtype=torch.long))
    assert torch.equal(main_grad, before)


def test_the_built_model_routes_its_embedding_and_matches_megatrons(gen):
    """build_model with ``fusion.wgrad_accumulation`` switches the word embedding to the row path; one tiny model's
    step gives the embedding the same main_grad either way (the DDP hook's add done by hand where megatron's DDP
    would)."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from nvfp4_train.models.build import build_model, transformer_config
    from nvfp4_train.models.config import model_config
    from nvfp4_train.models.fusion import FusionConfig
    from nvfp4_train.precision.layer_map import LayerPrecisionMap

    with megatron_single_rank():
        mc = model_config("tiny")
        fusion = dataclasses.replace(FusionConfig.all_off(), wgrad_accumulation=True)
        torch.manual_seed(0)
        model_parallel_cuda_manual_seed(0)
        # megatron's linear layers unfused (they return their gradients); only the embedding's path differs
        cfg = transformer_config(mc, fusion=FusionConfig.all_off())
        model = build_model(mc, LayerPrecisionMap(mc.pattern, "bf16"), config=cfg, seq_length=64, fusion=fusion)
        emb = model.embedding.word_embeddings
        assert "forward" in vars(emb)  # the row path is installed
        b, s = 2, 64
        ids = torch.randint(0, mc.vocab_size, (b, s), generator=gen)
        ids[:, ::7] = 3  # repeated tokens
        labels = torch.randint(0, mc.vocab_size, (b, s), generator=gen)
        pos = torch.arange(s)[None].expand(b, s)
        results = []
        for rows in (False, True):
            w = emb.weight
            w.main_grad = torch.zeros(w.shape, dtype=torch.float32)
            w.grad_added_to_main_grad = False
            w.grad = None
            if rows:
                model(ids, pos, None, labels=labels).sum().backward()
            else:  # megatron's own forward: F.embedding, then the DDP hook's add
                installed = vars(emb).pop("forward")
                try:
                    model(ids, pos, None, labels=labels).sum().backward()
                finally:
                    emb.forward = installed
                w.main_grad.add_(w.grad)
            assert w.grad_added_to_main_grad == rows
            results.append(w.main_grad.clone())
        assert torch.equal(results[0], results[1])
        assert results[1].abs().sum() > 0


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1000, 8192])  # torch's CUDA backward: a per-feature kernel up to 3072
def test_rows_into_main_grad_is_the_full_add_on_cuda(gen, tokens):  # indices, a sort-based one above
    vocab, hidden = 131072, 256
    w0 = torch.randn(vocab, hidden, generator=gen).to(torch.bfloat16).cuda()
    main_grad0 = torch.randn(vocab, hidden, generator=gen).cuda()
    ids = torch.randint(0, vocab, (tokens,), generator=gen)
    ids[::5] = torch.randint(0, 8, (ids[::5].numel(),), generator=gen)  # repeated tokens: multi-row segments
    ids = ids.reshape(2, -1).cuda()
    dy = torch.randn(*ids.shape, hidden, generator=gen).to(torch.bfloat16).cuda()
    out0, expect = _unfused(w0, ids, dy, main_grad0)
    out, w = _rows(w0, ids, dy, main_grad0)
    assert torch.equal(out, out0)
    assert torch.equal(w.main_grad.view(torch.int32), expect.view(torch.int32))
