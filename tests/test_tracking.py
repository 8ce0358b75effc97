import pytest

from quantbench.core.settings import flatten
from quantbench.tracking import Tracker
from tests.helpers import runs


def test_success_finishes_the_run_with_params_metrics_and_tags(workdir):
    with Tracker().start_run("r", {"quantbench.role": "candidate"}) as run:
        run.log_params({"quantize": {"method": "gptq", "ignore": ["lm_head"]}})
        run.log_metrics({"model/size_mb": 12.5})
    [found] = runs()
    assert found.info.status == "FINISHED"
    assert found.data.params == {"quantize.method": "gptq", "quantize.ignore": '["lm_head"]'}
    assert found.data.metrics == {"model/size_mb": 12.5}
    assert found.data.tags["quantbench.role"] == "candidate"


def test_exception_marks_failed_with_the_error(workdir):
    with pytest.raises(RuntimeError):
        with Tracker().start_run("r", {}):
            raise RuntimeError("disk full")
    [found] = runs()
    assert found.info.status == "FAILED"
    assert found.data.tags["quantbench.error"] == "RuntimeError: disk full"


def test_ctrl_c_marks_killed(workdir):
    with pytest.raises(KeyboardInterrupt):
        with Tracker().start_run("r", {}):
            raise KeyboardInterrupt
    assert runs()[0].info.status == "KILLED"


def test_an_interrupt_a_library_wrapped_still_marks_killed(workdir):
    # e.g. an interrupt inside a library's `finally`/`except` that raised its own error on the way out
    with pytest.raises(RuntimeError):
        with Tracker().start_run("wrapped", {}):
            try:
                raise KeyboardInterrupt("signal 15")
            finally:
                raise RuntimeError("worker pool shut down while busy")
    with pytest.raises(ValueError):
        with Tracker().start_run("caught", {}):
            try:
                raise KeyError("x")
            except KeyError as exc:
                raise ValueError("bad") from exc
    status = {r.info.run_name: r.info.status for r in runs()}
    assert status == {"wrapped": "KILLED", "caught": "FAILED"}  # only an interrupt in the chain is a KILL


@pytest.fixture
def sigterm_interrupts():
    """SIGTERM handled as the commands that own runs handle it (processes.interrupt)."""
    import signal

    from quantbench.core.processes import forget_signals, interrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    yield
    signal.signal(signal.SIGTERM, previous)
    forget_signals()


def sigterm_self() -> None:
    """SIGTERM to this process, its Python handler run before this returns."""
    import os
    import signal
    import time

    os.kill(os.getpid(), signal.SIGTERM)
    for _ in range(100):  # the handler runs at the main thread's next check
        time.sleep(0.001)


def test_an_interrupt_is_held_back_for_a_block_then_handed_over(sigterm_interrupts):
    import signal

    from quantbench.core.processes import interrupts_held

    with interrupts_held() as held:
        sigterm_self()
        assert held == [signal.SIGTERM]  # noted, not raised inside the block
    with pytest.raises(KeyboardInterrupt):
        sigterm_self()  # outside a block: an interrupt at once


def test_an_interrupt_while_the_run_is_created_leaves_it_killed_not_running(workdir, sigterm_interrupts):
    tracker = Tracker()
    create = tracker.client.create_run

    def create_then_signalled(*args, **kwargs):  # SIGTERM lands after the run exists, before start_run returns
        run = create(*args, **kwargs)
        sigterm_self()
        return run

    tracker.client.create_run = create_then_signalled
    with pytest.raises(KeyboardInterrupt):
        tracker.start_run("r", {})
    [found] = runs()
    assert found.info.status == "KILLED"
    assert found.data.tags["quantbench.error"] == "interrupted while the run was being created"


def test_an_interrupt_while_the_run_is_ended_still_ends_it(workdir, sigterm_interrupts):
    tracker = Tracker()
    with pytest.raises(KeyboardInterrupt):
        with tracker.start_run("r", {}) as run:
            terminate = run.client.set_terminated

            def signalled_then_terminate(*args, **kwargs):  # a second Ctrl-C while the status is written
                sigterm_self()
                return terminate(*args, **kwargs)

            run.client.set_terminated = signalled_then_terminate
    assert runs()[0].info.status == "FINISHED"  # the work was done; the command stops after it


