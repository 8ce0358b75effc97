"""Each step's model, found, and its quality against the stack's base.

A step that changes the model carries the quality of that model against the original base, from
its own quantbench run (the evaluate stage's `quality/kld_mean` with its interval, or llama.cpp's
`quality_engine/kld_mean` for a GGUF checkpoint; the reload check's `check/ppl_ratio` where the run
was not evaluated): `quantbench evaluate RUN` computes it, and the ledger reads it. Scored here is
only what no run has against the base: a model made from another step's model, and a model served
with its KV cache in a smaller type.
"""

from __future__ import annotations

import logging
from pathlib import Path

from quantbench import engines
from quantbench.core import hardware
from quantbench.core.errors import UserError
from quantbench.core.intervals import HIGH, LOW
from quantbench.engines import llamacpp
from quantbench.jobs import pipeline, prepare
from quantbench.jobs.stack.schema import BASE, Config, Resolved, StackFile
from quantbench.quality import stage
from quantbench.quality.suite import DEFAULT_SUITE, load_suite
from quantbench.recipe import load_recipe, resolve_recipe_path
from quantbench.sources import data, models
from quantbench.sources.checkpoint import check_loadable, gguf_file, load_model, resolve_target
from quantbench.sources.models import ResolvedModel
from quantbench.tracking import TAG, Tracker

log = logging.getLogger(__name__)

AGAINST_BASE_LOG = "against-base.log"
CHAIN_TOKENS, CHAIN_WINDOW = 8192, 512  # a model made from another step's model, scored against the base
# the quality figure a step's model shows, first found in its run: (metric, label)
QUALITY_KEYS = (
    ("quality/kld_mean", "KLD"),
    ("quality_engine/kld_mean", "KLD (llama.cpp)"),
    ("check/ppl_ratio", "ppl ratio (reload check)"),
)


def resolve_models(
    stack: StackFile, steps: list[Config], tracker: Tracker, experiment: str | None, outputs: Path
) -> tuple[ResolvedModel, dict[str | None, Resolved]]:
    """The base model and each step's model: `run:ID` read from the store, `recipe:NAME` from its
    newest finished run in the experiment made from the same source (the stack's base, or the
    model of the step named by `source:`), run now through the quantize pipeline when there is
    none; a directory as it is. Bad references are refused before any recipe runs; the recipes
    then run in step order (a student before the recipe that quantizes it)."""
    base = models.resolve(stack.base, field="base", experiment=experiment)
    found: dict[str | None, Resolved] = {None: Resolved(base.path, label=models.short_name(stack.base))}
    found[BASE] = found[None]
    pending: list[Config] = []
    problems: list[str] = []
    wanted = {c.model_key: c for c in steps if c.model is not None}
    for c in steps:  # a draft named by reference (not by an earlier step) is resolved like a step's model
        if c.draft is not None and c.draft != BASE and c.draft not in wanted:
            wanted[c.draft] = Config(c.engine, c.dtype, c.draft, 1)
    for config in wanted.values():
        ref, key = config.model, config.model_key
        assert ref is not None and key is not None
        if ref.startswith("recipe:"):
            name = ref.removeprefix("recipe:")
            source = _source_of(config, found, stack.base)
            runs = (
                []
                if source is None
                else tracker.search({TAG + "recipe": name, TAG + "role": "candidate", TAG + "base_model": source})
            )
            if runs:
                found[key] = _from_run(runs[0].info.run_id, tracker, ref, stack.base)
            else:
                try:
                    loaded = load_recipe(resolve_recipe_path(name))
                    problems += [f"model {ref}: {p}" for p in prepare.check_without_model(loaded, experiment)]
                except UserError as exc:
                    problems += [f"model {ref}: {p}" for p in exc.problems]
                pending.append(config)
            continue
        try:
            target = resolve_target(ref.removeprefix("run:"), tracker, stack.base)
            check_loadable(target.checkpoint)
        except UserError as exc:
            problems += [f"model {ref}: {p}" for p in exc.problems]
            continue
        run_id = target.run_id
        found[key] = _from_run(run_id, tracker, ref, stack.base) if run_id else Resolved(target.checkpoint, label=ref)
    if problems:
        raise UserError(problems)
    for config in pending:
        ref, name = config.model or "", (config.model or "").removeprefix("recipe:")
        source = _source_of(config, found, stack.base)
        assert source is not None  # the step it starts from ran before it
        log.info("stack: %s from %s has no finished run in this experiment: running it now "
                 "(quantbench quantize %s --set model.source=%s)", ref, source, name, source)  # fmt: skip
        # the stack measures speed itself: the recipe's bench stage is left out
        result = pipeline.quantize(
            name, overrides=(f"model.source={source}", "bench=null"), outputs=outputs, experiment=experiment
        )
        found[config.model_key] = _from_run(result.run_id, tracker, ref, stack.base)
    return base, found


