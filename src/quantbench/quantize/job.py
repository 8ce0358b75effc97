"""`quantbench quantize RECIPE`: load -> prepare -> quantize (or distill) -> save -> reload check -> track.

Every check of the user's input (recipe, model source, group size, calibration text) runs before
anything is written: bad input leaves no output directory and no MLflow run. Once the run
starts, the checkpoint is written into a hidden staging directory and renamed into place only
after it has been reloaded from disk and found sane.
"""

from __future__ import annotations

import logging
import math
import resource
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from quantbench import data, environment, models
from quantbench.errors import UserError
from quantbench.recipe import LoadedRecipe, load_recipe, resolve_recipe_path
from quantbench.tracking import TAG, Tracker

log = logging.getLogger(__name__)


@dataclass
class Prepared:
    """Everything the job needs, all checked before the first byte is written."""

    loaded: LoadedRecipe
    base: models.ResolvedModel
    tokenizer: object
    backend: object
    calibration: list[list[int]] | None
    eval_ids: list[int]
    text_shas: dict[str, str]
    evaluation: object | None  # evaluate.job.Prepared when the recipe has an evaluate: section
    bench: tuple | None  # (profile name, Profile, evaluation token ids) when it has a bench: section


class CheckpointCheckFailed(RuntimeError):
    """The saved checkpoint did not reload into a sane model."""


def run(recipe: str, *, overrides: tuple[str, ...] = (), outputs: Path = Path("outputs"), experiment: str | None = None) -> dict:
    prepared = prepare(recipe, overrides, experiment)
    return execute(prepared, outputs=outputs, experiment=experiment)


# ---------------------------------------------------------------------------------------------
# prepare: every input check, nothing written


def prepare(recipe: str, overrides: tuple[str, ...] = (), experiment: str | None = None) -> Prepared:
    from transformers import AutoConfig, AutoTokenizer

    from quantbench.quantize import get_backend

    loaded = load_recipe(resolve_recipe_path(recipe), overrides)
    spec = loaded.recipe
    where = str(loaded.path)
    try:
        base = models.resolve(spec.model.source, experiment=experiment)
    except UserError as exc:
        raise UserError([f"{where}: {p}" for p in exc.problems]) from None
    problems = check_shapes(loaded, AutoConfig.from_pretrained(base.path))
    if problems:
        raise UserError(problems)
    backend = get_backend(spec.quantize.method, getattr(spec.quantize, "format", None))(spec.quantize)
    tokenizer = AutoTokenizer.from_pretrained(base.path)
    text_shas = {}
    if getattr(backend, "trains", False):  # distillation: student init and training text checked now
        text_shas["training"] = backend.prepare_training(loaded, base, tokenizer)

    calibration = None
    if backend.needs_calibration:
        cal = spec.calibration
        try:
            text = data.load_text(cal.source, field="calibration.source", text_field=cal.text_field, hub_split=cal.split)
            ids = tokenizer(text)["input_ids"]
            calibration = data.calibration_windows(ids, cal.samples, cal.seq_len, cal.seed, field="calibration.samples")
        except UserError as exc:
            raise UserError([f"{where}: {p}" for p in exc.problems]) from None
        text_shas["calibration"] = data.text_sha(text)
    eval_text = data.python_docs("evaluation")
    text_shas["evaluation"] = data.text_sha(eval_text)
    eval_ids = tokenizer(eval_text)["input_ids"][: spec.check.ppl_tokens]
    evaluation = None
    if spec.evaluate is not None:
        from quantbench.evaluate.job import prepare as prepare_evaluation
        from quantbench.evaluate.suite import load_suite

        try:
            evaluation = prepare_evaluation(load_suite(spec.evaluate.suite, "evaluate.suite"), tokenizer)
        except UserError as exc:
            raise UserError([f"{where}: {p}" for p in exc.problems]) from None
    bench = None
    if spec.bench is not None:
        from quantbench.evaluate.bench import prepare as prepare_bench
        from quantbench.evaluate.speed import load_profile

        try:
            profile = load_profile(spec.bench.profile, "bench.profile")
            bench = (spec.bench.profile, profile, prepare_bench(profile, tokenizer))
        except UserError as exc:
            raise UserError([f"{where}: {p}" for p in exc.problems]) from None
    return Prepared(loaded, base, tokenizer, backend, calibration, eval_ids, text_shas, evaluation, bench)


