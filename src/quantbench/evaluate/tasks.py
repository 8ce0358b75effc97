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

import json
import logging
import os
import random
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from quantbench.errors import UserError, did_you_mean

log = logging.getLogger(__name__)

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
    import yaml

    directory.mkdir(parents=True, exist_ok=True)
    items = {"qb_pydoc_lastword": lastword_items(text), "qb_pydoc_continuation": continuation_items(text)}
    for name, rows in items.items():
        data = directory / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        config = {
            "task": name,
            "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": str(data)}},
            "test_split": "test",
            **TASK_YAML[name],
            "metadata": {"version": float(SUITE_VERSION)},
        }
        (directory / f"{name}.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return {name: len(rows) for name, rows in items.items()}


@dataclass
class TaskResults:
    metrics: dict[str, float]  # task/<task>/<metric>
    correct: dict[str, dict[int, bool]]  # task -> doc_id -> right?
    counts: dict[str, int]  # items scored per task
    raw: dict  # lm-eval's results section


@cache
def _task_manager(suite_dir: str):
    """lm-eval's task index (it reads every task YAML it ships: seconds), built once."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=suite_dir)


def check_tasks(tasks: list[str], suite_dir: Path) -> None:
    """Unknown tasks (with close matches) and tasks whose data needs the hub while offline."""
    from quantbench.models import hub_reachable

    known = set(_task_manager(str(suite_dir)).all_tasks)
    problems = []
    online = None
    for task in tasks:
        if task not in known:
            problems.append(f"evaluate.tasks: unknown task '{task}'." + did_you_mean(task, [*OFFLINE_TASKS, *_close(task, known)]))
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
    import difflib

    return difflib.get_close_matches(word, known, n=5, cutoff=0.6)


def run_tasks(model, tokenizer, tasks: list[str], suite_dir: Path, *, limit: int | None, batch_size: int) -> TaskResults:
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

    return LocalCompletionsAPI(base_url=url.rstrip("/") + "/completions", model=model, tokenizer=tokenizer,
                               tokenizer_backend="huggingface", tokenized_requests=True, batch_size=batch_size,
                               max_length=max_length, num_concurrent=1, max_retries=1, timeout=300)


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
    metrics, correct, counts = {}, {}, {}
    for task, values in out["results"].items():
        for key, value in values.items():
            name, _, filt = key.partition(",")
            if name in ("alias", "sample_len") or name.endswith("_stderr") or not isinstance(value, (int, float)):
                continue
            metrics[f"task/{task}/{name}"] = float(value)
    for task, samples in out.get("samples", {}).items():
        correct[task] = {int(s["doc_id"]): bool(s["acc"]) for s in samples if "acc" in s}
        counts[task] = len(samples)
    return TaskResults(metrics, correct, counts, out["results"])


def flips(base: dict[str, dict[int, bool]], cand: dict[str, dict[int, bool]], prefix: str = "quality/flips") -> dict[str, float]:
    """Answers that changed between right and wrong, over the items both scored."""
    total = right_to_wrong = wrong_to_right = 0
    for task, base_items in base.items():
        for doc_id, was_right in base_items.items():
            if doc_id not in cand.get(task, {}):
                continue
            total += 1
            now_right = cand[task][doc_id]
            right_to_wrong += was_right and not now_right
            wrong_to_right += now_right and not was_right
    if total == 0:
        return {}
    return {
        f"{prefix}_pct": 100.0 * (right_to_wrong + wrong_to_right) / total,
        f"{prefix}_right_to_wrong_pct": 100.0 * right_to_wrong / total,
        f"{prefix}_wrong_to_right_pct": 100.0 * wrong_to_right / total,
        f"{prefix}_items": float(total),
    }
