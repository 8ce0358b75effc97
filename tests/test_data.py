import json

import pytest

from quantbench.data import calibration_windows, load_text, python_docs, python_docs_topics
from quantbench.errors import UserError


def test_python_docs_splits_are_disjoint_and_deterministic():
    from pydoc_data.topics import topics

    calibration, evaluation = python_docs("calibration"), python_docs("evaluation")
    assert len(calibration) > 300_000 and len(evaluation) > 50_000
    assert python_docs("evaluation") == evaluation
    cal_keys, eval_keys = python_docs_topics("calibration"), python_docs_topics("evaluation")
    assert not set(cal_keys) & set(eval_keys) and set(cal_keys) | set(eval_keys) == set(topics)
    assert 10 <= len(eval_keys) <= 25  # about one topic in five
    assert topics[eval_keys[0]] in evaluation and topics[eval_keys[0]] not in calibration


def test_windows_are_seeded_disjoint_and_sized():
    ids = list(range(1000))
    a = calibration_windows(ids, 5, 100, seed=0, field="f")
    assert a == calibration_windows(ids, 5, 100, seed=0, field="f")
    assert a != calibration_windows(ids, 5, 100, seed=1, field="f")
    assert all(len(w) == 100 for w in a)
    starts = [w[0] for w in a]
    assert all(s % 100 == 0 for s in starts) and len(set(starts)) == 5


def test_too_few_tokens_is_a_clear_error():
    with pytest.raises(UserError, match=r"asked for 11 samples of 100 tokens but the text holds only 10"):
        calibration_windows(list(range(1000)), 11, 100, seed=0, field="calibration.samples")


def test_empty_file_is_an_error(tmp_path):
    empty = tmp_path / "cal.txt"
    empty.write_text("  \n")
    with pytest.raises(UserError, match=r"calibration.source: '.*cal.txt' is empty"):
        load_text(str(empty), field="calibration.source")


def test_jsonl_reads_the_text_field_and_names_bad_lines(tmp_path):
    good = tmp_path / "c.jsonl"
    good.write_text(json.dumps({"text": "alpha"}) + "\n\n" + json.dumps({"text": "beta"}) + "\n")
    assert load_text(str(good), field="f") == "alpha\n\nbeta"
    bad = tmp_path / "d.jsonl"
    bad.write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(UserError, match=r"d.jsonl:1: no string field 'text'"):
        load_text(str(bad), field="f")


def test_missing_file_and_unknown_builtin(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_text(str(tmp_path / "nope.txt"), field="calibration.source")
    with pytest.raises(UserError, match="Did you mean 'python-docs'"):
        load_text("builtin:python-doc", field="calibration.source")


def test_hub_dataset_offline_fails_at_once(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError, match="not reachable"):
        load_text("hub:wikitext", field="calibration.source")
