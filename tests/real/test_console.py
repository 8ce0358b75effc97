"""Real tier: what a person reads after the flagship (`quantbench quantize awq-int4` on the default
model, a small suite, trimmed calibration), captured from a real process as the terminal gets it:
a short console (stage lines, our progress bars, the verdict), no library chatter, and the verdict's
rows with the release policy's word on each and the command that measures speed."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.real
REPO = Path(__file__).resolve().parents[2]
SMALL = (  # 10 windows: the fewest that get intervals (docs/intervals.md); both offline tasks, 16 items each
    "tokens: 2560\nwindow: 256\nood_text: null\ntasks: [qb_pydoc_lastword, qb_pydoc_continuation]\n"
    "task_limit: 16\ntask_batch_size: 8\nintervals: {resamples: 500, seed: 0}\n"
)
LINE_BUDGET = 40  # issue: the flagship prints at most 40 lines after the environment exists


def test_the_flagship_console_is_one_screen_ending_with_the_verdict(workdir):
    shutil.copy(REPO / "recipes" / "awq-int4.yaml", workdir / "recipes")
    shutil.copytree(REPO / "policies", workdir / "policies")
    (workdir / "suites").mkdir()
    (workdir / "suites" / "small.yaml").write_text(SMALL)
    trimmed = ["calibration.samples=4", "calibration.seq_len=128", "quantize.n_grid=3", "evaluate.suite=small"]
    args = [sys.executable, "-m", "quantbench", "quantize", "awq-int4"]
    for item in trimmed:
        args += ["--set", item]
    env = {**os.environ, "COLUMNS": "120", "PYTHONPATH": str(REPO / "src")}
    done = subprocess.run(args, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    console = done.stdout.decode(errors="replace")  # bytes: text mode would turn a bar's \r into a new line
    assert done.returncode == 0, console[-4000:]

    lines = console.split("\n")  # a progress bar redraws itself with \r on one line
    assert len(lines) <= LINE_BUDGET, f"{len(lines)} lines:\n{console}"
    # libraries' own records and bars went to the run's log file, not here
    for chatter in ("INFO", "No accelerator available", "Building contexts", "kwarg is not of type", "it/s]"):
        assert chatter not in console, chatter

    tail = console[console.index("verdict: awq-int4 (awq W4A16 of builtin:smollm2-135m-instruct)"):]
    rows = {line.split("  ")[0]: line for line in tail.splitlines()}
    for figure in ("KLD vs base, mean", "top-1 agreement", "answer flips %", "perplexity ratio (cand/base)",
                   "qb_pydoc_lastword acc recovery", "size", "speed vs base"):  # fmt: skip
        assert figure in rows, (figure, tail)
    kld = rows["KLD vs base, mean"]
    low, high = (float(x) for x in re.search(r"\[([\d.]+), ([\d.]+)\]", kld).groups())
    value = float(kld.removeprefix("KLD vs base, mean").split()[0])
    assert 0 < low <= value <= high, kld  # a figure with its interval around it
    assert "ci_high <= 0.1" in kld  # the release policy's limit on it
    assert re.search(r"\d+\.\d MiB, 4\.\d\d bits/w, 2\.\d\d× smaller", rows["size"]), rows["size"]
    assert "not measured" in rows["speed vs base"]
    run_id = re.search(r"mlflow run: ([0-9a-f]{32})", tail).group(1)
    assert f"`make bench RUN={run_id}`" in tail  # what was not measured, with the command that measures it
    assert re.search(r"^release: (PASS|FAIL|UNDECIDED)", tail, re.M), tail
    assert "nothing registered, no alias moved" in " ".join(tail.split())  # wrapped to the terminal

    # the full metric list is in the run's log file, with the libraries' lines
    log = Path(re.search(r"log: (\S+\.log)", tail).group(1))
    text = (workdir / log if not log.is_absolute() else log).read_text()
    assert "quality/kld_mean" in text and "task/qb_pydoc_lastword/acc" in text
