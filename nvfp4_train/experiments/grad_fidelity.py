"""Gradient fidelity per recipe ingredient: how far each quantized linear layer's weight gradient and forward
output are from BF16's, for the same weights and the same batch (``docs/grad_fidelity.md``).

    python3 scripts/grad_fidelity.py runs/small_bf16 --batches 8 --sr-seeds 32 \\
        --recipes nvfp4 nvfp4_no_rht nvfp4_no_sr nvfp4_1d nvfp4_all_blocks mxfp4 fp8 --out /tmp/o/gradfid

One model (a checkpoint's weights, or ``--init-only SIZE``: megatron's random init) is run under each recipe's
layer precision map (the named configs of ``configs/precision/``, resolved for the model's pattern and put on
the layers with ``set_recipe``: the same weights, the same batch). For each of the ``--batches`` fixed batches,
one forward and backward of the mean token cross entropy under ``bf16`` is the reference; then, per recipe and
per stochastic-rounding sample ``k`` (the layers' streams those of run seed ``seed + k``,
``nvfp4_train.precision.megatron_linear.set_sr_streams``), one forward and backward of the same loss. For every
quantized linear layer and both its weight gradient ``g`` (``weight.grad``: the model is not wrapped in DDP)
and its forward output ``y`` (a forward hook), against the reference ``r``:

    err      mean over the samples of ||g_k - r|| / ||r||           (the relative L2 error of one run)
    err_seed0   the same for sample 0 alone (the run's own seed)
    cos      mean over the samples of <g_k, r> / (||g_k|| ||r||)
    bias     ||mean_k g_k - r|| / ||r||                              (what averaging over the rounding keeps)
    bias_noise  sqrt(sum_k ||g_k - mean_k g_k||^2 / (S (S - 1))) / ||r||
             the expected size of the sampling noise still in ``bias`` after S samples (0 for one sample)

Only recipes with a stochastic cast in some layer are sampled ``sr_seeds`` times; the others are deterministic
and run once (``bias`` = ``err`` = ``err_seed0``, ``bias_noise`` = 0). Every sum is in float64 on the model's
device; the host reads the numbers once per (batch, recipe). Errors are end to end: a layer's gradient also
carries the quantization of the layers after it (backward) and before it (forward).

The summary (:func:`summarize`) averages, per recipe and layer class (``nvfp4_train.kernels.sr_key.ROLE_SLOTS``), the
layers the recipe quantizes (the ``bf16`` recipe, which quantizes none: every layer, the measurement's own
floor), first per batch, then over the batches: the standard error is the sample standard deviation of the
per-batch means over the batches divided by sqrt(batches).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

__all__ = [
    "METRICS",
    "LayerInfo",
    "BatchResult",
    "precision_map",
    "known_recipes",
    "has_stochastic_rounding",
    "apply_layer_map",
    "fidelity_layers",
    "random_batches",
    "data_batches",
    "measure_batch",
    "measure",
    "summarize",
    "markdown",
    "plot",
    "write_outputs",
    "main",
]

METRICS = ("err", "err_seed0", "cos", "bias", "bias_noise")
QUANTITIES = ("wgrad", "output")


@dataclasses.dataclass(frozen=True)
class LayerInfo:
    """One quantized linear layer of the model."""

    name: str
    """The layer's name (``blocks.12.mlp.fc1``)."""
    layer_class: str
    """Its role, the layer class of the tables (``mlp.fc1``, a key of ``nvfp4_train.kernels.sr_key.ROLE_SLOTS``)."""
    block: int
    """Its global block index."""


@dataclasses.dataclass
class BatchResult:
    """The numbers of one (batch, recipe): per layer, per quantity (``wgrad``, ``output``), per metric."""

    recipe: str
    batch: int
    seeds: int
    """Stochastic-rounding samples run (1 for a deterministic recipe)."""
    stochastic: bool
    """Whether some layer of the recipe rounds stochastically."""
    layer_recipes: list[str]
    """The recipe each layer (``fidelity_layers`` order) runs under this recipe's map."""
    values: dict[str, dict[str, list[float]]]
    """``values[quantity][metric][layer]`` (NaN where the reference is zero)."""
    ref_norms: dict[str, list[float]]
    """``ref_norms[quantity][layer]``: ||r|| of the bf16 reference."""


