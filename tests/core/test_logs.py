"""The console log follows sys.stderr as it is when a record is written."""

import io
import logging
import sys

from quantbench.core.logs import configure_console


def test_the_console_log_writes_to_the_current_stderr_not_a_closed_one(monkeypatch):
    configure_console()
    first = io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    logging.getLogger("quantbench").info("into the first")
    first.close()  # what a test's capture does when it ends
    second = io.StringIO()
    monkeypatch.setattr(sys, "stderr", second)
    logging.getLogger("quantbench").error("bench failed: the reason")
    assert second.getvalue().endswith("bench failed: the reason\n")


QUIET_COMMAND = r'''
import json, logging, subprocess, sys, time, warnings
from pathlib import Path
from tqdm import tqdm
from quantbench.core import logs

logs.configure_console()
logs.translate(r"(\d+) mappings were skipped", "said once: {0} mappings skipped")
logs.relay(r"\((\d+)/(\d+)\): Calibrating", "produce (layers)", "layer")
with logs.quiet():
    with logs.log_file(Path(sys.argv[1])):
        logging.getLogger("quantbench").info("our own line")
        print("a library's print")
        print("a library's line on stderr", file=sys.stderr)
        for _ in range(2):
            logging.getLogger("llmcompressor").warning("30 mappings were skipped due to incompatible shapes")
        logging.getLogger("lm_eval").info("Building contexts for qb_pydoc_lastword on rank 0...")
        warnings.warn("a deprecation nobody here can act on")
        subprocess.run(["sh", "-c", "echo a child process; echo its warning >&2"])
        for layer in (1, 2, 3):
            for _ in tqdm(range(4), desc=f"({layer}/3): Calibrating"):
                time.sleep(0.1)
        logging.getLogger("somelib").error("a library's error")
print(json.dumps({"last": "line"}))
'''


def test_quiet_sends_libraries_to_the_log_and_keeps_ours_on_the_terminal(tmp_path):
    """Through real file descriptors, as a command runs in a terminal: what libraries write (prints,
    warnings, records below ERROR, bars, a child process) lands in the run's log file; the terminal
    shows our lines, one bar of ours for the library's per-layer bars, a matching warning in our words
    once, and errors; stdout's last line is still the JSON one."""
    import os
    import subprocess
    from pathlib import Path

    src = Path(__file__).resolve().parents[2] / "src"
    log = tmp_path / "run.log"
    # bytes, not text=True: universal newlines would turn a bar's \r into a line of its own
    done = subprocess.run([sys.executable, "-c", QUIET_COMMAND, str(log)], capture_output=True,
                          env={**os.environ, "PYTHONPATH": str(src)}, timeout=120)
    terminal, written = done.stderr.decode(), log.read_text()
    assert done.returncode == 0, terminal
    assert done.stdout == b'{"last": "line"}\n'

    assert "our own line" in terminal and "a library's error" in terminal
    assert terminal.count("said once: 30 mappings skipped") == 1
    assert "produce (layers)" in terminal and "Calibrating" not in terminal
    for line in ("a library's print", "a library's line on stderr", "30 mappings were skipped", "Building contexts",
                 "a deprecation nobody here can act on", "a child process", "its warning", "(3/3): Calibrating: 100%"):
        assert line not in terminal, line
        assert line in written, line
    assert terminal.count("\n") == 3  # our line, the warning in our words, the error: nothing else ends a line
