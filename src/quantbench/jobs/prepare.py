"""A quantize job's inputs, every one checked before the first byte is written: `prepare` checks the
recipe, the model source, its shapes, the texts, the suite and the profile, plans each stage's memory
and disk, scores the base model once (its perplexity, refused when it predicts worse than a unigram
model), and returns the `Job` that `pipeline.execute` runs. Bad input leaves no output directory and
no MLflow run. Also here: `check_without_model` (what `quantbench validate` checks) and `plan_only`
(`quantize --plan`: prepare stopped after the plan)."""

from __future__ import annotations

import json
import logging
import re
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from quantbench.core import hardware
from quantbench.core.errors import UserError, check_creatable_dir
from quantbench.core.logs import DETAIL
from quantbench.core.resources import StageCost
from quantbench.core.upcast import slowdown
from quantbench.jobs import footprint
from quantbench.jobs.footprint import Footprint
from quantbench.quality import stage as evaluate_stage
from quantbench.quality.suite import load_suite
from quantbench.quantize import Quantizer, estimate, make_quantizer
from quantbench.recipe import LoadedRecipe, RecipeError, load_recipe, resolve_recipe_path
from quantbench.sources import data, models, verify
from quantbench.sources.shapes import Shape
from quantbench.speed import stage as bench_stage
from quantbench.speed.measure import load_profile
from quantbench.tracking import TAG, Tracker

log = logging.getLogger(__name__)
detail = logging.getLogger(DETAIL)  # the run's log file only: the terminal ends with the verdict

SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")


@dataclass
class Job:
    """Everything a quantize job needs, all checked before the first byte is written."""

    loaded: LoadedRecipe
    base: models.ResolvedModel
    tokenizer: object
    quantizer: Quantizer
    calibration: list[list[int]] | None
    check_ids: list[int]  # held-out tokens of the reload check (and the base perplexity)
    text_shas: dict[str, str]
    evaluation: evaluate_stage.Plan | None  # the recipe's evaluate: section, prepared
    bench: bench_stage.Plan | None  # the recipe's bench: section, prepared
    compute_dtype: str = "float32"  # model.compute_dtype resolved on this device (quantbench.hardware)
    produce_estimate: estimate.Estimate | None = (
        None  # the produce step's expected wall time here, when it depends on data
    )
    model: object = None  # the base model in the compute dtype, when prepare loaded it (execute takes it)
    base_ppl: float = float("nan")  # the base's perplexity on check_ids in the compute dtype (the base check's pass)
    footprint: Footprint | None = None  # each stage's memory and disk, planned
    prepare_cost: StageCost | None = None  # what prepare itself cost (it runs before the run exists)

    @property
    def produce_dtype(self) -> str:
        """The dtype the produce step computes in: the quantizer's own where it says (GPTQModel's AWQ
        computes in the saved dtype), else the job's compute dtype."""
        return self.quantizer.computes_in(self.loaded.recipe.model) or self.compute_dtype

    def take_model(self):
        """The base model loaded in prepare, handed over once (None when prepare loaded none)."""
        model, self.model = self.model, None
        return model


class _Planned(Exception):
    """prepare's way out after the memory plan when only the plan was asked for (`quantize --plan`)."""

    def __init__(self, footprint: Footprint):
        super().__init__("planned")
        self.footprint = footprint


def plan_only(
    recipe: str, *, overrides: tuple[str, ...] = (), outputs: Path = Path("outputs"), experiment: str | None = None
) -> Footprint:
    """`quantize --plan`: every input check and the memory and disk plan of each stage, from the
    model's config and the recipe; no model loaded, nothing written, no run. Raises UserError
    (exit 2) where the job would not fit, as the job itself would."""
    try:
        prepare(recipe, overrides, experiment=experiment, outputs=outputs, stop_at_plan=True)
    except _Planned as planned:
        return planned.footprint
    raise AssertionError("prepare went past the plan")