def _precision_dir() -> Path:
    from nvfp4_train.config.compose import CONFIG_DIR

    return Path(CONFIG_DIR) / "precision"


def known_recipes() -> list[str]:
    """The named precision configs (``configs/precision/*.yaml``)."""
    return sorted(p.stem for p in _precision_dir().glob("*.yaml"))


def check_recipe_names(names: Iterable[str]) -> None:
    """ValueError naming the first name that is not a precision config."""
    known = known_recipes()
    for name in names:
        if name not in known:
            raise ValueError(f"unknown recipe {name!r}: no configs/precision/{name}.yaml (known: {', '.join(known)})")


def precision_map(name: str, pattern: str):
    """The layer precision map of the named precision config ``name`` (``precision=<name>``) for ``pattern``."""
    from nvfp4_train.config import compose_config

    check_recipe_names([name])
    return compose_config("train", [f"precision={name}"]).precision.layer_map(pattern)


def has_stochastic_rounding(recipe) -> bool:
    """True if any operand cast of ``recipe`` (a ``QuantRecipe``) rounds stochastically."""
    return any(c.quantized and c.rounding == "stochastic" for g in recipe.gemms() for c in (g.a, g.b))


def fidelity_layers(model) -> list:
    """The quantized linear layers of ``model`` (module tree order)."""
    from nvfp4_train.precision.megatron_linear import quant_layers

    layers = quant_layers(model)
    if not layers:
        raise ValueError("the model has no quantized linear layers")
    return layers


def apply_layer_map(layers: Sequence, layer_map) -> list[str]:
    """Put each layer on the recipe ``layer_map`` gives its (block, role); returns the recipe names."""
    names = []
    for m in layers:
        recipe = layer_map.recipe(m.block, m.role)
        m.set_recipe(recipe)
        names.append(recipe.name)
    return names


