import pytest

from quantbench.quality.tasks import (
    continuation_items,
    flips,
    lastword_items,
    write_offline_suite,
)
from quantbench.sources.data import python_docs


def test_offline_items_are_deterministic_and_well_formed(tmp_path):
    text = python_docs("evaluation")
    last, cont = lastword_items(text), continuation_items(text)
    assert last == lastword_items(text) and cont == continuation_items(text)
    assert len(last) > 100 and len(cont) > 50
    for item in last:
        assert item["target"].startswith(" ") and item["target"][1:].isalpha()
        assert item["target"].strip() not in item["context"].split()[-1:]
    for item in cont:
        assert len(item["choices"]) == 4 and len(set(item["choices"])) == 4 and 0 <= item["gold"] < 4
    golds = [c["gold"] for c in cont]
    assert len(set(golds)) == 4  # the true continuation is not always in the same place
    counts = write_offline_suite(text, tmp_path)
    assert counts == {"qb_pydoc_lastword": len(last), "qb_pydoc_continuation": len(cont)}
    assert (tmp_path / "qb_pydoc_lastword.yaml").read_text().startswith("task: qb_pydoc_lastword\ndataset_path: json\n")
    # the suite lives in a cache other evaluations read at the same time: writing it again leaves
    # every file as it was (same inode, same mtime), so no reader sees a file emptied under it
    before = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in tmp_path.iterdir()}
    write_offline_suite(text, tmp_path)
    assert {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in tmp_path.iterdir()} == before


def test_flips_on_hand_made_results():
    base = {"a": {0: True, 1: True, 2: False, 3: False}, "b": {0: True, 1: False}}
    cand = {"a": {0: True, 1: False, 2: True, 3: False}, "b": {0: False, 1: False, 9: True}}
    out = flips(base, cand)
    # 6 shared items: a1 and b0 went right->wrong, a2 went wrong->right
    assert out["quality/flips_items"] == 6
    assert out["quality/flips_right_to_wrong_pct"] == pytest.approx(100 * 2 / 6)
    assert out["quality/flips_wrong_to_right_pct"] == pytest.approx(100 * 1 / 6)
    assert out["quality/flips_pct"] == pytest.approx(50.0)
    assert out["quality/flips_p_value"] == pytest.approx(1.0)  # 2 one way, 1 the other: McNemar sees nothing
    assert flips(base, base)["quality/flips_pct"] == 0 and flips(base, base)["quality/flips_p_value"] == 1.0
    lopsided = {"a": {i: True for i in range(12)}}
    assert flips(lopsided, {"a": {i: i >= 9 for i in range(12)}})["quality/flips_p_value"] == pytest.approx(2 * 0.5**9)
    assert flips(base, {}) == {}
