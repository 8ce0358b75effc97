"""The model card (`README.md` in the checkpoint): what the model is, how it was made, what it
scored, how to load it. Written atomically; rewritten when later stages add metrics."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from quantbench.core.files import atomic_write
from quantbench.recipe import schemes
from quantbench.sources.checkpoint import linear_layers

if TYPE_CHECKING:
    from quantbench.recipe import LoadedRecipe
    from quantbench.sources.models import ResolvedModel


@dataclass
class CardInfo:
    loaded: LoadedRecipe
    base: ResolvedModel
    format: str
    loaders: str
    made: str  # how it was made: markdown list items from the engine
    check_tokens: int  # held-out tokens the reload check scored
    run_id: str


def write(dest: Path, final: Path, info: CardInfo, metrics: dict[str, float], sample: str) -> None:
    """Write the card into `dest`; `final` is where the checkpoint will live (for the load snippet)."""
    spec = info.loaded.recipe
    q = spec.quantize
    front = {
        "license": info.base.license,
        "base_model": info.base.name,
        "library_name": "transformers",
        "tags": ["quantbench", info.format, q.method, q.scheme.lower()],
    }
    rows = "\n".join(
        f"| `{k}` | {v:.4g}{_interval(metrics, k)} |" for k, v in sorted(metrics.items()) if ".ci_" not in k
    )
    distilled = q.method == "distill"
    kv = getattr(q, "kv_cache", None)
    lineage = f"\n- Made from the output of MLflow run `{info.base.parent_run}`" if info.base.parent_run else ""
    card = f"""---
{yaml.safe_dump(front, sort_keys=False).strip()}
---
# {info.base.name} — {"distilled student (bf16)" if distilled else f"{q.method} {q.scheme}"}

{"Distilled" if distilled else "Quantized"} by quantbench from `{spec.model.source}` with the recipe `{info.loaded.name}`
(sha256 `{info.loaded.sha[:16]}`), MLflow run `{info.run_id}`.

- {"Teacher" if distilled else "Base model"}: {info.base.name} (`{spec.model.source}`, fingerprint `{info.base.fingerprint[:16]}`){lineage}
- Licence: {info.base.license} (inherited from the base model)
- Method / scheme: {q.method} / {q.scheme}
- Format: {info.format}; loads with: {info.loaders}
- KV cache: {"FP8, per-tensor scales calibrated on the calibration data (vLLM: `--kv-cache-dtype fp8`)" if kv else "not quantized (16-bit)"}
{info.made}
{layer_groups(dest)}
## Metrics

| metric | value |
|---|---|
{rows}

A value in brackets is its 95 % interval (paired with the base model; docs/intervals.md in quantbench).
`check/*` come from reloading this directory from disk: perplexity on {info.check_tokens} held-out
tokens of the Python documentation, against the base model in {spec.model.dtype}.
Greedy sample after "{spec.check.prompt}": {sample!r}

## Load

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained("{final}")
```
or serve it: `vllm serve {final}`{" --kv-cache-dtype fp8" if kv else ""}.

## Resolved recipe

```yaml
{yaml.safe_dump(info.loaded.resolved, sort_keys=False).strip()}
```
"""
    atomic_write(dest / "README.md", card)


def _interval(metrics: dict[str, float], key: str) -> str:
    low, high = metrics.get(key + ".ci_low"), metrics.get(key + ".ci_high")
    return "" if low is None or high is None else f" [{low:.4g}, {high:.4g}]"


def layer_groups(checkpoint: Path) -> str:
    """The scheme of every layer group of a compressed-tensors checkpoint (its config_groups and
    ignore list), with how many of the model's Linear layers each takes, as a markdown section."""
    config_path = checkpoint / "config.json"
    if not config_path.is_file():
        return ""
    qc = json.loads(config_path.read_text()).get("quantization_config") or {}
    if qc.get("quant_method") != "compressed-tensors" or not qc.get("config_groups"):
        return ""
    from transformers import AutoConfig

    names = list(linear_layers(AutoConfig.from_pretrained(checkpoint)))
    groups = qc["config_groups"]
    # the group a layer lands in, matched as compressed-tensors does (exact > re: > class name)
    layers = {g: [t for t in body.get("targets", []) if t != "Linear"] for g, body in groups.items()}
    default = next((g for g, body in groups.items() if "Linear" in body.get("targets", [])), "(none)")
    taken = schemes.assign(names, default, layers, qc.get("ignore") or [])
    rows = ["| group | scheme | weights | input activations | layers | targets |", "|---|---|---|---|---|---|"]
    for group, body in groups.items():
        count = sum(1 for g in taken.values() if g == group)
        targets = ", ".join(f"`{t}`".replace("|", "\\|") for t in body.get("targets", []))
        scheme = schemes.name_of(body.get("weights"), body.get("input_activations"))
        rows.append(
            f"| {group} | {scheme} | {_args(body.get('weights'))} | {_args(body.get('input_activations'))} | {count} "
            f"| {targets} |"
        )
    unquantized = [n for n, g in taken.items() if g == "BF16"]
    if unquantized:
        shown = ", ".join(f"`{n}`" for n in unquantized[:12]) + (
            f" and {len(unquantized) - 12} more" if len(unquantized) > 12 else ""
        )
        rows.append(f"| unquantized | BF16 | 16-bit | 16-bit | {len(unquantized)} | {shown} |")
    return (
        "\n## Layer schemes\n\nEvery Linear layer but the output head, by the group whose scheme it takes "
        "(a name beats a pattern, a pattern beats `Linear`).\n\n" + "\n".join(rows) + "\n"
    )


def _args(args: dict | None) -> str:
    if not args:
        return "16-bit"
    kind = f"{args['type']}{args['num_bits']}"
    if args.get("strategy") == "group":
        where = f"group {args['group_size']}"
    else:
        where = f"per {args.get('strategy')}"
    flags = [] if args.get("symmetric", True) else ["asymmetric"]
    if args.get("dynamic"):
        flags.append("dynamic")
    return " ".join([kind, where, *flags])
