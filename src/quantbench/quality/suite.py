"""Evaluation suites: what the quality pass scores and which tasks run. suites/NAME.yaml.

```yaml
# suites/default.yaml
tokens: 8192         # held-out tokens of the Python docs' evaluation split (ppl, KLD, agreement)
window: 512
ood_text: builtin:numpy-license   # out-of-domain text scored the same way (quality_ood/*); null: none
tasks: [qb_pydoc_lastword, qb_pydoc_continuation]
task_limit: null     # items per task (null: all)
intervals: {resamples: 2000, seed: 0}   # paired bootstrap (docs/intervals.md); resamples 0: none
```
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from pydantic import Field, PositiveInt, field_validator

from quantbench.core.files import canonical_sha
from quantbench.quality.tasks import OFFLINE_TASKS, SUITE_VERSION
from quantbench.recipe import load_named
from quantbench.recipe.common import Strict

DEFAULT_SUITE = "default"
# What the baseline run stores (per-item task values, the out-of-domain reference): bump when it
# changes, so a baseline stored in an older form is scored again instead of misread.
BASELINE_FORMAT = 2


class IntervalSpec(Strict):
    """The paired bootstrap behind every quality interval (docs/intervals.md)."""

    resamples: int = Field(2000, ge=0)  # 0: no quality intervals
    seed: int = 0


class Suite(Strict):
    description: str = ""
    # the held-out text of the quality pass: the builtin's evaluation split, or a .txt/.jsonl file
    text: str = "builtin:python-docs"
    tokens: PositiveInt = 8192
    window: PositiveInt = 512
    batch_size: PositiveInt = 1  # windows per forward pass of the quality pass
    # out-of-domain text, scored like `text` (same tokens and window) and logged as quality_ood/*;
    # never calibration text. null: none
    ood_text: str | None = "builtin:numpy-license"
    tasks: list[str] = Field(default_factory=lambda: list(OFFLINE_TASKS))
    task_limit: PositiveInt | None = None
    task_batch_size: PositiveInt = 8
    intervals: IntervalSpec = Field(default_factory=IntervalSpec)
    # long context: KLD and top-1 agreement per bucket of window positions, the buckets' edges
    # ([0, 512, 2048, 4096]: positions 0-511, 512-2047, 2048-4095): quality/kld_mean:pos<a>-<b>
    position_buckets: list[int] | None = None

    @field_validator("position_buckets")
    @classmethod
    def _rising_edges(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and (len(value) < 2 or value[0] < 0 or any(b <= a for a, b in zip(value, value[1:]))):
            raise ValueError("the buckets' edges: at least 2 positions, from 0 or more, each above the one before")
        return value


@dataclass(frozen=True)
class LoadedSuite:
    name: str
    suite: Suite

    def fingerprint(self, text_sha: str, ood_sha: str | None = None) -> str:
        """Same suite, same texts, same scoring code -> same fingerprint -> the baseline is reused."""
        try:
            lm_eval = metadata.version("lm_eval")
        except metadata.PackageNotFoundError:
            lm_eval = "missing"
        key = {
            # the buckets only slice the candidate's comparison: a baseline serves every bucketing
            "suite": self.suite.model_dump(mode="json", exclude={"position_buckets"}),
            "text": text_sha,
            "tasks_version": SUITE_VERSION,
            "lm_eval": lm_eval,
            "ood_text": ood_sha,
            "baseline_format": BASELINE_FORMAT,
        }
        return canonical_sha(key)


def suites_dir() -> Path:
    return Path(os.environ.get("QUANTBENCH_SUITES", "suites"))


def load_suite(name: str, field: str = "--suite") -> LoadedSuite:
    return LoadedSuite(name, load_named(suites_dir(), name, Suite, field, "suite"))