def test_an_interrupt_inside_a_store_write_lands_after_it_and_the_run_still_ends_killed(workdir, sigterm_interrupts):
    """SIGTERM raised inside SQLAlchemy while a tag is written once left the SQLite write
    transaction open in a pooled connection: ending the run KILLED then waited on the job's own
    lock (20 s per write) and the run stayed RUNNING. Each store call now runs whole."""
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    sent = []

    def signalled(conn, cursor, statement, parameters, context, executemany):
        if not sent and statement.lstrip().upper().startswith("INSERT INTO TAGS"):
            sent.append(statement)
            sigterm_self()  # the handler runs here, inside the store's write

    with pytest.raises(KeyboardInterrupt):
        with Tracker().start_run("r", {}) as run:
            event.listen(Engine, "after_cursor_execute", signalled)
            try:
                run.set_tags({"written": "yes"})
            finally:
                event.remove(Engine, "after_cursor_execute", signalled)
            pytest.fail("the interrupt did not end the block")
    assert sent
    [found] = runs()
    assert found.info.status == "KILLED" and found.data.tags["written"] == "yes"  # the write was whole


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_signal_whose_interrupt_a_finalizer_swallowed_still_kills_the_run(workdir, sigterm_interrupts):
    """Python runs the handler wherever the main thread is: in a finalizer that gc.collect() runs, the
    KeyboardInterrupt is printed as "Exception ignored" and dropped, and the work goes on. The run
    still ends KILLED, with the signal named, and the command stops."""
    import gc

    from quantbench.core.processes import raise_if_signalled

    class Finalized:
        def __del__(self):
            sigterm_self()  # the handler runs inside this finalizer

    def lose_an_interrupt() -> None:
        cycle = Finalized()
        cycle.me = cycle  # only the collector frees it
        del cycle
        gc.collect()

    went_on = False
    with pytest.raises(KeyboardInterrupt):
        with Tracker().start_run("r", {}):
            lose_an_interrupt()
            went_on = True  # the interrupt was lost (pytest keeps the "Exception ignored" as a warning)
    assert went_on
    [found] = runs()
    assert found.info.status == "KILLED" and found.data.tags["quantbench.error"] == "KeyboardInterrupt: signal 15"
    with pytest.raises(KeyboardInterrupt):
        raise_if_signalled()  # what a job checks between stages


def test_default_store_is_sqlite_in_the_working_dir(workdir, monkeypatch):
    from quantbench.tracking import tracking_uri

    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert tracking_uri() == f"sqlite:///{workdir / 'mlflow.db'}"


def test_a_sqlite_store_keeps_its_artifacts_beside_it_wherever_a_command_runs(workdir, monkeypatch, tmp_path):
    """MLflow's default artifact root is ./mlruns of the process that creates the experiment: a store
    named by MLFLOW_TRACKING_URI from elsewhere (bench/scale.py's) had its artifacts in the caller's
    working directory. Its experiments put them in mlruns/ beside the database now."""
    from mlflow.tracking import MlflowClient

    store = tmp_path / "store"
    store.mkdir()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{store / 'mlflow.db'}")
    with Tracker("elsewhere").start_run("r", {"quantbench.role": "candidate"}) as run:
        run.log_dict({"a": 1}, "a.json")
    [found] = MlflowClient().search_runs([Tracker("elsewhere").experiment_id()])
    assert found.info.artifact_uri.startswith((store / "mlruns").as_uri())
    assert (store / "mlruns").is_dir() and not (workdir / "mlruns").exists()
    monkeypatch.delenv("MLFLOW_TRACKING_URI")  # the default store: mlflow.db and mlruns/ here
    assert Tracker("here").artifact_location() is None
    Tracker("here").experiment_id()
    assert Tracker("here").artifact_location() == (workdir / "mlruns").as_uri()


def test_flatten():
    assert flatten({"a": {"b": 1, "c": {"d": [1]}}, "e": None}) == {"a.b": 1, "a.c.d": [1], "e": None}


def test_search_values_with_quotes_are_quoted_not_injected(workdir):
    from quantbench.core.errors import UserError
    from quantbench.tracking import quote

    with Tracker().start_run("r", {"quantbench.recipe": "x' or 1=1", "quantbench.role": "candidate"}):
        pass
    with Tracker().start_run("s", {"quantbench.recipe": "plain", "quantbench.role": "candidate"}):
        pass
    tracker = Tracker()
    assert len(tracker.find_runs({"quantbench.recipe": "x' or 1=1"})) == 1
    assert tracker.find_runs({"quantbench.recipe": "x' or '1'='1"}) == []
    assert quote("a'b") == '"a\'b"' and quote('a"b') == "'a\"b'"
    with pytest.raises(UserError, match="both quote characters"):
        quote("a'b\"c")


