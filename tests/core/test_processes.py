"""The lock a sweep or a tune holds on its directory (quantbench.core.processes.hold_lock): one
holder at a time, named to the next; released by a finished or interrupted command with its file
removed, and never held by two processes when one removes it while another waits for it."""

import fcntl
import os

import pytest

from quantbench.core.errors import UserError
from quantbench.core.processes import hold_lock


def test_a_held_lock_refuses_another_holder_and_leaves_no_file_when_released(tmp_path):
    lock = hold_lock(tmp_path / "job", "this job")
    assert (tmp_path / "job" / "lock").read_text() == str(os.getpid())
    with pytest.raises(UserError, match=rf"this job is already running \(pid {os.getpid()}, lock "):
        hold_lock(tmp_path / "job", "this job")
    lock.close()
    assert list((tmp_path / "job").iterdir()) == []
    lock.close()  # twice: nothing more to do
    with pytest.raises(KeyboardInterrupt), hold_lock(tmp_path / "job", "this job"):
        raise KeyboardInterrupt  # an interrupted command releases it too
    assert list((tmp_path / "job").iterdir()) == []


def test_a_waiter_that_opened_the_removed_file_locks_the_path_again(tmp_path, monkeypatch):
    """The holder removes the file while it still holds the lock. A process that opened the file
    just before then gets the lock on a file no longer at the path: it must lock the path again,
    or it and the next process would both hold "the" lock."""
    first = hold_lock(tmp_path, "this job")
    real_flock = fcntl.flock
    calls = []

    def flock(handle, op):
        calls.append(op)
        if len(calls) == 1:
            first.close()  # released (and removed) between the waiter's open and its flock
        return real_flock(handle, op)

    monkeypatch.setattr(fcntl, "flock", flock)
    second = hold_lock(tmp_path, "this job")
    monkeypatch.setattr(fcntl, "flock", real_flock)
    assert len(calls) == 2  # its first lock was on the removed file: it locked the path again
    assert (tmp_path / "lock").read_text() == str(os.getpid())
    with pytest.raises(UserError, match="this job is already running"):
        hold_lock(tmp_path, "this job")
    second.close()
    assert not (tmp_path / "lock").exists()
