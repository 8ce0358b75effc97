"""Task evals through lm-evaluation-harness, and the offline suite quantbench ships.

The offline suite is built deterministically from the evaluation split of the Python
documentation (`builtin:python-docs`, never the calibration split), written as JSONL data plus
lm-eval task YAML into the cache, and run through lm-eval's own scoring:

- `qb_pydoc_lastword` (LAMBADA-style): a passage with its last word removed; the model must
  predict that word. loglikelihood task: `acc` (the word is the greedy continuation) and
  `perplexity` of the word.
- `qb_pydoc_continuation`: the first 24 words of a paragraph and four 16-word continuations, one
  true and three taken from other paragraphs at the same offset. multiple_choice task: `acc`,
  `acc_norm`.

Any other lm-eval task name works when its data is reachable (the hub, online).
"""

from __future__ import annotations

import difflib
import json
import logging
import math
import os
import random
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import yaml

from quantbench.core import intervals
from quantbench.core.errors import UserError, did_you_mean
from quantbench.core.files import write_if_changed
from quantbench.core.intervals import mcnemar_p
from quantbench.core.logs import relay
from quantbench.core.paths import hub_reachable
from quantbench.metrics import RECOVERABLE, direction

log = logging.getLogger(__name__)
# lm-eval's bar over a task's requests is the longest wait of an evaluation: shown as one bar of ours
relay(r"Running \w+ requests:.*?\| *(\d+)/(\d+) \[", "tasks (lm-eval)", "request")

OFFLINE_TASKS = ("qb_pydoc_lastword", "qb_pydoc_continuation")
SUITE_VERSION = "1"  # bump when the generated items change


def _paragraphs(text: str) -> list[str]:
    """Prose paragraphs: whitespace collapsed, no grammar rules, code or tables."""
    out = []
    for raw in text.split("\n\n"):
        p = re.sub(r"\s+", " ", raw).strip()
        if len(p.split()) < 30 or "::=" in p or ">>>" in p:
            continue
        if sum(c.isalpha() or c == " " for c in p) / len(p) > 0.85:
            out.append(p)
    return out


def lastword_items(text: str) -> list[dict]:
    items = []
    for para in _paragraphs(text):
        sentences = re.split(r"(?<=[.!?])\s+", para)
        for i, sentence in enumerate(sentences):
            words = sentence.split()
            if len(words) < 12:
                continue
            last = words[-1].rstrip(".!?")
            if not (last.isalpha() and len(last) >= 3 and words[-1][-1] in ".!?"):
                continue
            before = " ".join(sentences[:i]).split()[-60:]  # up to 60 words of preceding context
            context = " ".join(before + words[:-1])
            items.append({"context": context, "target": " " + last})
    return items


def continuation_items(text: str, seed: int = 0) -> list[dict]:
    paras = [p.split() for p in _paragraphs(text) if len(p.split()) >= 40]
    rng = random.Random(seed)
    items = []
    for i, words in enumerate(paras):
        others = rng.sample([j for j in range(len(paras)) if j != i], 3)
        true = " ".join(words[24:40])
        choices = [true] + [" ".join(paras[j][24:40]) for j in others]
        rng.shuffle(choices)
        items.append({"context": " ".join(words[:24]), "choices": choices, "gold": choices.index(true)})
    return items


TASK_YAML = {
    "qb_pydoc_lastword": {
        "output_type": "loglikelihood",
        "doc_to_text": "{{context}}",
        "doc_to_target": "{{target}}",
        "target_delimiter": "",
        "metric_list": [
            {"metric": "perplexity", "aggregation": "perplexity", "higher_is_better": False},
            {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
        ],
    },
    "qb_pydoc_continuation": {
        "output_type": "multiple_choice",
        "doc_to_text": "{{context}}",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{gold}}",
        "target_delimiter": " ",
        "metric_list": [
            {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
            {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True},
        ],
    },
}


def write_offline_suite(text: str, directory: Path) -> dict[str, int]:
    """Write JSONL data and task YAML for the offline tasks into `directory`; item counts."""
    directory.mkdir(parents=True, exist_ok=True)
    items = {"qb_pydoc_lastword": lastword_items(text), "qb_pydoc_continuation": continuation_items(text)}
    for name, rows in items.items():
        data = directory / f"{name}.jsonl"
        write_if_changed(data, "".join(json.dumps(r) + "\n" for r in rows))
        config = {
            "task": name,
            "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": str(data)}},
            "test_split": "test",
            **TASK_YAML[name],
            "metadata": {"version": float(SUITE_VERSION)},
        }
        write_if_changed(directory / f"{name}.yaml", yaml.safe_dump(config, sort_keys=False))
    return {name: len(rows) for name, rows in items.items()}


# task -> doc_id -> metric -> that item's value as lm-eval aggregates it (a number, or
# [log-likelihood, words or bytes] for the weighted perplexities)
Items = dict[str, dict[int, dict[str, float | list[float]]]]


