"""A job, stage by stage. `quantbench quantize RECIPE` runs

    prepare -> produce the checkpoint -> reload check -> evaluate -> bench -> model card

and `quantbench evaluate | bench <run id | checkpoint>` run one later stage on a checkpoint that
exists. `prepare` checks every input (recipe, model source, shapes, texts, suite, profile) and
writes nothing: bad input leaves no output directory and no MLflow run. The stages know nothing of
each other; each gets what it needs and returns a typed result, which the pipeline logs into the
run (through tracking.py) and the CLI prints.

The checkpoint is written into a hidden staging directory and renamed into place only when every
stage of the job has finished: a job that fails or is interrupted at any stage (its run ends
FAILED or KILLED) leaves no checkpoint behind. When the tracking store is a server with an
artifact store, the checkpoint is also logged as the run's `checkpoint/` artifact (with its content
hash) before that rename, so a later stage on another machine finds it. Tuning and sweeps run
this same pipeline.
"""

from __future__ import annotations

import logging
import re
import shutil
import tempfile
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quantbench.core import environment, hardware, paths
from quantbench.core.errors import UserError, check_creatable_dir
from quantbench.core.logs import DETAIL, log_file, one_line
from quantbench.core.processes import raise_if_signalled
from quantbench.core.resources import StageCost, StageMeter, release_freed_memory
from quantbench.jobs import footprint
from quantbench.jobs.footprint import Footprint
from quantbench.quality import stage as evaluate_stage
from quantbench.quality.check import reload_check
from quantbench.quantize import Backend, Inputs, Produced, estimate
from quantbench.recipe import (
    LoadedRecipe,
    RecipeError,
    load_recipe,
    resolve_recipe_path,
)
from quantbench.release import card
from quantbench.release.verdict import Verdict
from quantbench.release.verdict import settle as settle_verdict
from quantbench.sources import data, models, verify
from quantbench.sources.shapes import Shape
from quantbench.sources.checkpoint import (
    Target,
    bits_per_weight,
    check_loadable,
    gguf_file,
    load_model,
    quant_method,
    resolve_target,
    weights_sha,
    weights_size_mb,
    write_info,
)
from quantbench.sources.checkpoint import upload as upload_checkpoint
from quantbench.speed import bench as bench_stage
from quantbench.tracking import STAGING, TAG, Tracker, inherited_tags

log = logging.getLogger(__name__)
detail = logging.getLogger(DETAIL)  # the run's log file only: the terminal ends with the verdict

SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")


@dataclass
class Job:
    """Everything a quantize job needs, all checked before the first byte is written."""

    loaded: LoadedRecipe
    base: models.ResolvedModel
    tokenizer: object
    backend: Backend
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
        """The dtype the produce step computes in: the backend's own where it says (GPTQModel's AWQ
        computes in the saved dtype), else the job's compute dtype."""
        return self.backend.computes_in(self.loaded.recipe.model) or self.compute_dtype

    def take_model(self):
        """The base model loaded in prepare, handed over once (None when prepare loaded none)."""
        model, self.model = self.model, None
        return model


@dataclass
class JobResult:
    run_id: str
    checkpoint: Path
    log: Path
    metrics: dict[str, float]
    sample: str
    evaluation: evaluate_stage.Evaluation | None = None
    bench: bench_stage.BenchResult | None = None
    verdict: Verdict | None = None

    def summary(self) -> dict:
        """The JSON summary `quantbench quantize --json` prints."""
        return {
            "run_id": self.run_id,
            "checkpoint": str(self.checkpoint),
            "log": str(self.log),
            "metrics": self.metrics,
        }


def quantize(
    recipe: str,
    *,
    overrides: tuple[str, ...] = (),
    outputs: Path = Path("outputs"),
    experiment: str | None = None,
    strict_budget: bool = False,
) -> JobResult:
    with StageMeter("prepare") as meter:
        job = prepare(recipe, overrides, experiment=experiment, outputs=outputs, strict_budget=strict_budget)
    job.prepare_cost = meter.cost
    result = execute(job, outputs=outputs, experiment=experiment)
    result.verdict = settle(result.run_id, experiment)
    return result


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


def settle(run_id: str, experiment: str | None, **kwargs) -> Verdict | None:
    """The run's verdict (release/verdict.py; `kwargs`: its policy, gated), written into the run once
    it has ended: its description in MLflow and its report artifact. A command that did its work is
    not failed for it: None, with a warning."""
    try:
        return settle_verdict(run_id, experiment=experiment, **kwargs)
    except Exception as exc:
        log.warning("the verdict was not written into run %s: %s", run_id, one_line(exc))
        return None