def prepare(
    recipe: str,
    overrides: tuple[str, ...] = (),
    *,
    experiment: str | None = None,
    outputs: Path = Path("outputs"),
    strict_budget: bool = False,
    stop_at_plan: bool = False,
) -> Job:
    from transformers import AutoTokenizer

    loaded, base, quantizer = _checked_inputs(recipe, overrides, experiment, outputs)
    spec = loaded.recipe
    where = str(loaded.path)
    tokenizer = AutoTokenizer.from_pretrained(base.path)
    calibration, text_shas = _calibration(loaded, quantizer, tokenizer)
    eval_text = data.python_docs("evaluation")
    text_shas["evaluation"] = data.text_sha(eval_text)
    eval_ids = data.text_ids(tokenizer, eval_text)
    bos = data.bos_id(tokenizer)  # every window starts with it, where the tokenizer adds one
    check_ids = data.framed(eval_ids, spec.check.window, bos)[: spec.check.ppl_tokens]
    evaluation, bench = _later_stages(loaded, base, quantizer, tokenizer)
    compute_dtype = spec.model.computes_in()
    base_checked = verify.check_cached(
        _base_check_key(base, tokenizer, eval_ids, spec.check.ppl_tokens, spec.check.window, compute_dtype)
    )
    footprint = _plan(loaded, base, quantizer, compute_dtype, evaluation, bench, outputs, experiment, base_checked)
    _say_plan(footprint, where, stop_at_plan)
    # after the plan: a quantizer's own preparation can be heavy (llama.cpp's conversion of the base)
    text_shas = quantizer.prepare(loaded, base, tokenizer) | text_shas  # its texts first, as recorded before
    loader = _BaseLoader(base.path, compute_dtype)
    with _prefixed(where):
        check = check_base(
            base, tokenizer, eval_ids, spec.check.ppl_tokens, spec.check.window, "model.source",
            dtype=compute_dtype, loader=loader, enforce=spec.check.base_ppl_bound,
        )  # fmt: skip
    produce_estimate = _estimate(
        loaded, footprint.shape, quantizer, calibration, eval_ids, compute_dtype, strict_budget, loader
    )
    if evaluation is not None and check.seconds_per_token:
        _say_evaluation_cost(evaluation, check.seconds_per_token, footprint, spec.evaluate.suite, compute_dtype)
    model = loader.model if quantizer.takes_model else None
    loader.release()
    return Job(
        loaded,
        base,
        tokenizer,
        quantizer,
        calibration,
        check_ids,
        text_shas,
        evaluation,
        bench,
        compute_dtype,
        produce_estimate,
        model,
        check.ppl,
        footprint,
    )


def _checked_inputs(recipe: str, overrides: tuple[str, ...], experiment: str | None, outputs: Path):
    """The recipe loaded, its base model resolved and its quantizer made, every check that needs no
    weights passed (all problems at once); warnings for a base that is itself quantized."""
    from transformers import AutoConfig

    try:
        loaded = load_recipe(resolve_recipe_path(recipe), overrides)
    except RecipeError as exc:  # with what the schema accepted, the checks that do not depend on the rest
        found = exc.problems + (check_without_model(exc.partial, experiment, exc.invalid) if exc.partial else [])
        raise UserError(found) from None
    spec = loaded.recipe
    check_outputs(loaded, outputs)
    problems = check_without_model(loaded, experiment)  # every one at once, before the checks that load
    if problems:
        raise UserError(problems)
    with _prefixed(str(loaded.path)):
        base = models.resolve(spec.model.source, experiment=experiment)
    if note := base.quantized_note():
        log.warning("%s", note)
    if base.same_type(candidate_type(spec.quantize)):
        log.warning("%s", same_type_note(base))
    quantizer = make_quantizer(spec.quantize)
    problems = quantizer.check(loaded, AutoConfig.from_pretrained(base.path))
    if problems:
        raise UserError(problems)
    return loaded, base, quantizer