# bitsandbytes 0.50's 4-bit CPU kernels repack weights in blocks of 64 input features (the
# quantization block size) on the first forward; other widths crash there, so check first.
BNB_4BIT_BLOCK = 64


def check_shapes(loaded: LoadedRecipe, config) -> list[str]:
    """A group size must divide the input width of every layer it quantizes."""
    q = loaded.recipe.quantize
    if q.method == "awq" and getattr(q, "format", None) == "awq" and loaded.recipe.model.dtype == "float32":
        return [f"{loaded.path}: {loaded.where('model', 'dtype')}: GPTQModel's AWQ kernels run in bfloat16 or float16, "
                "not float32; use one of those (or format compressed-tensors)"]
    group_size = getattr(q, "group_size", None)
    field, why = "group_size", ""
    if q.method == "bnb" and q.scheme != "INT8":
        import torch

        if torch.cuda.is_available():
            return []
        group_size, field = BNB_4BIT_BLOCK, "scheme"
        why = f" (bitsandbytes 4-bit on CPU packs weights in blocks of {BNB_4BIT_BLOCK} input features)"
    if not group_size:
        return []
    import torch
    from compressed_tensors.utils import match_named_modules
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    widths: dict[int, list[str]] = {}
    outs: dict[int, list[str]] = {}
    for name, module in match_named_modules(skeleton, ["Linear"], loaded.recipe.quantize.ignore):
        widths.setdefault(module.in_features, []).append(name)
        outs.setdefault(module.out_features, []).append(name)
    problems = []
    if q.method == "awq" and getattr(q, "format", None) == "awq":
        from quantbench.quantize.gptqmodel import AWQ_OUT_BLOCK

        odd = {w: n for w, n in outs.items() if w % AWQ_OUT_BLOCK}
        if odd:
            detail = "; ".join(f"output width {w} ({len(n)} layers, e.g. {n[0]})" for w, n in sorted(odd.items()))
            problems.append(f"{loaded.path}: {loaded.where('quantize', 'format')}: GPTQModel's AWQ needs every quantized "
                            f"layer's output width to be a multiple of {AWQ_OUT_BLOCK}; these layers of "
                            f"{loaded.recipe.model.source} are not: {detail}. Use format compressed-tensors "
                            "(llm-compressor), or add them to quantize.ignore.")
    bad = {w: names for w, names in widths.items() if w % group_size}
    if not bad:
        return problems
    detail = "; ".join(f"width {w} ({len(n)} layers, e.g. {n[0]})" for w, n in sorted(bad.items()))
    if why:
        return [f"{loaded.path}: {loaded.where('quantize', field)}: {q.scheme} cannot quantize these layers of "
                f"{loaded.recipe.model.source}{why}: {detail}. Use scheme INT8, or add them to quantize.ignore."]
    divisors = [g for g in (256, 128, 64, 32, 16) if all(w % g == 0 for w in widths)]
    hint = f" Group sizes that fit every layer: {', '.join(map(str, divisors))}." if divisors else ""
    return [
        f"{loaded.path}: {loaded.where('quantize', field)}: {group_size} does not "
        f"divide the input width of these layers of {loaded.recipe.model.source}: {detail}.{hint}"
    ] + problems


# ---------------------------------------------------------------------------------------------
# execute: one MLflow run, a staging dir, the checkpoint renamed into place when sane


