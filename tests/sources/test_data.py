import json
import random

import pytest

from quantbench.core.errors import UserError
from quantbench.sources.data import (
    calibration_windows,
    load_text,
    python_docs,
    python_docs_topics,
)


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


# ---------------------------------------------------------------------------------------------
# Windows that start the way the model expects (BOS where the tokenizer adds one)


def test_bos_id_is_what_the_tokenizer_does_also_after_a_reload(tiny_tokenizer, tiny_bos_tokenizer, tmp_path):
    from transformers import AutoTokenizer

    from quantbench.sources.data import bos_id, bos_tag

    assert bos_id(tiny_tokenizer) is None and bos_tag(tiny_tokenizer, None) == "none"
    assert bos_id(tiny_bos_tokenizer) == 1 and bos_tag(tiny_bos_tokenizer, 1) == "<s> (id 1)"
    tiny_bos_tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    # transformers 5 drops add_bos_token on save; the saved post-processor still adds <s>
    assert reloaded.add_bos_token is False and reloaded("x")["input_ids"][0] == 1
    assert bos_id(reloaded) == 1


def test_windows_with_bos_start_with_it_keep_their_length_and_cover_the_text_in_order():
    from quantbench.sources.data import framed, span, windows

    ids = list(range(10, 10 + 1000))
    cut = windows(ids, 100, 1)
    assert len(cut) == 1000 // 99 and all(len(w) == 100 and w[0] == 1 for w in cut)
    assert [t for w in cut for t in w[1:]] == ids[: len(cut) * 99]  # consecutive text, none skipped
    assert framed(ids, 100, 1) == [t for w in cut for t in w]
    assert span(100, 1) == 99 and span(100, None) == 100
    with pytest.raises(ValueError, match="cannot hold a BOS"):
        span(1, 1)


def test_without_bos_windows_and_ids_are_as_before(tiny_tokenizer):
    """A tokenizer that adds no BOS (SmolLM2's): the same ids and windows as before BOS framing."""
    from quantbench.sources.data import framed, text_ids, windows

    text = python_docs("calibration")
    ids = text_ids(tiny_tokenizer, text)
    assert ids == tiny_tokenizer(text)["input_ids"]
    assert framed(ids, 64, None) is ids
    assert windows(ids, 64, None) == [ids[i * 64 : (i + 1) * 64] for i in range(len(ids) // 64)]
    before = sorted(random.Random(3).sample(range(len(ids) // 64), 8))
    assert calibration_windows(ids, 8, 64, 3, field="f") == [ids[i * 64 : (i + 1) * 64] for i in before]


def test_calibration_windows_start_with_bos(tiny_bos_tokenizer):
    from quantbench.sources.data import text_ids

    text = python_docs("calibration")
    ids = text_ids(tiny_bos_tokenizer, text)
    assert ids[0] != 1 and 1 not in ids[:1000]  # the text's ids carry no BOS of their own
    cal = calibration_windows(ids, 8, 64, 3, field="f", bos=1)
    assert len(cal) == 8 and all(len(w) == 64 and w[0] == 1 and 1 not in w[1:] for w in cal)
    spans = [ids[i * 63 : (i + 1) * 63] for i in range(len(ids) // 63)]  # the text after each window's BOS
    assert all(w[1:] in spans for w in cal)