def random_batches(n: int, *, vocab_size: int, seq_length: int, micro_batch: int, seed: int):
    """``n`` (tokens, labels) pairs of seeded random token ids, each [micro_batch, seq_length]."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        t = torch.randint(0, vocab_size, (micro_batch, seq_length + 1), generator=g)
        out.append((t[:, :-1].contiguous(), t[:, 1:].contiguous()))
    return out


def data_batches(prefix: str, n: int, *, seq_length: int, micro_batch: int, tokenizer=None, vocab_size=None):
    """The first ``n`` batches of the token stream of ``prefix`` (``nvfp4_train.evaluate.token_batches``)."""
    from nvfp4_train.evaluate import token_batches

    got = list(token_batches(prefix, seq_length=seq_length, batch_size=micro_batch, max_batches=n,
                             tokenizer=tokenizer, vocab_size=vocab_size))
    if len(got) < n:
        raise ValueError(f"data {prefix}: only {len(got)} batches of {micro_batch} x {seq_length + 1} tokens, "
                         f"{n} asked for: lower --batches, --micro-batch or --seq")
    return got


def _zero_grads(model) -> None:
    for p in model.parameters():
        p.grad = None


def _loss(model, tokens, labels):
    pos = torch.arange(tokens.shape[1], device=tokens.device)[None].expand_as(tokens)
    losses = model(input_ids=tokens, position_ids=pos, attention_mask=None, labels=labels)
    return losses.float().mean()


class _Pass:
    """Per-layer float64 statistics of one forward + backward against the reference, kept on the device."""

    def __init__(self, n: int, accumulate: bool) -> None:
        self.accumulate = accumulate
        # per quantity: lists of 0-d tensors per sample, [layer] each: err2, dot, norm2
        self.stats = {q: [] for q in QUANTITIES}
        self.sums: dict[str, list[torch.Tensor | None]] = {q: [None] * n for q in QUANTITIES}
        self.current = {q: [None] * n for q in QUANTITIES}


def _pair_stats(v: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """[||v - ref||^2, <v, ref>, ||v||^2] in float64 (``ref`` float64)."""
    d = v - ref
    return torch.stack([(d * d).sum(), (v * ref).sum(), (v * v).sum()])


def measure_batch(model, layers: Sequence, tokens: torch.Tensor, labels: torch.Tensor, recipes: dict, *,
                  bf16_map, sr_seeds: int, base_seed: int, batch: int = 0,
                  sample_all: bool = False) -> list[BatchResult]:
    """The numbers of every recipe of ``recipes`` (name -> layer precision map) on one batch.

    ``sr_seeds`` samples for recipes with stochastic rounding (sample k: streams of run seed ``base_seed + k``),
    one for the others (``sample_all``: ``sr_seeds`` for every recipe, to check that they do not vary)."""
    from nvfp4_train.precision.megatron_linear import set_sr_streams

    n = len(layers)
    state: dict = {"mode": None, "ref_out": [None] * n, "pass": None}

    def hook(i):
        def f(_module, _inputs, output):
            y = (output[0] if isinstance(output, tuple) else output).detach()
            if state["mode"] == "ref":
                state["ref_out"][i] = y.double()
            elif state["mode"] == "sample":
                p: _Pass = state["pass"]
                yd = y.to(torch.float64, copy=True)  # a fresh tensor: the first sample starts the sum
                p.current["output"][i] = _pair_stats(yd, state["ref_out"][i])
                if p.accumulate:
                    p.sums["output"][i] = yd if p.sums["output"][i] is None else p.sums["output"][i].add_(yd)
        return f

    handles = [m.register_forward_hook(hook(i)) for i, m in enumerate(layers)]
    try:
        # the reference: every layer bf16, the same weights and batch
        apply_layer_map(layers, bf16_map)
        _zero_grads(model)
        state["mode"] = "ref"
        _loss(model, tokens, labels).backward()
        state["mode"] = None
        ref = {"output": state["ref_out"], "wgrad": [m.weight.grad.detach().double() for m in layers]}
        ref_norm2 = {q: torch.stack([(r * r).sum() for r in ref[q]]) for q in QUANTITIES}
        results = []
        for name, layer_map in recipes.items():
            layer_recipes = apply_layer_map(layers, layer_map)
            stochastic = any(has_stochastic_rounding(m.recipe) for m in layers)
            seeds = sr_seeds if (stochastic or sample_all) else 1
            p = _Pass(n, accumulate=seeds > 1)
            state["pass"] = p
            for k in range(seeds):
                set_sr_streams(model, base_seed + k)
                _zero_grads(model)
                state["mode"] = "sample"
                _loss(model, tokens, labels).backward()
                state["mode"] = None
                for i, m in enumerate(layers):
                    g = m.weight.grad.detach().to(torch.float64, copy=True)
                    p.current["wgrad"][i] = _pair_stats(g, ref["wgrad"][i])
                    if p.accumulate:
                        p.sums["wgrad"][i] = g if p.sums["wgrad"][i] is None else p.sums["wgrad"][i].add_(g)
                for q in QUANTITIES:
                    p.stats[q].append(torch.stack(p.current[q]))  # [layer, 3]
            results.append(_finish(name, batch, seeds, stochastic, layer_recipes, p, ref, ref_norm2))
        return results
    finally:
        state["mode"] = None
        for h in handles:
            h.remove()
        _zero_grads(model)


def _finish(name, batch, seeds, stochastic, layer_recipes, p: _Pass, ref, ref_norm2) -> BatchResult:
    """The metrics from one recipe's per-sample statistics (one host read)."""
    rows = []
    for q in QUANTITIES:
        st = torch.stack(p.stats[q])  # [S, layer, 3]
        if p.accumulate:
            bias2 = torch.stack([((s / seeds - r) ** 2).sum() for s, r in zip(p.sums[q], ref[q], strict=True)])
        else:
            bias2 = st[0, :, 0]
        rows.append(torch.cat([st.reshape(-1), bias2, ref_norm2[q]]))
    host = torch.stack(rows).cpu().tolist()
    values, ref_norms = {}, {}
    n = len(layer_recipes)
    for q, flat in zip(QUANTITIES, host, strict=True):
        st = [[flat[(k * n + i) * 3:(k * n + i) * 3 + 3] for i in range(n)] for k in range(seeds)]
        bias2 = flat[seeds * n * 3:seeds * n * 3 + n]
        rn2 = flat[seeds * n * 3 + n:]
        vals = {m: [] for m in METRICS}
        for i in range(n):
            r2 = rn2[i]
            if r2 <= 0.0:
                for m in METRICS:
                    vals[m].append(math.nan)
                continue
            rn = math.sqrt(r2)
            errs = [math.sqrt(st[k][i][0]) / rn for k in range(seeds)]
            coss = [st[k][i][1] / math.sqrt(st[k][i][2] * r2) if st[k][i][2] > 0 else math.nan
                    for k in range(seeds)]
            # sum_k ||g_k - mean||^2 = sum_k ||g_k - r||^2 - S ||mean - r||^2 (exact algebra; >= 0 up to rounding)
            spread2 = max(0.0, sum(st[k][i][0] for k in range(seeds)) - seeds * bias2[i])
            vals["err"].append(sum(errs) / seeds)
            vals["err_seed0"].append(errs[0])
            vals["cos"].append(sum(coss) / seeds)
            vals["bias"].append(math.sqrt(bias2[i]) / rn)
            vals["bias_noise"].append(math.sqrt(spread2 / (seeds * (seeds - 1))) / rn if seeds > 1 else 0.0)
        values[q] = vals
        ref_norms[q] = [math.sqrt(v) for v in rn2]
    return BatchResult(recipe=name, batch=batch, seeds=seeds, stochastic=stochastic, layer_recipes=layer_recipes,
                       values=values, ref_norms=ref_norms)