def test_two_commands_on_a_fresh_store_at_once(tmp_path):
    """MLflow creates its SQLite schema on first use; four processes doing that at once must all
    succeed (without the lock, one fails with "table experiments already exists")."""
    import subprocess
    import sys

    code = ("from quantbench.tracking import Tracker\n"
            "with Tracker().start_run('r', {'quantbench.role': 'candidate'}) as run:\n"
            "    run.log_metrics({'x': 1})\n")
    env = {**__import__("os").environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'fresh.db'}",
           "MLFLOW_EXPERIMENT_NAME": "race"}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, cwd=tmp_path, stderr=subprocess.PIPE, text=True)
             for _ in range(4)]
    errors = [p.communicate()[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0, 0], errors
    from mlflow.tracking import MlflowClient

    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    assert len(client.search_runs([client.get_experiment_by_name("race").experiment_id])) == 4


def test_a_run_whose_process_was_killed_is_reaped_by_the_next_command(workdir, capsys):
    """SIGKILL leaves no chance to end a run: the next command that opens the store marks it
    FAILED with the reason and removes its staging directory; `quantbench gc` does it on demand."""
    import json
    import os
    import subprocess
    import sys

    from quantbench.cli import main

    code = ("import os, signal\nfrom pathlib import Path\nfrom quantbench.tracking import STAGING, Tracker\n"
            "run = Tracker(reap=False).start_run('doomed', {'quantbench.role': 'candidate'})\n"
            "staging = Path('outputs/r') / f'.{run.run_id}.partial'\nstaging.mkdir(parents=True)\n"
            "(staging / 'model.safetensors').write_bytes(b'half')\nrun.set_tags({STAGING: staging.resolve()})\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n")
    for _ in range(2):
        assert subprocess.run([sys.executable, "-c", code], cwd=workdir, env=dict(os.environ)).returncode == -9
    assert sorted(r.info.status for r in runs()) == ["RUNNING", "RUNNING"]
    assert len(list((workdir / "outputs" / "r").iterdir())) == 2
    assert main(["gc", "--json"]) == 0
    reaped = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["reaped"]
    assert len(reaped) == 2 and all(r["removed"] for r in reaped)
    assert [r.info.status for r in runs()] == ["FAILED", "FAILED"]
    assert all("died without ending it" in r.data.tags["quantbench.error"] for r in runs())
    assert list((workdir / "outputs" / "r").iterdir()) == []
    # a third killed run is reaped by any later command that opens the store, not only gc
    assert subprocess.run([sys.executable, "-c", code], cwd=workdir, env=dict(os.environ)).returncode == -9
    Tracker()
    assert sorted(r.info.status for r in runs()) == ["FAILED", "FAILED", "FAILED"]
    assert main(["gc"]) == 0 and "nothing to collect" in capsys.readouterr().out


def test_a_live_run_of_this_or_another_host_is_left_alone(workdir):
    with Tracker().start_run("alive", {}) as run:
        Tracker().reap()
        assert runs()[0].info.status == "RUNNING"
        run.set_tags({"quantbench.owner": "some-other-host 1 1.00"})
        Tracker().reap()
        assert runs()[0].info.status == "RUNNING"


def test_a_killed_run_is_reaped_by_a_command_on_another_experiment(workdir, capsys):
    """The whole store is reaped, not only the experiment the command names."""
    import os
    import subprocess
    import sys

    from quantbench.cli import main

    code = ("import os, signal\nfrom pathlib import Path\nfrom quantbench.tracking import STAGING, Tracker\n"
            "run = Tracker(reap=False).start_run('doomed', {'quantbench.role': 'candidate'})\n"
            "staging = Path('outputs/r') / f'.{run.run_id}.partial'\nstaging.mkdir(parents=True)\n"
            "run.set_tags({STAGING: staging.resolve()})\nos.kill(os.getpid(), signal.SIGKILL)\n")
    assert subprocess.run([sys.executable, "-c", code], cwd=workdir, env=dict(os.environ)).returncode == -9
    assert [r.info.status for r in runs()] == ["RUNNING"]
    assert main(["compare", "--experiment", f"other-{os.environ['MLFLOW_EXPERIMENT_NAME']}"]) == 2
    [reaped] = runs()
    assert reaped.info.status == "FAILED" and "died without ending it" in reaped.data.tags["quantbench.error"]
    assert list((workdir / "outputs" / "r").iterdir()) == []


@pytest.fixture
def store(workdir, monkeypatch):
    """A store of its own at MLFLOW_TRACKING_URI with one finished candidate run; its path and the run id."""
    db = workdir / "store" / "mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{db}")
    with Tracker().start_run("made", {"quantbench.role": "candidate"}) as run:
        run.log_metrics({"model/size_mb": 1.0, "quality/kld_mean": 0.01})
    return db, run.run_id