def _calibration(loaded, quantizer: Quantizer, tokenizer) -> tuple[list[list[int]] | None, dict[str, str]]:
    """The calibration windows where the quantizer calibrates, and the sha of their text by role."""
    if not quantizer.calibrates:
        return None, {}
    cal = loaded.recipe.calibration
    with _prefixed(str(loaded.path)):
        text = data.load_text(cal.source, field="calibration.source", text_field=cal.text_field, hub_split=cal.split)
        windows = data.recipe_windows(tokenizer, text, cal)
    return windows, {"calibration": data.text_sha(text)}


def _later_stages(loaded, base, quantizer: Quantizer, tokenizer):
    """The evaluate and bench stages' plans (None where the recipe has no such section), checked
    now: the bench's engine against the config the checkpoint will have."""
    spec = loaded.recipe
    evaluation = bench = None
    with _prefixed(str(loaded.path)):
        if spec.evaluate is not None:
            evaluation = evaluate_stage.prepare(load_suite(spec.evaluate.suite, "evaluate.suite"), tokenizer)
        if spec.bench is not None:
            bench = bench_stage.prepare(
                spec.bench.profile,
                tokenizer,
                engine=spec.bench.engine,
                checkpoint=_expected_config(base.path / "config.json", quantizer),
                base_path=base.path,
                field="bench.profile",
                engine_field="bench.engine",
            )
    return evaluation, bench


def _say_plan(footprint, where: str, stop_at_plan: bool) -> None:
    """Log the memory plan's peak (every stage with `stop_at_plan`); refuse a job that cannot fit
    (UserError naming what would make it fit); `_Planned` after the plan with `stop_at_plan`."""
    peak = footprint.tightest
    log.info(
        "memory plan: peak %.2f GiB (%s%s) of %.1f GiB available; every stage's in the log",
        peak.needed / 2**30,
        peak.name,
        f", and {peak.reclaimable / 2**30:.2f} GiB of file pages the kernel can drop" if peak.reclaimable else "",
        footprint.ram_available / 2**30,
    )
    if stop_at_plan:
        for line in footprint.lines():
            log.info("%s", line)
    problems = footprint.problems(where)
    if problems:
        raise UserError(problems)
    if stop_at_plan:
        raise _Planned(footprint)


# lm-eval's items of the offline suite: a context and a continuation, ~100 tokens each, scored once
# per choice; a quality pass's token costs what the base check's did
TASK_ITEM_TOKENS = 128


def _say_evaluation_cost(
    evaluation, seconds_per_token: float, planned: Footprint, suite: str, compute: str = "float32"
) -> None:
    """How long the evaluate stage will take here, from the base check's measured time per token:
    the suite's texts and task items for the candidate, and for the base when its baseline is new
    (computed in float32 from the stored weights: slower than the check's pass where the compute
    dtype is a native 16-bit one, by the ratio a layer's pass measures here)."""
    spec = evaluation.suite.suite
    items = sum(
        min(evaluation.task_counts.get(t, 0), spec.task_limit or evaluation.task_counts.get(t, 0)) for t in spec.tasks
    )
    tokens = len(evaluation.token_ids) + len(evaluation.ood_ids or []) + items * TASK_ITEM_TOKENS
    scoring_base = any(s.name == "baseline" for s in planned.stages)
    wider = 1.0
    if scoring_base and planned.shape is not None:
        wider = max(1.0, slowdown(compute, planned.shape.hidden, spec.window * spec.batch_size))
    minutes = (1 + scoring_base * wider) * tokens * seconds_per_token / 60
    log.info(
        "evaluate: ~%.0f min here with suite %s (%d tokens of text and %d task items per model, %s)",
        minutes,
        suite,
        len(evaluation.token_ids) + len(evaluation.ood_ids or []),
        items,
        (f"the base's baseline to score too, in float32: {wider:.1f}x the candidate's time here" if wider > 1.05
         else "the base's baseline to score too") if scoring_base else "the base's baseline reused",
    )  # fmt: skip
    if minutes > 30 and suite != "large":
        log.info("evaluate: a suite sized for large models takes a fraction of that: --set evaluate.suite=large")