def _check_tokens(layers, recipes: dict, tokens_per_batch: int) -> None:
    from nvfp4_train.precision.megatron_linear import token_block

    for name, layer_map in recipes.items():
        for m in layers:
            b = token_block(layer_map.recipe(m.block, m.role))
            if tokens_per_batch % b:
                raise ValueError(f"recipe {name!r} quantizes the weight-gradient operands of {m.layer_name} in "
                                 f"blocks of {b} tokens, but a batch has {tokens_per_batch} tokens: make "
                                 f"--seq x --micro-batch a multiple of {b}")


def measure(model, batches: Sequence, recipe_names: Sequence[str], *, sr_seeds: int, base_seed: int,
            device: str = "cpu", sample_all: bool = False) -> tuple[list[LayerInfo], list[BatchResult]]:
    """Every recipe of ``recipe_names`` on every batch (see :func:`measure_batch`)."""
    if sr_seeds < 1:
        raise ValueError(f"sr_seeds={sr_seeds} must be >= 1")
    if not batches:
        raise ValueError("no batches")
    check_recipe_names(recipe_names)
    if len(set(recipe_names)) != len(recipe_names):
        raise ValueError(f"recipes {list(recipe_names)} name one twice")
    pattern = model.model_cfg.pattern
    layers = fidelity_layers(model)
    recipes = {name: precision_map(name, pattern) for name in recipe_names}
    bf16_map = precision_map("bf16", pattern)
    _check_tokens(layers, recipes, batches[0][0].numel())
    infos = [LayerInfo(name=m.layer_name, layer_class=m.role, block=int(m.block)) for m in layers]
    base = [m.recipe for m in layers]
    was_training = model.training
    model.train()  # as in training (our configs have no dropout: the same function as eval mode)
    results = []
    t0 = time.perf_counter()
    try:
        for b, (tokens, labels) in enumerate(batches):
            if b:  # progress on stderr: a run of minutes says how far it got
                print(f"grad_fidelity: batch {b}/{len(batches)} done, {time.perf_counter() - t0:.0f} s",
                      file=sys.stderr, flush=True)
            tokens, labels = tokens.to(device), labels.to(device)
            results += measure_batch(model, layers, tokens, labels, recipes, bf16_map=bf16_map, sr_seeds=sr_seeds,
                                     base_seed=base_seed, batch=b, sample_all=sample_all)
    finally:
        for m, r in zip(layers, base, strict=True):
            m.set_recipe(r)
        model.train(was_training)
    return infos, results