def _copy(db, name: str):
    """The store copied to NAME/mlflow.db, which MLflow opens anew (it keeps the engines it made for the original)."""
    import shutil

    copy = db.parent.parent / name / "mlflow.db"
    copy.parent.mkdir()
    shutil.copy(db, copy)
    return copy


@pytest.fixture
def read_only(store, monkeypatch):
    """The store as SQLite sees a file it may not write: every write fails with SQLITE_READONLY,
    "attempt to write a readonly database", as on a file made immutable (`chattr +i`) or read-only
    (`chmod a-w`, not root). chmod does not stop root and chattr needs a capability containers often
    lack, so SQLite is told itself: PRAGMA query_only on every connection to this file."""
    import os

    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    db, run_id = store
    copy = _copy(db, "read-only")

    def connect(dbapi_connection, _record):
        files = [os.path.realpath(row[2]) for row in dbapi_connection.execute("PRAGMA database_list") if row[2]]
        if os.path.realpath(copy) in files:
            dbapi_connection.execute("PRAGMA query_only = ON")

    event.listen(Engine, "connect", connect)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{copy}")
    yield copy, run_id
    event.remove(Engine, "connect", connect)


def test_a_store_that_cannot_be_written_is_bad_input_saying_what_to_do(read_only, workdir, tiny_model_dir, capsys):
    """compare and quantize on a store SQLite may only read: exit 2 and one line naming the store,
    what is wrong and what to do, not MLflow's and SQLAlchemy's tracebacks; no checkpoint left."""
    from quantbench.cli import main
    from tests.helpers import tiny_recipe, write_recipe

    db, _ = read_only
    said = (f"error: the tracking store {db} cannot be written (attempt to write a readonly database): make it "
            f"writable (`chmod u+w {db}` and its directory; `chattr -i {db}` if it was made immutable), or point "
            "MLFLOW_TRACKING_URI at another store\n")
    assert main(["compare"]) == 2
    err = capsys.readouterr().err
    assert err.endswith(said) and "Traceback" not in err and "[SQL:" not in err, err
    write_recipe(workdir, "fp8", tiny_recipe(tiny_model_dir, "method: fp8\n"))
    assert main(["quantize", "fp8"]) == 2
    err = capsys.readouterr().err
    assert err.endswith(said) and "Traceback" not in err and "[SQL:" not in err, err
    assert not list(workdir.glob("outputs/**/config.json"))


def test_a_damaged_store_is_bad_input_and_gc_never_calls_it_clean(store, workdir, monkeypatch, capsys):
    """Garbage over the SQLite header: compare, gate and gc exit 2 with one line that says the store
    is damaged and what to do; gc does not answer "nothing to collect" about a store it could not read."""
    import yaml

    from quantbench.cli import main

    db, run_id = store
    damaged = _copy(db, "damaged")
    with open(damaged, "r+b") as fh:
        fh.write(b"not a database " * 8)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{damaged}")
    (workdir / "policies").mkdir()
    (workdir / "policies" / "p.yaml").write_text(yaml.safe_dump({"stages": ["quantize"], "max": {"model/size_mb": 2}}))
    said = (f"error: the tracking store {damaged} is damaged (file is not a database): restore it from a backup, or "
            "point MLFLOW_TRACKING_URI at another store (moved aside, a new one is made in its place)\n")
    for command in (["compare"], ["gate", run_id, "--policy", "p"], ["gc"], ["gc", "--all"]):
        assert main(command) == 2, command
        out, err = capsys.readouterr()
        assert err.endswith(said) and "Traceback" not in err and "[SQL:" not in err, (command, err)
        assert "nothing to collect" not in out
