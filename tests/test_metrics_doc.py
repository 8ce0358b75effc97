"""docs/metrics.md and the metric catalogue (src/quantbench/metrics.py) name the same metrics,
tags and artifacts, and every tag the code sets is in the catalogue: neither drifts."""

import re
from pathlib import Path

import pytest

from quantbench import metrics

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "metrics.md"


def section_names(title: str) -> list[str]:
    """The backticked names in the first column of the table under `## title`."""
    text = DOC.read_text()
    body = text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]
    return [m.group(1) for m in re.finditer(r"^\| `([^`]+)` \|", body, flags=re.M)]


@pytest.mark.parametrize("title, catalogue", [
    ("Metrics", metrics.documented_metrics),
    ("Tags", lambda: set(metrics.TAGS)),
    ("Artifacts", lambda: set(metrics.ARTIFACTS)),
])
def test_doc_and_catalogue_name_the_same_things(title, catalogue):
    documented = section_names(title)
    assert len(documented) == len(set(documented)), "a name is documented twice"
    expected = catalogue()
    assert sorted(set(documented) - expected) == [], f"in docs/metrics.md ({title}) but not in the catalogue"
    assert sorted(expected - set(documented)) == [], f"in the catalogue but not in docs/metrics.md ({title})"


def test_every_metric_has_a_direction_that_matches_the_doc():
    text = DOC.read_text().split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0]
    for row in re.finditer(r"^\| `([^`]+)` \|.*\| ([^|]+) \|$", text, flags=re.M):
        name, documented = row.group(1), row.group(2).strip()
        if "<" in name and name not in ("speed/c<N>/throughput_tok_s", "speed/c<N>/requests_s"):
            continue  # families: their direction is their member's
        probe = name.replace("<N>", "4")
        assert (metrics.direction(probe) or "—") == documented, name


def test_every_tag_the_code_sets_is_in_the_catalogue():
    used = set()
    for path in (REPO / "src" / "quantbench").rglob("*.py"):
        used |= set(re.findall(r'TAG \+ "([a-z_.]+)"', path.read_text()))
        used |= set(re.findall(r'\{TAG\}([a-z_.]+)"', path.read_text()))
    assert used, "the scan found no tags"
    known = {name.removeprefix("quantbench.") for name in metrics.TAGS}
    missing = sorted(t for t in used if t not in known and not t.endswith(".") and t != "gate.")
    assert missing == [], f"tags set in src/ but missing from metrics.TAGS and docs/metrics.md: {missing}"


def test_no_link_leaves_the_repository():
    for path in [REPO / "README.md", *(REPO / "docs").glob("*.md"), *(REPO / "src").rglob("*.py")]:
        text = path.read_text()
        assert "DESIGN.md" not in text, path
        if path.suffix != ".md":
            continue
        # a relative path that climbs out (a link or not) must land on something of this repository
        for climb in re.findall(r"(?:\.\./)+[\w.-]+", text):
            target = (path.parent / climb).resolve()
            assert REPO.resolve() in target.parents and target.exists(), f"{path.relative_to(REPO)} points outside: {climb}"
        for target in re.findall(r"\]\(([^)#]+)", text):
            if target.startswith(("http://", "https://")):
                continue
            assert (path.parent / target).exists(), f"{path.relative_to(REPO)} links to a missing {target}"