def _mean_se(xs: list[float]) -> tuple[float, float]:
    xs = [x for x in xs if not math.isnan(x)]
    if not xs:
        return math.nan, math.nan
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, math.nan
    var = sum((x - m) ** 2 for x in xs) / (len(xs) - 1)
    return m, math.sqrt(var / len(xs))


def summarize(layers: Sequence[LayerInfo], results: Sequence[BatchResult]) -> list[dict]:
    """Per (recipe, layer class): the layers averaged, and per quantity and metric {mean, se} over the batches
    of the per-batch mean over those layers (see the module docstring)."""
    recipes = list(dict.fromkeys(r.recipe for r in results))
    classes = list(dict.fromkeys(li.layer_class for li in layers))
    out = []
    for name in recipes:
        rs = [r for r in results if r.recipe == name]
        for cls in classes:
            idx = [i for i, li in enumerate(layers) if li.layer_class == cls and rs[0].layer_recipes[i] != "bf16"]
            quantized = bool(idx)
            if not idx and all(lr == "bf16" for lr in rs[0].layer_recipes):
                idx = [i for i, li in enumerate(layers) if li.layer_class == cls]  # the bf16 recipe: the floor
            if not idx:
                continue
            row = {"recipe": name, "class": cls, "layers": len(idx), "quantized": quantized, "seeds": rs[0].seeds,
                   "batches": len(rs)}
            for q in QUANTITIES:
                row[q] = {}
                for m in METRICS:
                    per_batch = []
                    for r in rs:
                        v = [r.values[q][m][i] for i in idx if not math.isnan(r.values[q][m][i])]
                        per_batch.append(sum(v) / len(v) if v else math.nan)
                    mean, se = _mean_se(per_batch)
                    row[q][m] = {"mean": mean, "se": se}
            out.append(row)
    return out


def _fmt(ms: dict) -> str:
    m, se = ms["mean"], ms["se"]
    if math.isnan(m):
        return "n/a"
    return f"{m:.4g}" if math.isnan(se) else f"{m:.4g} ± {se:.2g}"


_HEAD = {"err": "err", "err_seed0": "err (seed 0)", "bias": "bias", "bias_noise": "bias noise", "cos": "cos"}


