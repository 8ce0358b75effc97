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