def execute(p: Prepared, *, outputs: Path, experiment: str | None) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    spec = p.loaded.recipe
    q = spec.quantize
    tags = {
        TAG + "role": "candidate",
        TAG + "recipe": p.loaded.name,
        TAG + "recipe_sha": p.loaded.sha,
        TAG + "method": q.method,
        TAG + "scheme": q.scheme,
        TAG + "base_model": spec.model.source,
        TAG + "base_fingerprint": p.base.fingerprint,
        TAG + "format": p.backend.format,
        TAG + "loaders": p.backend.loaders(),
        TAG + "kv_cache": getattr(q, "kv_cache", None) or "none",
        TAG + "license": p.base.license,
        **{TAG + k: v for k, v in environment.describe().items()},
        **({TAG + "parent_run": p.base.parent_run} if p.base.parent_run else {}),
        **_sweep_tags(),
    }
    tracker = Tracker(experiment)
    tags["mlflow.note.content"] = (  # the run's description in the MLflow UI
        f"{_what(p)} `{spec.model.source}` by recipe `{p.loaded.path}` (sha {p.loaded.sha[:12]}); "
        f"format {p.backend.format}. {spec.description}".strip()
    )
    with tracker.start_run(run_name=f"{p.loaded.name} · {models.short_name(spec.model.source)}", tags=tags) as run:
        recipe_dir = outputs / p.loaded.name
        final = recipe_dir / run.run_id
        staging = recipe_dir / f".{run.run_id}.partial"
        log_path = recipe_dir / f"{run.run_id}.log"
        from quantbench.logs import log_file

        try:
            with log_file(log_path):
                # First artifact: the resolved recipe with versions, hardware and git sha.
                run.log_dict(
                    {"recipe": p.loaded.resolved, "recipe_file": str(p.loaded.path), "overrides": list(p.loaded.overrides),
                     "recipe_sha": p.loaded.sha, "base_model": {"source": p.base.source, "path": str(p.base.path),
                     "license": p.base.license, "fingerprint": p.base.fingerprint}, "text_sha256": p.text_shas,
                     "environment": environment.describe()},
                    "resolved_recipe.json",
                )
                run.log_params(p.loaded.resolved)
                log.info("run %s: recipe %s (%s %s), base %s", run.run_id, p.loaded.name, q.method, q.scheme, p.base.path)

                dtype = getattr(torch, spec.model.dtype)
                model = AutoModelForCausalLM.from_pretrained(p.base.path, dtype=dtype)
                base_size_mb = _param_bytes(model) / 2**20
                log.info("[1/4] base model perplexity on %d held-out tokens", len(p.eval_ids))
                base_ppl = _perplexity(model, p)

                log.info("[2/4] quantizing: %s %s", q.method, q.scheme)
                started = time.perf_counter()
                trained_ppl, trained = None, {}
                if getattr(p.backend, "loads_quantized", False):
                    # bitsandbytes quantizes while loading: a fresh model, saved before any forward
                    del model
                    model = p.backend.load(p.base.path, dtype)
                elif getattr(p.backend, "writes_checkpoint", False):
                    # GPTQModel: load, quantize and save in a child process, straight into staging
                    del model
                    model = None
                    staging.mkdir(parents=True)
                    p.backend.write(p.base.path, spec.model.dtype, p.calibration, staging, log_path)
                elif getattr(p.backend, "trains", False):
                    # distillation: the loaded model is the teacher; checkpoints are kept outside the
                    # staging dir (keyed by the recipe hash) so an interrupted job resumes from them
                    model, trained = p.backend.train(model, p.tokenizer, run, training_dir(outputs, p),
                                                     (p.eval_ids, spec.check.window))
                    trained_ppl = trained["distill/ppl_after"]  # the same text and windows as the check's
                else:
                    p.backend.quantize(model, p.calibration)
                wall_s = time.perf_counter() - started
                peak_rss_mb = max(resource.getrusage(who).ru_maxrss for who in
                                  (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)) / 1024

                if model is not None:
                    log.info("[3/4] saving to %s", staging)
                    staging.mkdir(parents=True)
                    p.backend.save(model, p.tokenizer, staging)
                    del model

                log.info("[4/4] reloading the saved checkpoint from disk and checking it")
                check = _reload_check(staging, p, base_ppl, trained_ppl)
                _write_checkpoint_info(staging, p, run.run_id)
                size_mb = models.weights_size_mb(staging)
                metrics = {
                    "quantize/wall_s": wall_s,
                    "quantize/peak_rss_mb": peak_rss_mb,
                    "model/size_mb": size_mb,
                    "model/base_size_mb": base_size_mb,
                    "model/compression_ratio": base_size_mb / size_mb,
                    **check["metrics"],
                    **trained,
                }
                sample = check["sample"]
                _write_model_card(staging, final, p, metrics, sample, run.run_id)
                staging.rename(final)
                shutil.rmtree(training_dir(outputs, p), ignore_errors=True)  # done: nothing to resume
                run.log_metrics(metrics)
                run.set_tags({TAG + "checkpoint": final.resolve()})
                log.info("checkpoint: %s", final)
                if p.evaluation is not None:
                    from quantbench.evaluate.job import evaluate_loaded

                    log.info("evaluate: suite %s on the reloaded checkpoint", p.evaluation.suite.name)
                    evaluated = evaluate_loaded(check["model"], check["tokenizer"], p.base, p.evaluation, run, tracker)
                    metrics.update(evaluated["metrics"])
                if p.bench is not None:
                    from quantbench.evaluate.bench import bench_loaded

                    del check  # the bench loads one model at a time
                    metrics.update(bench_loaded(final, p.base, p.bench[2], p.bench[0], p.bench[1], run,
                                                spec.bench.backend))
                if p.evaluation is not None or p.bench is not None:
                    _write_model_card(final, final, p, metrics, sample, run.run_id)  # now with quality and speed
                run.log_artifact(final / "README.md")
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        finally:
            if log_path.exists():
                run.log_artifact(log_path)
    return {"run_id": run.run_id, "checkpoint": str(final), "log": str(log_path), "metrics": metrics}


