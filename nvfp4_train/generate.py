"""Text from a checkpoint: greedy decoding and top-p (nucleus) sampling with the run's tokenizer.

    python -m nvfp4_train.generate runs/tiny_nvfp4_cpu --prompt "The kernel" --max-new-tokens 40
    python scripts/generate.py CKPT --prompt "..." --temperature 0.8 --top-p 0.9 --seed 1 --device cuda

``generate(model, ids, ...)`` extends token ids one at a time and picks each next token from the logits at the
last position:

- greedy (``temperature=0``): the arg-max (the lowest id on ties, as ``torch.argmax``);
- sampling: ``softmax(logits / temperature)``, then top-p: the smallest set of most likely tokens whose
  probability sum reaches ``top_p`` (the most likely token always stays), renormalised, drawn with a seeded
  ``torch.Generator`` (the same seed gives the same text on the same device).

With ``cache=True`` (the default) it decodes incrementally (:mod:`nvfp4_train.models.decode`): the prompt runs
through the model once (the prefill), keeping each attention layer's keys and values and each Mamba layer's conv
inputs and SSM state, and each new token then costs one forward of one position. ``cache=False`` runs the whole
sequence through the model for every new token (the reference the cached path is tested against: the same
logits up to floating-point summation order, ``tests/models/test_decode.py``).

Generation stops after ``max_new_tokens`` or at the end-of-document id. The model runs with every linear layer
in high precision by default (the Hugging Face export's function). ``precision="trained"`` runs the run's layer
precision map; its quantized layers block the tokens of a forward in 16s with a per-tensor amax over all of them,
which one new token does not have, so it decodes without the cache, right-padding each forward with the
end-of-document id to a multiple of 16 tokens (the pad tokens come after the real ones, so causality keeps them out
of the real positions except through the per-tensor activation amax).

The command line streams the text as it is generated and ends with one line on stderr: the tokens generated, the
time to the first one (the prefill) and the tokens per second after it. Third-party warnings (megatron-core,
torch) are routed as ``train.py`` routes them (``nvfp4_train.warnings_log``): none is printed.
Exit status: ``nvfp4_train.evaluate.EXIT_STATUS`` (0 done, 2 a bad argument, checkpoint or tokenizer, 4 a file that
could not be read; one line on stderr names it).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Callable, TextIO

import torch

__all__ = ["next_token", "generate", "generate_text", "TextStream", "main"]


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


def _check_cacheable(model) -> None:
    quantized = [name for name, layer in getattr(model, "precision_layers", lambda: [])()
                 if not layer.recipe.is_bf16]
    if quantized:
        raise ValueError(f"cached decoding needs every linear layer in bf16, but {quantized[0]} (and "
                         f"{len(quantized) - 1} more) quantize: use precision='bf16', or cache=False")


def generate(model, ids: torch.Tensor, *, max_new_tokens: int, eod: int | None = None, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0, pad_to: int = 1, cache: bool = True,
             on_token: Callable[[int], None] | None = None) -> torch.Tensor:
    """``ids`` [1, n] extended by up to ``max_new_tokens`` tokens (stops after ``eod``). ``cache``: decode
    incrementally (the model's ``forward_cached``; every linear layer bf16), else recompute the sequence per token
    (padded to a multiple of ``pad_to`` with ``eod``). ``on_token(id)`` is called with each new token as it is
    chosen."""
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] == 0:
        raise ValueError(f"ids must be [1, n] with n >= 1, got {tuple(ids.shape)}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0")
    if max_new_tokens == 0:
        return ids
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        if cache:
            from nvfp4_train.models.decode import DecodeState

            _check_cacheable(model)
            state = DecodeState(max_length=ids.shape[1] + max_new_tokens)
            logits = model.forward_cached(ids, state)
        for i in range(max_new_tokens):
            if not cache:
                logits = _forward_logits(model, ids, pad_to, eod if eod is not None else 0)
            nxt = next_token(logits, temperature=temperature, top_p=top_p, generator=gen)
            ids = torch.cat([ids, nxt[:, None].to(ids.device)], dim=1)
            token = int(nxt[0])
            if on_token is not None:
                on_token(token)
            if eod is not None and token == eod:
                break
            if cache and i + 1 < max_new_tokens:
                logits = model.forward_cached(ids[:, -1:], state)
    return ids


class TextStream:
    """Writes the text of token ids to ``out`` as they come (``push``), leaving out the end-of-document id. The ids
    so far are decoded together and what is new is written, except an incomplete UTF-8 character at the end (the
    byte-level tokenizer decodes it as U+FFFD until its last byte arrives), which waits for the next id or ``close``."""

    def __init__(self, tokenizer, out: TextIO) -> None:
        self.tokenizer, self.out = tokenizer, out
        self.ids: list[int] = []
        self.shown = ""

    def push(self, token: int) -> None:
        if token == self.tokenizer.eod:
            return
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if not text.endswith("\ufffd"):
            self._show(text)

    def close(self) -> str:
        """Write what is still held back; returns the whole text."""
        text = self.tokenizer.decode(self.ids)
        self._show(text)
        return text

    def _show(self, text: str) -> None:
        if text.startswith(self.shown) and len(text) > len(self.shown):
            self.out.write(text[len(self.shown):])
            self.out.flush()
        self.shown = text


def _load(checkpoint: str, *, precision: str, device: str, tokenizer: str | None):
    """(model, tokenizer) of a checkpoint."""
    from nvfp4_train.data.tokenizer import load_tokenizer
    from nvfp4_train.evaluate import load_model, run_tokenizer

    info, model = load_model(checkpoint, precision=precision, device=device)
    tok = (load_tokenizer(tokenizer, eod_token=info.config.get("data", {}).get("eod_token")) if tokenizer
           else run_tokenizer(info))
    return model, tok


def _prompt_ids(tok, prompt: str, device: str) -> torch.Tensor:
    prompt_ids = tok.encode(prompt) or [tok.eod]  # an empty prompt: start a new document
    return torch.tensor([prompt_ids], dtype=torch.long, device=device)


def generate_text(checkpoint: str, prompt: str, *, max_new_tokens: int = 64, temperature: float = 0.0,
                  top_p: float = 1.0, seed: int = 0, precision: str = "bf16", device: str | None = None,
                  tokenizer: str | None = None, cache: bool | None = None) -> str:
    """The prompt's continuation by the checkpoint's model (the text after the prompt). ``device`` None: CUDA when
    available, else the CPU; ``cache`` None: cached decoding unless ``precision="trained"``."""
    from nvfp4_train.evaluate import default_device

    device = device or default_device()
    model, tok = _load(checkpoint, precision=precision, device=device, tokenizer=tokenizer)
    ids = _prompt_ids(tok, prompt, device)
    out = generate(model, ids, max_new_tokens=max_new_tokens, eod=tok.eod, temperature=temperature, top_p=top_p,
                   seed=seed, pad_to=16 if precision == "trained" else 1,
                   cache=precision != "trained" if cache is None else cache)
    return tok.decode([t for t in out[0, ids.shape[1]:].tolist() if t != tok.eod])


def main(argv: list[str] | None = None, *, prog: str = "python -m nvfp4_train.generate") -> int:
    from nvfp4_train.evaluate import EXIT_STATUS, routed_run

    p = argparse.ArgumentParser(prog=prog, description="Generate text from a checkpoint (greedy or top-p sampling), "
                                "streamed as it is produced; tokens/s on stderr at the end.", epilog=EXIT_STATUS)
    p.add_argument("checkpoint", help="a checkpoint directory (step_XXXXXXX), its root, or a run directory")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (with --temperature > 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--precision", choices=("bf16", "trained"), default="bf16",
                   help="bf16: linear layers in high precision; trained: the run's layer precision map (uncached)")
    p.add_argument("--device", default=None, help="cuda, cuda:1, cpu, ... (default: cuda when available, else cpu)")
    p.add_argument("--no-cache", action="store_true",
                   help="recompute the whole sequence for every token (the reference; slow)")
    p.add_argument("--tokenizer", default=None, help="the run's tokenizer.json, if it moved")
    args = p.parse_args(argv)
    return routed_run(lambda: _run(args, prog))


def _run(args: argparse.Namespace, prog: str) -> int:
    from nvfp4_train.evaluate import default_device, failed

    device = args.device or default_device()
    cache = not args.no_cache and args.precision != "trained"
    try:
        if args.max_new_tokens < 0 or args.temperature < 0 or not 0 < args.top_p <= 1:
            raise ValueError(f"--max-new-tokens {args.max_new_tokens} and --temperature {args.temperature} must be "
                             f">= 0 and --top-p {args.top_p} in (0, 1]")
        model, tok = _load(args.checkpoint, precision=args.precision, device=device, tokenizer=args.tokenizer)
        ids = _prompt_ids(tok, args.prompt, device)
    except (ValueError, OSError) as e:
        return failed(prog, e)
    print(args.prompt, end="", flush=True)
    stream = TextStream(tok, sys.stdout)
    times: list[float] = []

    def on_token(token: int) -> None:
        times.append(time.perf_counter())
        stream.push(token)

    start = time.perf_counter()
    generate(model, ids, max_new_tokens=args.max_new_tokens, eod=tok.eod, temperature=args.temperature,
             top_p=args.top_p, seed=args.seed, pad_to=16 if args.precision == "trained" else 1, cache=cache,
             on_token=on_token)
    stream.close()
    print(flush=True)
    print(_speed_line(len(times), ids.shape[1], start, times, cache, device), file=sys.stderr, flush=True)
    return 0


def _speed_line(n: int, prompt: int, start: float, times: list[float], cache: bool, device: str) -> str:
    how = f"{'cached' if cache else 'uncached'} decoding on {device}"
    if n == 0:
        return f"0 tokens generated ({how})"
    first = times[0] - start
    rate = f", then {(n - 1) / (times[-1] - times[0]):.1f} tokens/s" if n > 1 and times[-1] > times[0] else ""
    return (f"{n} tokens in {times[-1] - start:.2f} s: the first after {first:.2f} s (prompt of {prompt} tokens)"
            f"{rate} ({how})")


if __name__ == "__main__":
    sys.exit(main())