def markdown(summary: Sequence[dict], meta: dict) -> str:
    """One table per layer class: a row per recipe, mean ± standard error over the batches."""
    lines = [f"# Gradient fidelity against bf16: {meta.get('source', '')}", "",
             f"{meta.get('batches')} batches of {meta.get('micro_batch')} x {meta.get('seq')} tokens; "
             f"{meta.get('sr_seeds')} stochastic-rounding seeds for recipes with stochastic rounding, 1 for the "
             f"others. Relative to the bf16 reference r: err = mean over seeds of ||g - r|| / ||r||, bias = "
             f"||mean over seeds of g - r|| / ||r||, bias noise = the sampling noise left in bias, cos = mean "
             f"cosine. Mean over the layers the recipe quantizes, ± its standard error over the batches.", ""]
    metrics = ("err", "err_seed0", "bias", "bias_noise", "cos")
    for cls in dict.fromkeys(r["class"] for r in summary):
        lines += [f"## {cls}", ""]
        head = ["recipe", "layers", "seeds"] + [f"wgrad {_HEAD[m]}" for m in metrics] + \
            [f"output {_HEAD[m]}" for m in metrics]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in (r for r in summary if r["class"] == cls):
            label = r["recipe"] if r["quantized"] else f"{r['recipe']} (none quantized: all layers)"
            cells = [label, str(r["layers"]), str(r["seeds"])]
            cells += [_fmt(r["wgrad"][m]) for m in metrics] + [_fmt(r["output"][m]) for m in metrics]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(summary: Sequence[dict], out: Path) -> Path:
    """Per layer class (columns) and quantity (rows): per recipe, the single-seed error and the bias, with
    their standard errors, as bars (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    classes = list(dict.fromkeys(r["class"] for r in summary))
    recipes = list(dict.fromkeys(r["recipe"] for r in summary))
    fig, axes = plt.subplots(len(QUANTITIES), len(classes), figsize=(3.2 * len(classes) + 1, 7), squeeze=False)
    x = np.arange(len(recipes))
    for col, cls in enumerate(classes):
        rows = {r["recipe"]: r for r in summary if r["class"] == cls}
        for row, q in enumerate(QUANTITIES):
            ax = axes[row][col]
            for j, (metric, label) in enumerate((("err_seed0", "error, one seed"), ("bias", "bias over the seeds"))):
                vals = [rows[n][q][metric]["mean"] if n in rows else np.nan for n in recipes]
                ses = [rows[n][q][metric]["se"] if n in rows else np.nan for n in recipes]
                vals = [v if v and v > 0 else np.nan for v in vals]  # log scale: zeros (bf16 on CPU) are not drawn
                ses = [0.0 if (s is None or math.isnan(s)) else s for s in ses]
                ax.bar(x + (j - 0.5) * 0.4, vals, 0.4, yerr=ses, label=label, capsize=2)
            ax.set_yscale("log")
            ax.set_xticks(x, recipes, rotation=60, ha="right", fontsize=7)
            ax.set_title(f"{cls}: {q}", fontsize=9)
            ax.grid(True, axis="y", alpha=0.3)
            if col == 0:
                ax.set_ylabel("relative to bf16")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def _jsonable(v):
    if isinstance(v, float):
        return None if math.isnan(v) or math.isinf(v) else v
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return v


def write_outputs(out_dir: str | Path, meta: dict, layers: Sequence[LayerInfo], results: Sequence[BatchResult],
                  ) -> tuple[dict, str]:
    """``grad_fidelity.json`` (every number), ``grad_fidelity.md`` and ``grad_fidelity.png`` in ``out_dir``;
    returns (the JSON document, the markdown)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(layers, results)
    doc = {"meta": meta, "metrics": list(METRICS), "layers": [dataclasses.asdict(li) for li in layers],
           "results": [dataclasses.asdict(r) for r in results], "summary": summary}
    doc = _jsonable(doc)
    (out / "grad_fidelity.json").write_text(json.dumps(doc, indent=1) + "\n")
    md = markdown(summary, meta)
    (out / "grad_fidelity.md").write_text(md + "\n")
    plot(summary, out / "grad_fidelity.png")
    return doc, md


def _load(args):
    """(model, run info or None, base seed, model source words)."""
    from nvfp4_train.evaluate import load_model

    if args.init_only:
        from nvfp4_train.models.config import SIZES
        from nvfp4_train.export.checkpoint_io import build_model_single

        if args.init_only not in SIZES:
            raise ValueError(f"--init-only {args.init_only!r} is not a model size (known: {', '.join(SIZES)})")
        seed = 1234 if args.seed is None else args.seed
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = build_model_single(SIZES[args.init_only], dtype=torch.bfloat16)
        return model.to(args.device), None, seed, f"model {args.init_only}, random init (seed {seed})"
    info, model = load_model(args.checkpoint, precision="bf16", device=args.device)
    seed = args.seed if args.seed is not None else int(info.config.get("experiment", {}).get("seed", 0))
    return model, info, seed, f"{info.path} (step {info.step}, model {info.model.name})"