def _log_metrics(metrics: dict[str, float]) -> None:
    """Every metric, into the run's log file (the terminal shows the verdict; --json has them too)."""
    detail.info("metrics:\n%s", "\n".join(f"  {k:48s} {v:.6g}" for k, v in sorted(metrics.items())))


# ---------------------------------------------------------------------------------------------
# prepare: every input check, nothing written


def prepare(
    recipe: str,
    overrides: tuple[str, ...] = (),
    *,
    experiment: str | None = None,
    outputs: Path = Path("outputs"),
    strict_budget: bool = False,
    stop_at_plan: bool = False,
) -> Job:
    from transformers import AutoConfig, AutoTokenizer

    from quantbench.quality.suite import load_suite
    from quantbench.quantize import make_backend

    try:
        loaded = load_recipe(resolve_recipe_path(recipe), overrides)
    except RecipeError as exc:  # with what the schema accepted, the checks that do not depend on the rest
        found = exc.problems + (check_without_model(exc.partial, experiment, exc.invalid) if exc.partial else [])
        raise UserError(found) from None
    spec = loaded.recipe
    where = str(loaded.path)
    check_outputs(loaded, outputs)
    problems = check_without_model(loaded, experiment)  # every one at once, before the checks that load
    if problems:
        raise UserError(problems)
    with _prefixed(where):
        base = models.resolve(spec.model.source, experiment=experiment)
    if note := base.quantized_note():
        log.warning("%s", note)
    if base.same_type(candidate_type(spec.quantize)):
        log.warning("%s", same_type_note(base))
    backend = make_backend(spec.quantize)
    problems = backend.check(loaded, AutoConfig.from_pretrained(base.path))
    if problems:
        raise UserError(problems)
    tokenizer = AutoTokenizer.from_pretrained(base.path)
    text_shas: dict[str, str] = {}
    bos = data.bos_id(tokenizer)  # every window starts with it, where the tokenizer adds one
    calibration = None
    if backend.calibrates:
        cal = spec.calibration
        with _prefixed(where):
            text = data.load_text(
                cal.source, field="calibration.source", text_field=cal.text_field, hub_split=cal.split
            )
            calibration = data.recipe_windows(tokenizer, text, cal)
        text_shas["calibration"] = data.text_sha(text)
    eval_text = data.python_docs("evaluation")
    text_shas["evaluation"] = data.text_sha(eval_text)
    eval_ids = data.text_ids(tokenizer, eval_text)
    check_ids = data.framed(eval_ids, spec.check.window, bos)[: spec.check.ppl_tokens]
    evaluation = bench = None
    with _prefixed(where):
        if spec.evaluate is not None:
            evaluation = evaluate_stage.prepare(load_suite(spec.evaluate.suite, "evaluate.suite"), tokenizer)
        if spec.bench is not None:
            bench = bench_stage.prepare(
                spec.bench.profile,
                tokenizer,
                backend=spec.bench.backend,
                checkpoint=_expected_config(base.path / "config.json", backend),
                base_path=base.path,
                field="bench.profile",
                backend_field="bench.backend",
            )
    compute_dtype = spec.model.computes_in()
    base_checked = verify.check_cached(
        _base_check_key(base, tokenizer, eval_ids, spec.check.ppl_tokens, spec.check.window, compute_dtype)
    )
    footprint = _plan(loaded, base, backend, compute_dtype, evaluation, bench, outputs, experiment, base_checked)
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
    # after the plan: a quantizer's own preparation can be heavy (llama.cpp's conversion of the base)
    text_shas = backend.prepare(loaded, base, tokenizer) | text_shas  # its texts first, as recorded before
    loader = _BaseLoader(base.path, compute_dtype)
    with _prefixed(where):
        check = check_base(
            base, tokenizer, eval_ids, spec.check.ppl_tokens, spec.check.window, "model.source",
            dtype=compute_dtype, loader=loader, enforce=spec.check.base_ppl_bound,
        )  # fmt: skip
    produce_estimate = _estimate(loaded, base, backend, calibration, eval_ids, compute_dtype, strict_budget, loader)
    if evaluation is not None and check.seconds_per_token:
        _say_evaluation_cost(evaluation, check.seconds_per_token, footprint, spec.evaluate.suite, compute_dtype)
    model = loader.model if backend.takes_model else None
    loader.release()
    return Job(
        loaded,
        base,
        tokenizer,
        backend,
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
    from quantbench.core.upcast import slowdown

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
    loaded, base, backend, compute: str, evaluation, bench, outputs: Path, experiment, base_checked: bool = False
) -> Footprint:
    """The job's memory and disk, stage by stage, from the base's config and the recipe."""
    from transformers import AutoConfig

    spec = loaded.recipe
    shape = Shape.from_config(AutoConfig.from_pretrained(base.path))
    produce = footprint.produce_footprint(backend, shape, loaded, compute)
    estimating = (backend.calibrates or backend.trains) and estimate.passes(spec.quantize, 1, 1) is not None
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
    base: models.ResolvedModel,
    backend: Backend,
    calibration: list[list[int]] | None,
    eval_ids: list[int],
    dtype: str,
    strict: bool,
    loader: _BaseLoader,
) -> estimate.Estimate | None:
    """Time a few forward passes, say how long the produce step will take, and hold it to the
    recipe's budget_minutes (refused with `strict`: exit 2, before any run exists). None where the
    method's time does not grow with data."""
    from transformers import AutoConfig

    spec, q = loaded.recipe, loaded.recipe.quantize
    if not (backend.calibrates or backend.trains) or estimate.passes(q, 1, 1) is None:
        return None
    if calibration is not None:
        windows = calibration
    else:  # a trained model: windows of its training length, from held-out text (only timed, never learnt)
        length = getattr(q, "seq_len", spec.calibration.seq_len)
        windows = [eval_ids[i : i + length] for i in range(0, min(len(eval_ids), 3 * length), length)]
    layers = AutoConfig.from_pretrained(base.path).num_hidden_layers
    found = estimate.estimate(q, loader(), windows, layers, dtype)
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