def _source_of(config: Config, found: dict[str | None, Resolved], base: str) -> str | None:
    """The model.source a recipe step's recipe starts from: the stack's base, or the model of the
    step it names (`run:ID` of that model's run, or its directory); None while that model's recipe
    has not run yet."""
    if config.source is None:
        return base
    earlier = found.get(config.source)
    if earlier is None:
        return None
    return f"run:{earlier.run_id}" if earlier.run_id else str(earlier.path)


def _from_run(run_id: str, tracker: Tracker, ref: str, base: str) -> Resolved:
    target = resolve_target(run_id, tracker, None)
    check_loadable(target.checkpoint)
    run = tracker.get(run_id, ref)
    run_base = run.data.tags.get(TAG + "base_model", "")
    return Resolved(
        target.checkpoint, run_id, dict(run.data.metrics), f"{ref} ({run.info.run_name})",
        base=run_base if run_base != base else None,
    )  # fmt: skip


def quality_of(resolved: Resolved) -> dict | None:
    """The quality figure a model's run carries against the base: {metric, label, value, ci}."""
    if resolved.base is not None:  # its run measured it against another model: no figure against the base
        return None
    for key, label in QUALITY_KEYS:
        if key in resolved.metrics:
            low, high = resolved.metrics.get(key + LOW), resolved.metrics.get(key + HIGH)
            return {
                "metric": key,
                "label": label,
                "value": resolved.metrics[key],
                "ci": [low, high] if low is not None and high is not None else None,
            }
    return None


def _scoring_inputs(base: Path, workdir: Path) -> tuple[str, Path, Path]:
    """What llama-perplexity scores a model against the stack's base on: CHAIN_TOKENS of the
    held-out text, the base's F16 file, and the log both write to."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base)
    ids = tokenizer(data.python_docs("evaluation"))["input_ids"][:CHAIN_TOKENS]
    log_path = workdir / AGAINST_BASE_LOG
    return tokenizer.decode(ids, skip_special_tokens=True), llamacpp.base_gguf(base, log_path=log_path), log_path


def against_base(models_: dict[str | None, Resolved], workdir: Path, base: ResolvedModel, tracker: Tracker) -> None:
    """A model made from another step's model (a student quantized) carries its run's quality
    against *that* model; the ledger wants it against the stack's base. A GGUF one is scored here
    through llama.cpp (llama-perplexity's KL divergence against the base's F16 file, on
    CHAIN_TOKENS of the held-out text); any other through transformers, evaluated with the suite
    its run used (`evaluated_against_base`)."""
    chained = [r for r in models_.values() if r.base is not None]
    if not chained:
        return
    scoring = None
    for resolved in chained:
        gguf = gguf_file(resolved.path)
        log.info("stack: %s was measured against %s; scoring it against the base through %s",
                 resolved.label, resolved.base, "llama.cpp" if gguf else "transformers")  # fmt: skip
        try:
            if gguf is None:
                # the suite its own run was evaluated with
                suite = tracker.get(resolved.run_id).data.tags.get(TAG + "suite") if resolved.run_id else None
                resolved.metrics = evaluated_against_base(resolved.path, base, tracker, suite)
            else:
                scoring = scoring or _scoring_inputs(models_[None].path, workdir)
                text, base_file, log_path = scoring
                resolved.metrics = llamacpp.engine_quality(
                    base_file, gguf, text, CHAIN_WINDOW, workdir / "kld", log_path
                )
        except UserError as exc:  # the step is measured all the same; its quality stays unknown
            log.warning("stack: %s: no quality against the base: %s", resolved.label, "; ".join(exc.problems))
            continue
        resolved.base = None
        resolved.label += " (quality against the base measured by the stack)"


def evaluated_against_base(
    checkpoint: Path, base: ResolvedModel, tracker: Tracker, suite: str | None = None
) -> dict[str, float]:
    """A checkpoint's metrics against the base model with a suite (default: default), in
    transformers, as its own run's evaluate stage scores it against its source: KL divergence,
    top-1 agreement, perplexity, the suite's tasks and answer flips, with their intervals (the
    base's side from its baseline run, found in or added to `tracker`'s experiment). They go into
    the stack's ledger, never into the checkpoint's own run."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base.path)
    plan = stage.prepare(load_suite(suite or DEFAULT_SUITE), tokenizer)
    model = load_model(checkpoint, dtype=hardware.compute_dtype_of(checkpoint))
    return stage.evaluate(model, tokenizer, base, plan, tracker).metrics


