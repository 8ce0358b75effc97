import pytest

from quantbench.tracking import Tracker, flatten

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


def test_default_store_is_sqlite_in_the_working_dir(workdir, monkeypatch):
    from quantbench.tracking import tracking_uri

    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert tracking_uri() == f"sqlite:///{workdir / 'mlflow.db'}"


def test_flatten():
    assert flatten({"a": {"b": 1, "c": {"d": [1]}}, "e": None}) == {"a.b": 1, "a.c.d": [1], "e": None}