def _batches(args, model, info):
    cfg = model.model_cfg
    run_data = info.config.get("data", {}) if info is not None else {}
    run_sched = info.config.get("schedule", {}) if info is not None else {}
    seq = args.seq or int(run_data.get("seq_length", 256))
    mb = args.micro_batch or int(run_sched.get("micro_batch_size", 2))
    if args.random_tokens:
        return random_batches(args.batches, vocab_size=cfg.vocab_size, seq_length=seq, micro_batch=mb,
                              seed=args.seed if args.seed is not None else 1234), seq, mb, "random tokens"
    prefix = args.data_prefix
    tok = None
    if prefix is None:
        if info is None:
            raise ValueError("--init-only has no run data: give --data-prefix PREFIX or --random-tokens")
        valid = run_data.get("valid_prefixes") or []
        if not valid:
            raise ValueError(f"the run of {info.path} has no data.valid_prefixes: give --data-prefix PREFIX")
        prefix = valid[0]
    if info is not None:
        from nvfp4_train.evaluate import run_tokenizer

        tok = run_tokenizer(info)
    return data_batches(prefix, args.batches, seq_length=seq, micro_batch=mb, tokenizer=tok,
                        vocab_size=cfg.vocab_size), seq, mb, str(prefix)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="scripts/grad_fidelity.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", nargs="?", help="a checkpoint directory (step_XXXXXXX), its root, or a run directory")
    p.add_argument("--init-only", metavar="MODEL_SIZE", default=None,
                   help="no checkpoint: a freshly initialised model of this size (e.g. tiny)")
    p.add_argument("--batches", type=int, default=8, help="fixed batches (default 8)")
    p.add_argument("--sr-seeds", type=int, default=32,
                   help="stochastic-rounding samples for recipes with stochastic rounding (default 32)")
    p.add_argument("--recipes", nargs="+", default=["nvfp4"], help="named precision configs (configs/precision/)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--micro-batch", type=int, default=None, help="sequences per batch (default: the run's)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: the run's)")
    p.add_argument("--data-prefix", default=None,
                   help="a prepared dataset (PREFIX.bin/.idx; default: the run's first validation prefix)")
    p.add_argument("--random-tokens", action="store_true", help="seeded random token ids instead of data")
    p.add_argument("--seed", type=int, default=None,
                   help="run seed of stochastic-rounding sample 0 (sample k: seed + k; default: the run's "
                        "experiment.seed, 1234 with --init-only); also seeds --random-tokens and --init-only")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if (args.checkpoint is None) == (args.init_only is None):
            raise ValueError("give a checkpoint path or --init-only MODEL_SIZE (exactly one)")
        if args.batches < 1 or args.sr_seeds < 1:
            raise ValueError(f"--batches {args.batches} and --sr-seeds {args.sr_seeds} must be >= 1")
        check_recipe_names(args.recipes)
        model, info, seed, source = _load(args)
        batches, seq, mb, data = _batches(args, model, info)
        layers, results = measure(model, batches, args.recipes, sr_seeds=args.sr_seeds, base_seed=seed,
                                  device=args.device)
    except (ValueError, FileNotFoundError) as e:
        print(f"grad_fidelity: error: {e}", file=sys.stderr)
        return 2
    meta = {"source": source, "checkpoint": str(info.path) if info else None, "step": info.step if info else None,
            "model": model.model_cfg.name, "data": data, "batches": args.batches, "micro_batch": mb, "seq": seq,
            "sr_seeds": args.sr_seeds, "base_seed": seed, "device": args.device,
            "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
            "torch": torch.__version__, "recipes": list(args.recipes),
            "seeds_per_recipe": {r.recipe: r.seeds for r in results if r.batch == 0},
            "stochastic_rounding": {r.recipe: r.stochastic for r in results if r.batch == 0}}
    _, md = write_outputs(args.out, meta, layers, results)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
