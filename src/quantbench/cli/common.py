"""What every command module shares: options defined once, a stage run so that a failure is an
exit code (its MLflow run already ended), and the --json summary line."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from pathlib import Path
from typing import Any

from quantbench.core.errors import UserError
from quantbench.core.logs import debugging, log_path_of, one_line, quiet
from quantbench.core.processes import forget_signals, interrupt, interrupted

log = logging.getLogger("quantbench")


def common(*names: str) -> argparse.ArgumentParser:
    """Options several commands share, defined once."""
    parent = argparse.ArgumentParser(add_help=False)
    if "experiment" in names:
        parent.add_argument("--experiment", help="MLflow experiment (default: $MLFLOW_EXPERIMENT_NAME or 'quantbench')")
    if "outputs" in names:
        parent.add_argument("--outputs", type=Path, default=Path("outputs"), help="output root (default: outputs)")
    if "base" in names:
        parent.add_argument(
            "--base", default=None, help="the base model source, for a checkpoint quantbench did not write"
        )
    if "json" in names:
        parent.add_argument("--json", action="store_true", help="print a JSON summary as the last line of output")
    return parent


def renamed(parser: argparse.ArgumentParser, old: str, new: argparse.Action) -> None:
    """`old`, the old name of the option `new` (what add_argument returned): still accepted (same
    values, same destination), listed in --help as deprecated, and a warning on stderr when used."""
    name = new.option_strings[0]

    class Renamed(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            print(f"warning: {old} is deprecated; it is now called {name}", file=sys.stderr)
            setattr(namespace, new.dest, values)

    parser.add_argument(
        old,
        action=Renamed,
        choices=new.choices,
        metavar=name.lstrip("-").upper(),
        help=f"deprecated: the old name of {name}",
    )


def run_stage(name: str, fn, *args, **kwargs) -> Any | None:
    """Run a stage that owns an MLflow run; None (exit 1) if it failed after starting."""
    # `kill` (a timeout, a scheduler) ends a stage like Ctrl-C: its MLflow run is marked KILLED
    # and any staging directory removed, never left RUNNING (not even when the signal comes while
    # the run is being created or ended: tracking holds it back for that moment).
    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, interrupt)
    forget_signals()  # what counts is what comes from here on
    try:
        # libraries' own output (bars, warnings, prints) to the run's log file, ours to the terminal
        with quiet():
            return fn(*args, **kwargs)
    except UserError:
        raise
    except Exception as exc:  # the run is already marked FAILED (or KILLED) with the traceback
        if interrupted(exc):  # an interrupt a library wrapped in an exception of its own: exit 130
            raise KeyboardInterrupt(str(exc)) from exc
        # One line on the terminal; the traceback is in the run's log file (and its MLflow run's
        # error.txt), or here too with --debug / QUANTBENCH_DEBUG=1.
        where = log_path_of(exc)
        if debugging():
            log.exception("%s failed: %s", name, one_line(exc))
        else:
            hint = f"traceback in {where}" if where else "--debug prints the traceback"
            log.error("%s failed: %s (%s)", name, one_line(exc), hint)
        return None


def verdict_text(found, gated: bool = False) -> str:
    """The verdict's screen (release/verdict.py), or a line saying why there is none."""
    return found.text(gated) if found is not None else "verdict: not written (the warning above says why)"


def verdict_json(found) -> dict:
    return {"verdict": found.as_json()} if found is not None else {}


def print_json(args, summary: dict) -> int:
    """With --json: the summary as one JSON line, the last of the output."""
    if getattr(args, "json", False):
        print(json.dumps(summary, default=str))
    return 0