def kv_cache_quality(
    steps: list[Config], models_: dict[str | None, Resolved], workdir: Path
) -> dict[tuple[str | None, str], dict | None]:
    """A step that keeps its server's KV cache in a smaller type changes what the model computes:
    its model so served, scored against the base through llama.cpp (llama-perplexity's KL divergence
    with that KV-cache type against the base's F16 file with its 16-bit one, on CHAIN_TOKENS of the
    held-out text). {(model key, type): quality figure, or None where it cannot be scored}."""
    wanted = sorted({(c.model_key, c.kv_cache) for c in steps if c.kv_cache}, key=str)
    if not wanted:
        return {}
    text, base_file, log_path = _scoring_inputs(models_[None].path, workdir)
    out: dict[tuple[str | None, str], dict | None] = {}
    for key, kv_cache in wanted:
        resolved = models_[key]
        if resolved.base is not None and gguf_file(resolved.path) is None:
            out[(key, kv_cache)] = None  # measured against another model, and no GGUF to score here
            continue
        model_file = gguf_file(resolved.path) or llamacpp.base_gguf(resolved.path, log_path=log_path)
        log.info("stack: scoring %s with a %s KV cache against the base through llama.cpp", resolved.label or "the base",
                 kv_cache)  # fmt: skip
        flags = ["--cache-type-k", kv_cache, "--cache-type-v", kv_cache, "--flash-attn", "on"]
        try:
            metrics = llamacpp.engine_quality(
                base_file, model_file, text, CHAIN_WINDOW, workdir / "kld", log_path, flags
            )
        except UserError as exc:  # the step is measured all the same; its quality stays unknown
            log.warning(
                "stack: %s with a %s KV cache: no quality: %s", resolved.label, kv_cache, "; ".join(exc.problems)
            )
            out[(key, kv_cache)] = None
            continue
        out[(key, kv_cache)] = quality_of(Resolved(resolved.path, metrics=metrics)) | {
            "label": f"KLD (llama.cpp, {kv_cache} KV cache)"
        }
    return out


def check_engines(stack: StackFile, steps: list[Config], models_: dict[str | None, Resolved]) -> None:
    """Every step's model is one its engine serves here, said before anything starts."""
    problems = []
    for i, config in enumerate(steps):
        engine = engines.get(config.engine)
        path = models_[config.model_key].path
        why = engine.unavailable() or engine.unserved(path)
        if why:
            problems.append(f"steps.{i} ({stack.steps[i].name}): {engine.label} cannot serve {path} here: {why}")
    base = models_[None].path
    others = {str(models_[c.model_key].path) for c in steps if c.model is not None} - {str(base)}
    drafts = {str(models_[c.draft].path) for c in steps if c.draft is not None} - {str(base)} - others
    differ = _tokenizers_differ(sorted(others | drafts), base)
    problems += [
        f"model {p}: its tokenizer reads the prompts differently from the base model's ({base}); "
        "a stack compares models on the same tokens"
        for p in sorted(others & differ)
    ]
    problems += [
        f"model {p}: a draft: its tokenizer is not the target's (the base model's) ({base}); "
        "a draft must propose the target's tokens"
        for p in sorted(drafts & differ)
    ]
    if problems:
        raise UserError(problems)


def _tokenizers_differ(paths: list[str], base: Path) -> set[str]:
    """The models that do not read the prompts as the base does (other token ids for a sample)."""
    from transformers import AutoTokenizer

    if not paths:
        return set()
    sample = data.python_docs("evaluation")[:4000]
    want = AutoTokenizer.from_pretrained(base)(sample)["input_ids"]
    return {p for p in paths if AutoTokenizer.from_pretrained(p)(sample)["input_ids"] != want}