def _expected_config(config_path: Path, backend: Backend) -> dict:
    """The config.json the recipe's checkpoint will have, as far as serving it goes (its
    quantization_config sketched from the recipe), so that the bench engine is chosen before the job."""
    import json

    config = json.loads(config_path.read_text())
    config["quantization_config"] = backend.quantization_config()
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
    from quantbench.quality.suite import load_suite
    from quantbench.quantize import make_backend
    from quantbench.speed.measure import load_profile

    spec, where, problems = loaded.recipe, str(loaded.path), []

    def attempt(fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UserError as exc:
            problems.extend(p if p.startswith(where) else f"{where}: {p}" for p in exc.problems)
            return None

    config = attempt(models.read_config, spec.model.source, experiment=experiment)
    backend = make_backend(spec.quantize)
    if config is not None:
        attempt(models.check_files, spec.model.source)
        problems.extend(attempt(backend.check, loaded, config) or [])
        if backend.calibrates and "calibration" not in skip:
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


# ---------------------------------------------------------------------------------------------
# execute: one MLflow run, the stages in order, the checkpoint renamed into place at the end


def execute(job: Job, *, outputs: Path, experiment: str | None) -> JobResult:
    """The job's run: the base scored (its baseline, when the suite has none yet), produce, reload
    check, evaluate, bench, each measured (`stage/<name>/...`) beside the plan (`plan/<name>/...`);
    one copy of the model at a time. The checkpoint is renamed into place only at the end."""
    spec, loaded = job.loaded.recipe, job.loaded
    tracker = Tracker(experiment)
    with tracker.start_run(f"{loaded.name} · {models.short_name(spec.model.source)}", _candidate_tags(job)) as run:
        where = _Where(outputs / loaded.name, run.run_id, f".{spec.quantize.method}-{loaded.sha[:16]}")
        costs = _Costs(run, [job.prepare_cost] if job.prepare_cost else [])
        try:
            with log_file(where.log):
                result = _stages(job, run, tracker, where, costs)
                _log_metrics(result.metrics | costs.metrics())
        except BaseException:
            shutil.rmtree(where.staging, ignore_errors=True)
            raise
        finally:
            run.log_metrics(costs.metrics())
            if where.log.exists():
                run.log_artifact(where.log)
    result.metrics |= costs.metrics()
    return result


@dataclass
class _Where:
    """Where a job writes: the recipe's directory under outputs/, its run's checkpoint, staging
    directory and log, and the method's work directory (state an interrupted job resumes from)."""

    directory: Path
    run_id: str
    work: str

    @property
    def final(self) -> Path:
        return self.directory / self.run_id

    @property
    def staging(self) -> Path:
        return self.directory / f".{self.run_id}.partial"

    @property
    def log(self) -> Path:
        return self.directory / f"{self.run_id}.log"

    @property
    def workdir(self) -> Path:
        return self.directory / self.work


class _Costs:
    """Each stage's measured cost, logged into the run at the end (also when the job failed: what it
    cost up to there)."""

    def __init__(self, run, costs: list[StageCost]):
        self.run, self.costs = run, costs

    @contextmanager
    def stage(self, name: str, directories: tuple[Path, ...] = ()):
        release_freed_memory()  # what the stage before let go is gone before this one is measured
        raise_if_signalled()  # a signal whose KeyboardInterrupt a finalizer run by the collection swallowed
        meter = StageMeter(name, directories)
        try:
            with meter:
                yield
        finally:
            if meter.cost is not None:
                self.costs.append(meter.cost)
                log.info(
                    "%s: %.1f s, peak memory %.2f GiB%s",
                    name,
                    meter.cost.wall_s,
                    meter.cost.peak_rss_mb / 1024,
                    f", {meter.cost.disk_mb / 1024:.2f} GiB written" if meter.cost.disk_mb >= 1 else "",
                )

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for cost in self.costs:
            out |= cost.metrics()
        return out


def _stages(job: Job, run, tracker: Tracker, where: _Where, costs: _Costs) -> JobResult:
    spec, loaded, backend = job.loaded.recipe, job.loaded, job.backend
    q = spec.quantize
    names = ["produce", "reload check"] + ["evaluate"] * bool(job.evaluation) + ["bench"] * bool(job.bench)
    step = _Steps(names)
    run.set_tags({STAGING: where.staging.resolve()})
    run.log_dict(_resolved_record(job), "resolved_recipe.json")  # the first artifact
    run.log_params(loaded.resolved)
    if job.footprint is not None:
        run.log_metrics(job.footprint.metrics())
        for line in job.footprint.lines():  # planned in prepare, before this log file existed
            detail.info("%s", line)
    detail.info("run %s: recipe %s (%s %s), base %s", run.run_id, loaded.name, q.method, q.scheme, job.base.path)
    # on the terminal when the device makes the job compute in another dtype than it saves (bf16 emulated here)
    (log if job.produce_dtype != spec.model.dtype else detail).info(
        "computing in %s, saving in %s (%s)", job.produce_dtype, spec.model.dtype, hardware.device_line()
    )

    baseline = None
    if job.evaluation is not None:
        # scored before anything is quantized, so the base and a candidate are never loaded together
        if not evaluate_stage.baseline_exists(tracker, job.base, job.evaluation):
            job.model = None  # prepare's copy in the compute dtype: the baseline loads the base as stored
        with costs.stage("baseline"):
            baseline = evaluate_stage.get_baseline(tracker, job.base, job.evaluation)

    step("produce")
    with costs.stage("produce", (where.staging, where.workdir)):
        produced, base_size_mb = _produce(job, run, where)

    step("reload check")
    with costs.stage("check"):
        # hashed before the reload: read after it, the files were mapped a second time beside the
        # loaded model's own mapping of them (the 3B fp8 check's peak counted 5.7 GiB of file pages
        # for a 2.9 GiB checkpoint)
        sha = weights_sha(where.staging)  # same recipe, same seed, same engine versions -> same hash
        detail.info("reloading the saved checkpoint from disk and checking it")
        check = reload_check(
            where.staging,
            spec.check,
            job.check_ids,
            job.base_ppl,
            produced.reference_ppl,
            dtype=hardware.compute_dtype_of(where.staging, job.compute_dtype),
        )
    detail.info("weights sha256 %s (%s)", sha, produced.pinned)
    run.set_tags({TAG + "weights_sha": sha or "none", TAG + "deterministic": produced.pinned})
    write_info(where.staging, {**_checkpoint_info(job, run.run_id), "weights_sha": sha})
    size_mb = weights_size_mb(where.staging)
    if job.produce_estimate is not None:
        produced.metrics["quantize/estimate_s"] = job.produce_estimate.seconds
    metrics = {
        **(job.footprint.metrics() if job.footprint is not None else {}),
        **produced.metrics,
        "model/size_mb": size_mb,
        "model/base_size_mb": base_size_mb,
        "model/compression_ratio": base_size_mb / size_mb,
        **check.metrics,
    }
    bits = bits_per_weight(where.staging)
    if bits is not None:
        metrics["model/bits_per_weight"] = bits
    run.log_metrics(metrics)
    info = card.CardInfo(
        loaded, job.base, backend.format, backend.loaders(), produced.card, len(job.check_ids), run.run_id
    )
    card.write(where.staging, where.final, info, metrics, check.sample)

    evaluation = bench = None
    if job.evaluation is not None:
        step("evaluate")
        with costs.stage("evaluate"):
            evaluation = evaluate_stage.evaluate(
                check.model, check.tokenizer, job.base, job.evaluation, tracker, baseline=baseline
            )
            run.record(evaluation.metrics, evaluation.tags, {"evaluation.json": evaluation.report})
            metrics.update(evaluation.metrics)
            # llama.cpp's own pass maps the base's F16 file: the de-quantized candidate goes first
            # (at 8B both together held 23.3 GiB of a 23.4 GiB machine)
            check.model = None
            release_freed_memory()
            engine_quality = _engine_quality(where.staging, job.base, job.evaluation, job.tokenizer, where.log)
            run.log_metrics(engine_quality)
            metrics.update(engine_quality)
    sample = check.sample
    del check  # the bench loads one model at a time
    if job.bench is not None:
        step("bench")
        with costs.stage("bench"):
            bench = _bench(run, where.staging, job.base, job.bench)
        metrics.update(bench.metrics)
    if evaluation is not None or bench is not None:
        card.write(where.staging, where.final, info, metrics, sample)  # now with quality and speed

    if run.shares_artifacts:  # a tracking server's artifact store: other machines fetch it from there
        upload_checkpoint(run, where.staging)
    raise_if_signalled()  # not in place for a run that a lost KeyboardInterrupt would end FINISHED
    where.staging.rename(where.final)
    run.set_tags({TAG + "checkpoint": where.final.resolve()})
    shutil.rmtree(where.workdir, ignore_errors=True)  # done: nothing to resume
    run.log_artifact(where.final / "README.md")
    detail.info("checkpoint: %s", where.final)  # the command says it last
    return JobResult(run.run_id, where.final, where.log, metrics, sample, evaluation, bench)


def _produce(job: Job, run, where: _Where) -> tuple[Produced, float]:
    """The backend writes the checkpoint into the staging directory, from the base model loaded in
    the compute dtype when it computes on it (prepare's copy, else loaded now), else from files.
    Returns what it reported and the base's size in its saved dtype (MiB)."""
    import torch
    from transformers import AutoModelForCausalLM

    from quantbench.quantize.stage import produce

    spec = job.loaded.recipe
    where.staging.mkdir(parents=True)
    model = job.take_model() if job.backend.takes_model else None
    job.model = None
    if job.backend.takes_model and model is None:
        model = AutoModelForCausalLM.from_pretrained(job.base.path, dtype=getattr(torch, job.compute_dtype))
    base_size_mb = base_bytes(job.base.path, spec.model.dtype) / 2**20
    inputs = Inputs(
        job.loaded,
        job.base,
        job.tokenizer,
        job.calibration,
        where.staging,
        where.log,
        where.workdir,
        (job.check_ids, spec.check.window),
        run,
        model=model,
    )
    del model  # the engine takes it (or lets it go)
    return produce(job.backend, inputs), base_size_mb


def base_bytes(path: Path, dtype: str) -> int:
    """The base model's size in the recipe's dtype (not the one this CPU computes in), from its
    config without loading it: its unique tensors (tied embeddings once), floating ones at that
    dtype's width."""
    import torch
    from transformers import AutoConfig

    from quantbench.sources.checkpoint import skeleton

    model = skeleton(AutoConfig.from_pretrained(path))
    width = getattr(torch, dtype).itemsize
    unique = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * (width if t.is_floating_point() else t.element_size()) for t in unique.values())