class _BaseLoader:
    """The base model in the compute dtype, loaded at most once in prepare (by the base check or the
    estimate, whichever needs it first) and handed to the job, or let go."""

    def __init__(self, path: Path, dtype: str):
        self.path, self.dtype = path, dtype
        self.model = None

    def __call__(self):
        if self.model is None:
            import torch
            from transformers import AutoModelForCausalLM

            self.model = AutoModelForCausalLM.from_pretrained(self.path, dtype=getattr(torch, self.dtype)).eval()
        return self.model

    def release(self) -> None:
        self.model = None


def _plan(
    loaded, base, quantizer, compute: str, evaluation, bench, outputs: Path, experiment, base_checked: bool = False
) -> Footprint:
    """The job's memory and disk, stage by stage, from the base's config and the recipe."""
    from transformers import AutoConfig

    spec = loaded.recipe
    shape = Shape.from_config(AutoConfig.from_pretrained(base.path))
    produce = footprint.produce_footprint(quantizer, shape, loaded, compute)
    if quantizer.prepared(base):  # its conversion is cached: prepare converts nothing
        produce = replace(produce, prepare_held=[], prepare_disk=0)
    estimating = (quantizer.calibrates or quantizer.trains) and estimate.passes(spec.quantize, 1, 1) is not None
    cached = evaluation is None or evaluate_stage.baseline_exists(Tracker(experiment, reap=False), base, evaluation)
    return footprint.plan(
        shape,
        compute=compute,
        saved=spec.model.dtype,
        produce=produce,
        check_window=spec.check.window,
        estimate_window=spec.calibration.seq_len if estimating else None,
        evaluation=evaluation,
        baseline_cached=cached,
        base_checked=base_checked,
        bench=bench,
        outputs=outputs / loaded.name,
        gpu_total=hardware.cuda_memory(),
    )


def candidate_type(q) -> str | None:
    """The type a recipe quantizes into, named as ResolvedModel.quantized names a base's
    ("GGUF Q4_K_M"), where the two can be compared; None otherwise."""
    return f"GGUF {q.scheme}" if q.method == "gguf" else None


def same_type_note(base: models.ResolvedModel) -> str:
    return (
        f"the candidate is quantized into its base's own type ({base.quantized}): it reproduces the base's grid "
        "almost exactly, so its quality against this base says little about its loss against the original model"
    )


def base_tags(base: models.ResolvedModel, candidate: str | None = None) -> dict[str, str]:
    """What a run records of a base that is itself quantized (compare and the verdict show it)."""
    tags = {TAG + "base_quantized": base.quantized or "none"}
    if base.same_type(candidate):
        tags[TAG + "same_type_as_base"] = "true"
    return tags


def _estimate(
    loaded: LoadedRecipe,
    shape: Shape,
    quantizer: Quantizer,
    calibration: list[list[int]] | None,
    eval_ids: list[int],
    dtype: str,
    strict: bool,
    loader: _BaseLoader,
) -> estimate.Estimate | None:
    """Time a few forward passes, say how long the produce step will take, and hold it to the
    recipe's budget_minutes (refused with `strict`: exit 2, before any run exists). None where the
    method's time does not grow with data. `shape`: the base's, as the memory plan read it."""
    spec, q = loaded.recipe, loaded.recipe.quantize
    if not (quantizer.calibrates or quantizer.trains) or estimate.passes(q, 1, 1) is None:
        return None
    if calibration is not None:
        windows = calibration
    else:  # a trained model: windows of its training length, from held-out text (only timed, never learnt)
        length = getattr(q, "seq_len", spec.calibration.seq_len)
        windows = [eval_ids[i : i + length] for i in range(0, min(len(eval_ids), 3 * length), length)]
    found = estimate.estimate(q, loader(), windows, shape.layers, dtype, shape.quantized_params / shape.layers)
    log.info(
        "estimate: the produce step will take ~%.1f min here (%s; %s)",
        found.minutes(),
        found.basis,
        hardware.device_line(),
    )
    if found.over(spec.budget_minutes):
        message = (
            f"{loaded.path}: budget_minutes: the produce step is estimated at {found.minutes():.1f} min on this "
            f"machine ({hardware.device_line()}), over the recipe's budget of {spec.budget_minutes:g} min. "
            "Options: fewer calibration windows (--set calibration.samples=N) or shorter ones "
            "(--set calibration.seq_len=N)"
            + (", fewer grid points (--set quantize.n_grid=N)" if q.method == "awq" else "")
            + (", fewer steps (--set quantize.steps=N)" if q.method == "distill" else "")
            + f", or a larger budget (--set budget_minutes={max(1, round(found.minutes() * 1.2))})."
        )
        if strict:
            raise UserError(message + " Refused: --strict-budget.")
        log.warning("%s Going on (--strict-budget refuses instead).", message)
    return found