def training_dir(outputs: Path, p: Prepared) -> Path:
    """Where a distillation job keeps its resumable checkpoints: one per recipe content hash."""
    return outputs / p.loaded.name / f".distill-{p.loaded.sha[:16]}"


def _what(p: Prepared) -> str:
    q = p.loaded.recipe.quantize
    return "distillation (student in bf16) of" if q.method == "distill" else f"{q.method} {q.scheme} of"


def _sweep_tags() -> dict[str, str]:
    """Set by `quantbench sweep` for its children: group the run under the sweep's parent run, and
    record the pid so a resumed sweep can tell a run whose process died."""
    import os

    from quantbench.sweep import ENV_JOB, ENV_PARENT, ENV_SWEEP

    if ENV_SWEEP not in os.environ:
        return {}
    tags = {TAG + "sweep": os.environ[ENV_SWEEP], TAG + "sweep_job": os.environ.get(ENV_JOB, ""), TAG + "pid": str(os.getpid())}
    if os.environ.get(ENV_PARENT):
        tags["mlflow.parentRunId"] = os.environ[ENV_PARENT]
    return tags


def _perplexity(model, p: Prepared) -> float:
    from quantbench.evaluate.quality import perplexity

    return perplexity(model, p.eval_ids, p.loaded.recipe.check.window)