def _engine_quality(checkpoint: Path, base: models.ResolvedModel, plan, tokenizer, log_path: Path | None) -> dict:
    """`quality_engine/*` for a GGUF checkpoint: the suite's text scored through llama.cpp itself
    (llama-perplexity against the base's F16 file), beside the suite's own figures (transformers,
    the file de-quantized). {} for other formats."""
    from quantbench.engines import llamacpp

    gguf = gguf_file(checkpoint)
    if gguf is None:
        return {}
    work = Path(tempfile.mkdtemp(prefix="qb-engine-quality-"))
    try:
        log_path = log_path or work / "llama.log"
        text = tokenizer.decode(plan.token_ids, skip_special_tokens=True)
        base_file = llamacpp.base_gguf(base.path, log_path=log_path)
        return llamacpp.engine_quality(base_file, gguf, text, plan.suite.suite.window, work, log_path)
    finally:
        shutil.rmtree(work, ignore_errors=True)


class _Steps:
    """`[2/4] reload check` progress lines."""

    def __init__(self, names: list[str]):
        self.names = names

    def __call__(self, name: str) -> None:
        log.info("[%d/%d] %s", self.names.index(name) + 1, len(self.names), name)


def _candidate_tags(job: Job) -> dict[str, str]:
    spec, q = job.loaded.recipe, job.loaded.recipe.quantize
    tags = {
        TAG + "role": "candidate",
        TAG + "recipe": job.loaded.name,
        TAG + "recipe_sha": job.loaded.sha,
        TAG + "method": q.method,
        TAG + "scheme": q.scheme,
        TAG + "engine": job.backend.engine,
        TAG + "base_model": spec.model.source,
        TAG + "base_fingerprint": job.base.fingerprint,
        TAG + "format": job.backend.format,
        TAG + "loaders": job.backend.loaders(),
        TAG + "kv_cache": getattr(q, "kv_cache", None) or "none",
        TAG + "compute_dtype": job.produce_dtype,
        TAG + "device": hardware.device_class(),  # the class its times hold for (bench/results_table.py)
        TAG + "license": job.base.license,
        TAG + "bos": data.bos_tag(job.tokenizer, data.bos_id(job.tokenizer)),  # what every window starts with
        **{TAG + k: v for k, v in environment.describe().items()},
        **({TAG + "parent_run": job.base.parent_run} if job.base.parent_run else {}),
        **base_tags(job.base, candidate_type(q)),
        **inherited_tags(),
    }
    what = "distillation (student in bf16) of" if q.method == "distill" else f"{q.method} {q.scheme} of"
    tags["mlflow.note.content"] = (  # the run's description in the MLflow UI
        f"{what} `{spec.model.source}` by recipe `{job.loaded.path}` (sha {job.loaded.sha[:12]}); "
        f"format {job.backend.format}. {spec.description}".strip()
    )
    return tags