def _expected_config(config_path: Path, quantizer: Quantizer) -> dict:
    """The config.json the recipe's checkpoint will have, as far as serving it goes (its
    quantization_config sketched from the recipe), so that the bench engine is chosen before the job."""
    config = json.loads(config_path.read_text())
    config["quantization_config"] = quantizer.quantization_config()
    return config


@contextmanager
def _prefixed(where: str):
    """Re-raise a UserError with every problem prefixed by the recipe file it came from."""
    try:
        yield
    except UserError as exc:
        raise UserError([f"{where}: {p}" for p in exc.problems]) from None


def check_without_model(
    loaded: LoadedRecipe, experiment: str | None = None, skip: frozenset[str] = frozenset()
) -> list[str]:
    """Every check of a recipe that loads no model, each on its own so that no problem hides another:
    the model source, its files (whole safetensors, a readable GGUF) and its layer widths against the
    scheme; the calibration text and its size in tokens (where the tokenizer is on disk already); the
    suite and the profile. `skip`: sections whose schema problems are reported already. For
    `quantbench validate`, and for `prepare` when the schema refused part of the recipe."""
    spec, where, problems = loaded.recipe, str(loaded.path), []

    def attempt(fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UserError as exc:
            problems.extend(p if p.startswith(where) else f"{where}: {p}" for p in exc.problems)
            return None

    config = attempt(models.read_config, spec.model.source, experiment=experiment)
    quantizer = make_quantizer(spec.quantize)
    if config is not None:
        attempt(models.check_files, spec.model.source)
        problems.extend(attempt(quantizer.check, loaded, config) or [])
        if quantizer.calibrates and "calibration" not in skip:
            attempt(_check_calibration, loaded, experiment)
    if spec.evaluate is not None and "evaluate" not in skip:
        attempt(load_suite, spec.evaluate.suite, "evaluate.suite")
    if spec.bench is not None and "bench" not in skip:
        attempt(load_profile, spec.bench.profile, "bench.profile")
    return problems


def _check_calibration(loaded: LoadedRecipe, experiment: str | None) -> None:
    """The calibration text exists and holds the windows asked for (a hub dataset is not fetched)."""
    from transformers import AutoTokenizer

    cal = loaded.recipe.calibration
    if cal.source.startswith("hub:"):
        return
    text = data.load_text(cal.source, field="calibration.source", text_field=cal.text_field, hub_split=cal.split)
    tokenizer = models.tokenizer_dir(loaded.recipe.model.source, experiment)
    if tokenizer is not None:
        tok = AutoTokenizer.from_pretrained(tokenizer)
        data.recipe_windows(tok, text, cal)


def check_outputs(loaded: LoadedRecipe, outputs: Path) -> None:
    """The recipe's name becomes a directory under `outputs`: it must be a plain name, and the
    directories must be directories (or can be created)."""
    if not SAFE_NAME.fullmatch(loaded.name):
        raise UserError(
            f"{loaded.path}: the file name '{loaded.name}' cannot name an output directory; rename the "
            "recipe file (letters, digits, '.', '_', '+', '-'; not starting with '.')"
        )
    check_creatable_dir(
        outputs / loaded.name, f"outputs go to {outputs / loaded.name}/ (move the file away, or pass --outputs DIR)"
    )


def _base_check_key(base, tokenizer, text_ids: list[int], tokens: int, window: int, dtype: str) -> dict:
    """What the base check's result depends on: its key in the cache."""
    return {
        "model": base.fingerprint,
        "tokenizer": verify.tokenizer_sha(base.path),
        "ids": data.text_sha(str(text_ids[:tokens])),
        "tokens": tokens,
        "window": window,
        "bos": [tokenizer.bos_token_id, data.bos_id(tokenizer) is not None],
        "calibration": data.text_sha(data.python_docs("calibration")),
        "dtype": dtype,
        "version": 3,  # 3: the other BOS framing on OTHER_FRAMING_WINDOWS windows; the dtype in the key
    }


def check_base(
    base: models.ResolvedModel,
    tokenizer,
    text_ids: list[int],
    tokens: int,
    window: int,
    field: str,
    *,
    dtype: str = "auto",
    loader=None,
    enforce: bool = True,
):
    """The base model's perplexity on held-out text (`tokens` positions of `text_ids`, framed as the
    tokenizer frames them) in `dtype`: the job's base perplexity, and (`enforce`) a refusal of a base
    that predicts worse than a unigram model of its own tokens (verify.check_base_perplexity);
    computed once per (model, tokenizer, text, dtype) and cached. `loader`: gives the base model
    loaded in `dtype` (prepare's, so the model is loaded once)."""
    wants_bos = data.bos_id(tokenizer) is not None

    def compute():
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        detail.info(
            "scoring the base model %s once: perplexity on held-out text (in %s) against a unigram model",
            base.name,
            dtype,
        )
        calibration_ids = data.text_ids(tokenizer, data.python_docs("calibration"))
        if loader is not None:
            model = loader()
        else:
            model = AutoModelForCausalLM.from_pretrained(
                base.path, dtype=dtype if dtype == "auto" else getattr(torch, dtype)
            ).eval()
        vocab_size = AutoConfig.from_pretrained(base.path).vocab_size
        return verify.check_base_perplexity(
            model, text_ids, calibration_ids, tokens, window, vocab_size, tokenizer.bos_token_id, wants_bos
        )

    result = verify.cached_check(_base_check_key(base, tokenizer, text_ids, tokens, window, dtype), compute)
    detail.info(
        "base model %s: perplexity %.4g; on its first windows %s with BOS, %.4g without; the check used the windows "
        "%s BOS (its tokenizer %s)",
        base.name,
        result.ppl,
        "n/a (no BOS token)" if result.ppl_with_bos is None else f"{result.ppl_with_bos:.4g}",
        result.ppl_without_bos,
        "with" if result.bos else "without",
        "adds one" if wants_bos else "adds none",
    )
    if hint := verify.bos_hint(result):
        log.warning("%s: %s", base.name, hint)
    if not enforce:
        return result
    if result.verdict == "near-uniform":
        log.warning(
            "the base model %s predicts nearly uniformly (%s): an untrained or random model; the perplexity "
            "bound does not apply",
            base.name,
            result.describe(),
        )
    elif result.verdict == "refused":
        raise UserError(
            f"{field}: the base model {base.source} predicts held-out text worse than a unigram model of its "
            f"own tokens ({result.describe()}): it is broken before anything is quantized. Likely causes: "
            "its tokenizer does not match its weights (a converted tokenizer that splits text differently, "
            "another model's vocabulary), a BOS token it expects and does not get, or a dtype it cannot run "
            "in. Check the source; `check.base_ppl_bound: false` skips this for a model known to be random."
        )
    return result