@dataclass
class TaskResults:
    metrics: dict[str, float]  # task/<task>/<metric>
    items: Items  # every item's per-metric values (what the paired intervals resample)
    counts: dict[str, int]  # items scored per task
    raw: dict  # lm-eval's results section

    @property
    def correct(self) -> dict[str, dict[int, bool]]:
        """task -> doc_id -> right? (the items' `acc`)."""
        return correct(self.items)


def correct(items: Items) -> dict[str, dict[int, bool]]:
    return {
        task: {doc: bool(values["acc"]) for doc, values in docs.items() if "acc" in values}
        for task, docs in items.items()
    }


@cache
def _task_manager(suite_dir: str):
    """lm-eval's task index (it reads every task YAML it ships: seconds), built once."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=suite_dir)


def check_tasks(tasks: list[str], suite_dir: Path) -> None:
    """Unknown tasks (with close matches) and tasks whose data needs the hub while offline."""
    if not tasks:  # a suite of quality passes alone (suites/offline.yaml) needs no lm-eval
        return
    known = set(_task_manager(str(suite_dir)).all_tasks)
    problems = []
    online = None
    for task in tasks:
        if task not in known:
            problems.append(
                f"evaluate.tasks: unknown task '{task}'." + did_you_mean(task, [*OFFLINE_TASKS, *_close(task, known)])
            )
            continue
        if task in OFFLINE_TASKS:
            continue
        online = hub_reachable() if online is None else online
        if not online:
            problems.append(
                f"evaluate.tasks: '{task}' needs its data from the Hugging Face hub, which is not reachable "
                f"from here (offline). The offline suite needs no network: {', '.join(OFFLINE_TASKS)}"
            )
    if problems:
        raise UserError(problems)


def _close(word: str, known: set[str]) -> list[str]:
    return difflib.get_close_matches(word, known, n=5, cutoff=0.6)


def run_tasks(
    model, tokenizer, tasks: list[str], suite_dir: Path, *, limit: int | None, batch_size: int
) -> TaskResults:
    """Score `tasks` on the already-loaded model through lm-eval's HFLM."""
    if not tasks:
        return TaskResults({}, {}, {}, {})
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device=str(next(model.parameters()).device))
    return score(lm, tasks, suite_dir, limit=limit)


def served_lm(url: str, model: str, tokenizer: str, *, max_length: int, batch_size: int):
    """lm-eval's `local-completions` model against a running OpenAI-compatible server (vLLM):
    log-probabilities of the very token ids lm-eval sends (echo), batched."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    return LocalCompletionsAPI(
        base_url=url.rstrip("/") + "/completions",
        model=model,
        tokenizer=tokenizer,
        tokenizer_backend="huggingface",
        tokenized_requests=True,
        batch_size=batch_size,
        max_length=max_length,
        num_concurrent=1,
        max_retries=1,
        timeout=300,
    )


def score(lm, tasks: list[str], suite_dir: Path, *, limit: int | None) -> TaskResults:
    """Score `tasks` with any lm-eval model: metrics task/<task>/<metric> and per-item correctness."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the offline suite reads local JSONL
    from lm_eval import simple_evaluate

    out = simple_evaluate(
        model=lm,
        tasks=list(tasks),
        task_manager=_task_manager(str(suite_dir)),
        limit=limit,
        log_samples=True,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
        bootstrap_iters=0,
    )
    metrics, items, counts = {}, {}, {}
    for task, values in out["results"].items():
        for key, value in values.items():
            name, _, filt = key.partition(",")
            if name in ("alias", "sample_len") or name.endswith("_stderr") or not isinstance(value, (int, float)):
                continue
            metrics[f"task/{task}/{name}"] = float(value)
    for task, samples in out.get("samples", {}).items():
        items[task] = {int(s["doc_id"]): _item_values(s) for s in samples}
        counts[task] = len(samples)
    return TaskResults(metrics, items, counts, out["results"])


def _item_values(sample: dict) -> dict[str, float | list[float]]:
    """An lm-eval sample's per-metric values, as plain JSON numbers."""
    out: dict[str, float | list[float]] = {}
    for name in sample.get("metrics", []):
        value = sample.get(name)
        if isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, (int, float)) for v in value):
            out[name] = [float(value[0]), float(value[1])]
        elif isinstance(value, (int, float)):
            out[name] = float(value)
    return out


def _paired_flips(base: dict[str, dict[int, bool]], cand: dict[str, dict[int, bool]]) -> list[tuple[bool, bool]]:
    """(base right?, candidate right?) for every item both scored, in a fixed order."""
    return [
        (was_right, cand[task][doc_id])
        for task, base_items in sorted(base.items())
        for doc_id, was_right in sorted(base_items.items())
        if doc_id in cand.get(task, {})
    ]