def _resolved_record(job: Job) -> dict:
    """resolved_recipe.json: the recipe as run, with versions, hardware and git sha."""
    return {
        "recipe": job.loaded.resolved,
        "recipe_file": str(job.loaded.path),
        "overrides": list(job.loaded.overrides),
        "recipe_sha": job.loaded.sha,
        "base_model": {
            "source": job.base.source,
            "path": str(job.base.path),
            "license": job.base.license,
            "fingerprint": job.base.fingerprint,
        },
        "text_sha256": job.text_shas,
        "compute_dtype": job.produce_dtype,
        "environment": environment.describe(),
    }


def _checkpoint_info(job: Job, run_id: str) -> dict:
    """quantbench.json: how this checkpoint was made, for `quantbench evaluate <dir>` and later stages."""
    q = job.loaded.recipe.quantize
    return {
        "run_id": run_id,
        "recipe": job.loaded.name,
        "recipe_sha": job.loaded.sha,
        "method": q.method,
        "scheme": q.scheme,
        "format": job.backend.format,
        "loaders": job.backend.loaders(),
        "kv_cache": getattr(q, "kv_cache", None),
        "base_model": {
            "source": job.base.source,
            "name": job.base.name,
            "fingerprint": job.base.fingerprint,
            "license": job.base.license,
        },
        "parent_run": job.base.parent_run,
    }