def _reload_check(path: Path, p: Prepared, base_ppl: float, trained_ppl: float | None = None) -> dict:
    """Quality of the in-memory model says nothing about what was saved: load it back.

    A quantized checkpoint is bounded against the base model; a distilled student (a different,
    smaller model) against itself before saving, `trained_ppl`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantbench.evaluate.quality import greedy_text

    check = p.loaded.recipe.check
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    reload_ppl = _perplexity(model, p)
    sample, new_tokens = greedy_text(model, tokenizer, check.prompt, check.generate_tokens)
    ratio = reload_ppl / base_ppl
    log.info("base ppl %.3f, reloaded ppl %.3f (x%.3f); sample: %r", base_ppl, reload_ppl, ratio, sample)
    reference, against = (base_ppl, "the base model's") if trained_ppl is None else (trained_ppl, "the trained student's (in memory)")
    if not math.isfinite(reload_ppl) or reload_ppl / reference > check.max_ppl_ratio:
        raise CheckpointCheckFailed(
            f"the saved checkpoint reloads with perplexity {reload_ppl:.4g} against {against} "
            f"{reference:.4g} (x{reload_ppl / reference:.3g} > check.max_ppl_ratio {check.max_ppl_ratio})"
        )
    if new_tokens == 0:
        raise CheckpointCheckFailed("the saved checkpoint generated no tokens")
    metrics = {"check/base_ppl": base_ppl, "check/reload_ppl": reload_ppl, "check/ppl_ratio": ratio}
    if trained_ppl is not None:
        metrics["check/trained_ppl"] = trained_ppl
    return {
        "metrics": metrics,
        "sample": sample,
        "model": model,
        "tokenizer": tokenizer,
    }


def _write_checkpoint_info(dest: Path, p: Prepared, run_id: str) -> None:
    """How this checkpoint was made, for `quantbench evaluate <dir>` and later stages."""
    import json

    q = p.loaded.recipe.quantize
    info = {
        "run_id": run_id,
        "recipe": p.loaded.name,
        "recipe_sha": p.loaded.sha,
        "method": q.method,
        "scheme": q.scheme,
        "format": p.backend.format,
        "loaders": p.backend.loaders(),
        "kv_cache": getattr(q, "kv_cache", None),
        "base_model": {"source": p.base.source, "name": p.base.name, "fingerprint": p.base.fingerprint, "license": p.base.license},
        "parent_run": p.base.parent_run,
    }
    (dest / "quantbench.json").write_text(json.dumps(info, indent=2))


def _param_bytes(model) -> int:
    """Bytes of the model's unique tensors in their loaded dtype (tied weights counted once)."""
    seen = {}
    for tensor in list(model.parameters()) + list(model.buffers()):
        seen[tensor.data_ptr()] = tensor.numel() * tensor.element_size()
    return sum(seen.values())


def _write_model_card(dest: Path, final: Path, p: Prepared, metrics: dict, sample: str, run_id: str) -> None:
    spec = p.loaded.recipe
    q = spec.quantize
    front = {
        "license": p.base.license,
        "base_model": p.base.name,
        "library_name": "transformers",
        "tags": ["quantbench", p.backend.format, q.method, q.scheme.lower()],
    }
    rows = "\n".join(f"| `{k}` | {v:.4g} |" for k, v in sorted(metrics.items()))
    distilled = q.method == "distill"
    made = (p.backend.card(p.base) if distilled else
            "- Calibration: " + ("none" if p.calibration is None else
                                 f"{len(p.calibration)} × {spec.calibration.seq_len} tokens of `{spec.calibration.source}`"))
    lineage = f"\n- Made from the output of MLflow run `{p.base.parent_run}`" if p.base.parent_run else ""
    card = f"""---
{yaml.safe_dump(front, sort_keys=False).strip()}
---
# {p.base.name} — {"distilled student (bf16)" if distilled else f"{q.method} {q.scheme}"}

{"Distilled" if distilled else "Quantized"} by quantbench from `{spec.model.source}` with the recipe `{p.loaded.name}`
(sha256 `{p.loaded.sha[:16]}`), MLflow run `{run_id}`.

- {"Teacher" if distilled else "Base model"}: {p.base.name} (`{spec.model.source}`, fingerprint `{p.base.fingerprint[:16]}`){lineage}
- Licence: {p.base.license} (inherited from the base model)
- Method / scheme: {q.method} / {q.scheme}
- Format: {p.backend.format}; loads with: {p.backend.loaders()}
- KV cache: {"FP8, per-tensor scales calibrated on the calibration data (vLLM: `--kv-cache-dtype fp8`)" if getattr(q, "kv_cache", None) else "not quantized (16-bit)"}
{made}

## Metrics

| metric | value |
|---|---|
{rows}

`check/*` come from reloading this directory from disk: perplexity on {len(p.eval_ids)} held-out
tokens of the Python documentation, against the base model in {spec.model.dtype}.
Greedy sample after "{spec.check.prompt}": {sample!r}

## Load

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained("{final}")
```
or serve it: `vllm serve {final}`{" --kv-cache-dtype fp8" if getattr(q, "kv_cache", None) else ""}.

## Resolved recipe

```yaml
{yaml.safe_dump(p.loaded.resolved, sort_keys=False).strip()}
```
"""
    tmp = dest / ".README.md.tmp"
    tmp.write_text(card)
    tmp.rename(dest / "README.md")