def flips(
    base: dict[str, dict[int, bool]], cand: dict[str, dict[int, bool]], prefix: str = "quality/flips"
) -> dict[str, float]:
    """Answers that changed between right and wrong, over the items both scored, and (for the
    candidate against the base) McNemar's exact test of whether they changed more often one way
    than the other."""
    pairs = _paired_flips(base, cand)
    total = len(pairs)
    right_to_wrong = sum(was and not now for was, now in pairs)
    wrong_to_right = sum(now and not was for was, now in pairs)
    if total == 0:
        return {}
    out = {
        f"{prefix}_pct": 100.0 * (right_to_wrong + wrong_to_right) / total,
        f"{prefix}_right_to_wrong_pct": 100.0 * right_to_wrong / total,
        f"{prefix}_wrong_to_right_pct": 100.0 * wrong_to_right / total,
        f"{prefix}_items": float(total),
    }
    if prefix == "quality/flips":
        out["quality/flips_p_value"] = mcnemar_p(right_to_wrong, wrong_to_right)
    return out


# ---------------------------------------------------------------------------------------------
# Paired intervals over items (intervals.py): each task metric, its recovery, and the flips


def _aggregate(metric: str):
    """How lm-eval turns a metric's per-item values into the task's score, as a function of
    bootstrap counts [resamples, items] and the values; None for an aggregation not known here."""

    def sums(counts, values):
        return counts @ values

    if metric == "perplexity":
        return lambda c, v: (-sums(c, v) / c.sum(1)).exp()
    if metric in ("word_perplexity", "byte_perplexity"):
        return lambda c, v: (-sums(c, v[:, 0]) / sums(c, v[:, 1])).exp()
    if metric == "bits_per_byte":
        return lambda c, v: -sums(c, v[:, 0]) / sums(c, v[:, 1]) / math.log(2)

    def mean(counts, values):  # acc, acc_norm, exact_match, ...: one number an item
        return sums(counts, values) / counts.sum(1) if values.dim() == 1 else None

    return mean


def item_intervals(base: Items, cand: Items, metrics: dict[str, float], boot) -> tuple[dict[str, float], list[str]]:
    """Intervals of `task/<t>/<m>`, `recovery/task/<t>/<m>` and the flips, from a paired bootstrap
    over the items both models scored; and a note for every metric left without one."""
    import torch

    out: dict[str, float] = {}
    notes: list[str] = []
    if boot.resamples == 0:
        return out, notes
    for task in sorted(cand):
        docs = sorted(set(cand[task]) & set(base.get(task, {})))
        if not intervals.enough(len(docs)):
            notes.append(f"task/{task}/*: {len(docs)} items, too few for an interval (at least {intervals.MIN_UNITS})")
            continue
        counts = boot.counts(len(docs))
        ones = torch.ones(1, len(docs), dtype=torch.float64)
        for metric in sorted(cand[task][docs[0]]):
            name = f"task/{task}/{metric}"
            try:
                values = {
                    who: torch.tensor([items[task][d][metric] for d in docs], dtype=torch.float64)
                    for who, items in (("cand", cand), ("base", base))
                }
            except (KeyError, TypeError, ValueError):
                notes.append(f"{name}: not every item has a value for both models; no interval")
                continue
            aggregate = _aggregate(metric)
            point = aggregate(ones, values["cand"]) if aggregate else None
            if (
                point is None
                or name not in metrics
                or not math.isclose(point.item(), metrics[name], rel_tol=1e-6, abs_tol=1e-9)
            ):
                notes.append(f"{name}: its per-item values do not reproduce lm-eval's score; no interval")
                continue
            draws = aggregate(counts, values["cand"])
            out.update(intervals.bounds(name, draws, len(docs)))
            if RECOVERABLE.fullmatch(name) and f"recovery/{name}" in metrics:  # none where the base scored 0
                base_draws = aggregate(counts, values["base"])
                ratio = base_draws / draws if direction(name) == "lower" else draws / base_draws
                if bool(torch.isfinite(ratio).all()):
                    out.update(intervals.bounds(f"recovery/{name}", ratio, len(docs)))
                else:
                    notes.append(f"recovery/{name}: a resample has a zero score; no interval")
    pairs = _paired_flips(correct(base), correct(cand))
    if not intervals.enough(len(pairs)):
        if pairs:
            notes.append(
                f"quality/flips_*: {len(pairs)} items, too few for an interval (at least {intervals.MIN_UNITS})"
            )
        return out, notes
    was = torch.tensor([p[0] for p in pairs], dtype=torch.float64)
    now = torch.tensor([p[1] for p in pairs], dtype=torch.float64)
    counts = boot.counts(len(pairs))
    for name, flipped in (
        ("flips_pct", (was != now).double()),
        ("flips_right_to_wrong_pct", was * (1 - now)),
        ("flips_wrong_to_right_pct", now * (1 - was)),
    ):
        out.update(intervals.bounds(f"quality/{name}", 100.0 * (counts @ flipped) / len(pairs), len(pairs)))
    return out, notes