def _bench(run, checkpoint: Path, base: models.ResolvedModel, plan: bench_stage.Plan) -> bench_stage.BenchResult:
    """The bench stage, its result (or what a failed bench measured) logged into `run`."""
    try:
        result = bench_stage.bench(checkpoint, base, plan)
    except bench_stage.BenchFailed as exc:
        _log_bench(run, exc.partial)
        raise
    _log_bench(run, result)
    return result


def _log_bench(run, result: bench_stage.BenchResult) -> None:
    run.record(result.metrics, result.tags, {"bench.json": result.report})
    for path in result.logs:
        run.log_artifact(path, "servers")
    for path in result.plots:
        run.log_artifact(path)
    for path in result.logs[:1] + result.plots[:1]:
        shutil.rmtree(path.parent, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Later stages on a checkpoint that exists: `quantbench evaluate`, `quantbench bench`


@dataclass
class StageOutcome:
    run_id: str
    checkpoint: Path
    metrics: dict[str, float]
    evaluation: evaluate_stage.Evaluation | None = None
    bench: bench_stage.BenchResult | None = None
    extra: dict = field(default_factory=dict)
    engine_tasks: evaluate_stage.EngineTasks | None = None
    verdict: Verdict | None = None

    def summary(self) -> dict:
        out = {"run_id": self.run_id, "checkpoint": str(self.checkpoint), **self.extra, "metrics": self.metrics}
        if self.evaluation is not None:
            out.update(baseline_run=self.evaluation.baseline_run, baseline_reused=self.evaluation.baseline_reused)
        return out


def target_run(tracker: Tracker, tgt: Target, base: models.ResolvedModel, stage: str):
    """The checkpoint's own MLflow run, reopened; or a new candidate run for a foreign checkpoint."""
    if tgt.run_id:
        return tracker.resume_run(tgt.run_id)
    method = quant_method(tgt.checkpoint)  # what its config says it is (compare's format column)
    return tracker.start_run(
        f"{stage} {tgt.checkpoint.name} · {models.short_name(tgt.base_source)}",
        {
            TAG + "role": "candidate",
            TAG + "checkpoint": tgt.checkpoint.resolve(),
            TAG + "base_model": tgt.base_source,
            TAG + "base_fingerprint": base.fingerprint,
            **({TAG + "format": method} if method else {}),
            **base_tags(base),
        },
    )


def _together(*checks: Callable[[], Any]) -> list[Any]:
    """Each check's result; when any is bad input, every one's problems at once (a bad profile said
    beside a bad target, not only after the target is fixed)."""
    results, problems = [], []
    for check in checks:
        try:
            results.append(check())
        except UserError as exc:
            problems += exc.problems
    if problems:
        raise UserError(problems)
    return results


def _open_target(target: str, base: str | None, experiment: str | None) -> tuple[Tracker, Target, models.ResolvedModel]:
    tracker = Tracker(experiment)
    tgt = resolve_target(target, tracker, base)
    check_loadable(tgt.checkpoint)
    base_model = models.resolve(tgt.base_source, field="--base", experiment=experiment)
    if note := base_model.quantized_note():
        log.warning("%s", note)
    return tracker, tgt, base_model


def evaluate(
    target: str,
    *,
    suite: str | None = None,
    base: str | None = None,
    experiment: str | None = None,
    engine: str | None = None,
) -> StageOutcome:
    """Quality against the base model through transformers; with `engine` ("vllm") also the suite's
    tasks scored on the checkpoint served by that engine, in the same run."""
    from transformers import AutoTokenizer

    from quantbench.quality.suite import DEFAULT_SUITE, load_suite

    loaded_suite, (tracker, tgt, base_model) = _together(
        lambda: load_suite(suite or DEFAULT_SUITE), lambda: _open_target(target, base, experiment)
    )
    tokenizer = AutoTokenizer.from_pretrained(tgt.checkpoint)
    plan = evaluate_stage.prepare(loaded_suite, tokenizer)
    engine_plan = evaluate_stage.prepare_engine(engine, tgt.checkpoint, plan) if engine else None
    engine_result = None
    with target_run(tracker, tgt, base_model, "evaluate") as run, _run_log(run, tgt.checkpoint):
        baseline = evaluate_stage.get_baseline(tracker, base_model, plan)  # before the candidate is loaded
        model = load_model(tgt.checkpoint, dtype=hardware.compute_dtype_of(tgt.checkpoint))
        evaluation = evaluate_stage.evaluate(model, tokenizer, base_model, plan, tracker, baseline=baseline)
        run.record(evaluation.metrics, evaluation.tags, {"evaluation.json": evaluation.report})
        metrics = dict(evaluation.metrics)
        engine_quality = _engine_quality(tgt.checkpoint, base_model, plan, tokenizer, None)
        run.log_metrics(engine_quality)
        metrics |= engine_quality
        if engine_plan is not None:
            del model
            correct = {t: {int(k): v for k, v in items.items()} for t, items in evaluation.report["samples"].items()}
            logs: list[Path] = []
            try:
                engine_result = evaluate_stage.engine_tasks(engine_plan, plan, correct, logs)
                run.record(engine_result.metrics, engine_result.tags, {"evaluation_engine.json": engine_result.report})
                metrics |= engine_result.metrics
            finally:
                for path in logs:
                    if path.exists():
                        run.log_artifact(path, "servers")
                    shutil.rmtree(path.parent, ignore_errors=True)
        _log_metrics(metrics)
    outcome = StageOutcome(run.run_id, tgt.checkpoint, metrics, evaluation=evaluation, engine_tasks=engine_result)
    outcome.verdict = settle(run.run_id, experiment)
    return outcome


def bench(
    target: str,
    *,
    profile: str | None = None,
    backend: str = "auto",
    server: str = "auto",
    base: str | None = None,
    experiment: str | None = None,
    endpoints: tuple[str, str] | None = None,
) -> StageOutcome:
    from transformers import AutoTokenizer

    from quantbench.speed.measure import DEFAULT_PROFILE, load_profile

    _, (tracker, tgt, base_model) = _together(
        lambda: load_profile(profile or DEFAULT_PROFILE), lambda: _open_target(target, base, experiment)
    )
    plan = bench_stage.prepare(
        profile or DEFAULT_PROFILE,
        AutoTokenizer.from_pretrained(tgt.checkpoint),
        backend=backend,
        server=server,
        endpoints=endpoints,
        checkpoint=tgt.checkpoint,
        base_path=base_model.path,
    )
    _plan_bench(plan, tgt.checkpoint, base_model)
    with target_run(tracker, tgt, base_model, "bench") as run, _run_log(run, tgt.checkpoint):
        result = _bench(run, tgt.checkpoint, base_model, plan)
        _log_metrics(result.metrics)
    engine = {
        "engine": result.report["engine"],
        "engine_description": result.report["engine_description"],
        "why": result.report["why"],
    }
    outcome = StageOutcome(run.run_id, tgt.checkpoint, result.metrics, bench=result, extra=engine)
    outcome.verdict = settle(run.run_id, experiment)
    return outcome


@contextmanager
def _run_log(run, checkpoint: Path):
    """The run's log file for a later stage (evaluate, bench), appended: the quantize job's own
    beside the checkpoint it wrote, else one kept in the cache (begun from the run's `<run id>.log`
    artifact when it has one, so that re-logging it loses nothing); logged as that artifact."""
    name = f"{run.run_id}.log"
    path = checkpoint.parent / name
    if not path.is_file():
        path = paths.cache_dir() / "logs" / name
        if not path.exists() and run.has_artifact(name):
            run.download(name, path.parent)
    try:
        with log_file(path):
            yield path
    finally:
        if path.exists():
            run.log_artifact(path)


def _plan_bench(plan: bench_stage.Plan, checkpoint: Path, base: models.ResolvedModel) -> None:
    """The bench's memory, planned from the base's shapes and the checkpoint's size: servers that do
    not fit together are measured one after the other; refused (exit 2) when one alone does not fit."""
    from transformers import AutoConfig

    shape = Shape.from_config(AutoConfig.from_pretrained(base.path))
    stage = footprint.bench_stage(
        shape, plan, int(weights_size_mb(checkpoint) * 2**20), "bfloat16", footprint.available_ram()
    )
    log.info("bench memory plan: %.2f GiB (%s)", stage.ram / 2**30, "; ".join(stage.held))
    if stage.ram > footprint.available_ram():
        raise UserError(
            f"the bench needs about {stage.ram / 2**30:.1f} GiB ({'; '.join(stage.held)}) and this machine has "
            f"{footprint.available_ram() / 2**30:.1f} GiB available. {'; '.join(stage.fits_with)}"
        )


def speculative(
    draft: str, target: str | None = None, *, profile: str | None = None, experiment: str | None = None
) -> StageOutcome:
    """`bench --draft`: the target model (default the draft's base) with and without the draft."""
    from quantbench.speed import speculative as spec_stage
    from quantbench.speed.measure import DEFAULT_PROFILE

    tracker = Tracker(experiment)
    drafted = resolve_target(draft, tracker, target)
    check_loadable(drafted.checkpoint)
    source = target or drafted.base_source
    if re.fullmatch(r"[0-9a-f]{32}", source):
        source = "run:" + source
    tgt = models.resolve(source, field="target" if target else "the draft's base model", experiment=experiment)
    check_loadable(tgt.path)
    plan = spec_stage.prepare(drafted.checkpoint, tgt, profile or DEFAULT_PROFILE, f"--draft {draft}")
    with target_run(tracker, drafted, tgt, "bench") as run:
        result = spec_stage.run(plan)
        run.record(result.metrics, result.tags, {"bench_spec.json": result.report})
    return StageOutcome(
        run.run_id, drafted.checkpoint, result.metrics, extra={"target": tgt.source, "draft": str(drafted.checkpoint)}
    )
