"""Text from a checkpoint: greedy decoding and top-p (nucleus) sampling with the run's tokenizer.

``generate(model, ids, ...)`` extends token ids one at a time. Each step runs the whole sequence through the
model (no key/value or SSM state cache: this is a sanity check of a trained model, not a serving engine;
for fast generation export to Hugging Face or an inference engine, docs/export.md) and picks the next token
from the last position's logits:

- greedy (``temperature=0``): the arg-max (the lowest id on ties, as ``torch.argmax``);
- sampling: ``softmax(logits / temperature)``, then top-p: the smallest set of most likely tokens whose
  probability sum reaches ``top_p`` (the most likely token always stays), renormalised, drawn with a seeded
  ``torch.Generator`` (the same seed gives the same text on the same device).

Generation stops after ``max_new_tokens`` or at the end-of-document id. The model runs with every linear layer
in high precision by default (the Hugging Face export's function); ``precision="trained"`` runs the run's
layer precision map, and then right-pads each forward with the end-of-document id to a multiple of 16 tokens
(NVFP4 quantizes activations in 16-token blocks; the pad tokens come after the real ones, so causality keeps
them out of the real positions except through the per-tensor activation amax).
"""

from __future__ import annotations

import torch

__all__ = ["next_token", "generate", "generate_text"]


def next_token(logits: torch.Tensor, *, temperature: float = 0.0, top_p: float = 1.0,
               generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token id of each row of ``logits`` [b, vocab] (int64 [b])."""
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0: greedy)")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p} must be in (0, 1]")
    logits = logits.float()
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    before = sorted_p.cumsum(dim=-1) - sorted_p  # mass of the tokens more likely than each one
    sorted_p = torch.where(before < top_p, sorted_p, torch.zeros_like(sorted_p))
    pick = torch.multinomial(sorted_p.cpu(), 1, generator=generator).squeeze(-1).to(order.device)
    return order.gather(-1, pick[:, None]).squeeze(-1)


def _forward_logits(model, ids: torch.Tensor, pad_to: int, pad_id: int) -> torch.Tensor:
    n = ids.shape[1]
    if pad_to > 1 and n % pad_to:
        ids = torch.nn.functional.pad(ids, (0, pad_to - n % pad_to), value=pad_id)
    pos = torch.arange(ids.shape[1], device=ids.device)[None].expand_as(ids)
    logits = model(input_ids=ids, position_ids=pos, attention_mask=None)
    return logits[:, n - 1]


def generate(model, ids: torch.Tensor, *, max_new_tokens: int, eod: int | None = None, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0, pad_to: int = 1) -> torch.Tensor:
    """``ids`` [1, n] extended by up to ``max_new_tokens`` tokens (stops after ``eod``)."""
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] == 0:
        raise ValueError(f"ids must be [1, n] with n >= 1, got {tuple(ids.shape)}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = _forward_logits(model, ids, pad_to, eod if eod is not None else 0)
            nxt = next_token(logits, temperature=temperature, top_p=top_p, generator=gen)
            ids = torch.cat([ids, nxt[:, None].to(ids.device)], dim=1)
            if eod is not None and int(nxt[0]) == eod:
                break
    return ids


def generate_text(checkpoint: str, prompt: str, *, max_new_tokens: int = 64, temperature: float = 0.0,
                  top_p: float = 1.0, seed: int = 0, precision: str = "bf16", device: str = "cpu",
                  tokenizer: str | None = None) -> str:
    """The prompt's continuation by the checkpoint's model (the text after the prompt)."""
    from nvfp4_train.data.tokenizer import load_tokenizer
    from nvfp4_train.evaluate import load_model, run_tokenizer

    info, model = load_model(checkpoint, precision=precision, device=device)
    tok = (load_tokenizer(tokenizer, eod_token=info.config.get("data", {}).get("eod_token")) if tokenizer
           else run_tokenizer(info))
    prompt_ids = tok.encode(prompt)
    if not prompt_ids:
        prompt_ids = [tok.eod]  # an empty prompt: start a new document
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    out = generate(model, ids, max_new_tokens=max_new_tokens, eod=tok.eod, temperature=temperature, top_p=top_p,
                   seed=seed, pad_to=16 if precision == "trained" else 1)
    new = [t for t in out[0, ids.shape[1]:].tolist() if t != tok.eod]
    return tok.decode(new)
