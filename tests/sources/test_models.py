import pytest

from quantbench.core.errors import UserError
from quantbench.sources import models


def test_local_dir_resolves_with_license_and_stable_fingerprint(tiny_model_dir):
    a = models.resolve(str(tiny_model_dir))
    assert a.path == tiny_model_dir.resolve() and a.license == "mit"
    assert len(a.fingerprint) == 64 and models.resolve(str(tiny_model_dir)).fingerprint == a.fingerprint


def test_fingerprint_changes_with_the_weights(tiny_model_dir, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(tiny_model_dir, copy)
    before = models.fingerprint(copy)
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert models.fingerprint(copy) != before


def test_missing_path(tmp_path):
    with pytest.raises(UserError, match=r"model.source: '.*nope' does not exist"):
        models.resolve(str(tmp_path / "nope"))


def test_dir_without_config_and_non_gguf_file(tmp_path):
    with pytest.raises(UserError, match="no config.json"):
        models.resolve(str(tmp_path))
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(UserError, match="not a .gguf"):
        models.resolve(str(f))


def test_hub_id_offline_fails_at_once(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError, match=r"model.source: 'hub:HuggingFaceTB/SmolLM2-135M' needs the Hugging Face hub.*offline"):
        models.resolve("hub:HuggingFaceTB/SmolLM2-135M")


def test_unknown_builtin_suggests(monkeypatch):
    with pytest.raises(UserError, match="Did you mean 'smollm2-135m-instruct'"):
        models.resolve("builtin:smollm2-135m")


def test_builtin_gguf_is_found_in_its_package():
    path = models._builtin_gguf("smollm2-135m-instruct", "model.source")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 90e6


def broken_sources(tiny_model_dir, tmp_path) -> dict:
    """Model sources that are broken in the ways a new user's files are: each must be a clear
    UserError (exit 2 on the command line), found before anything runs."""
    import json
    import shutil

    def copy(name):
        dest = tmp_path / name
        shutil.copytree(tiny_model_dir, dest)
        return dest

    cases = {}
    d = copy("config-not-json")
    (d / "config.json").write_text('{"model_type": "llama", "hidden_size": 96,')
    cases["config-not-json"] = (d, "config.json is not valid JSON (line 1")
    d = copy("auto-map")
    config = json.loads((d / "config.json").read_text())
    config.update(model_type="my-own-llm", auto_map={"AutoModelForCausalLM": "modeling_mine.MyLLM"})
    (d / "config.json").write_text(json.dumps(config))
    cases["auto-map"] = (d, "asks for custom model code (auto_map: AutoModelForCausalLM)")
    d = copy("unknown-type")
    config = json.loads((d / "config.json").read_text())
    config.update(model_type="my-own-llm")
    (d / "config.json").write_text(json.dumps(config))
    cases["unknown-type"] = (d, "transformers cannot read")
    d = copy("truncated")
    weights = d / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    cases["truncated"] = (d, "model.safetensors is truncated")
    d = copy("pickle-only")
    (d / "model.safetensors").rename(d / "pytorch_model.bin")
    cases["pickle-only"] = (d, "holds only pickled weights (pytorch_model.bin)")
    gguf = tmp_path / "random.gguf"
    gguf.write_bytes(bytes(range(256)) * 64)
    cases["corrupt-gguf"] = (gguf, "is not a readable GGUF file")
    real = models._builtin_gguf("smollm2-135m-instruct", "model.source")
    cut = tmp_path / "cut.gguf"
    with open(real, "rb") as fh:
        cut.write_bytes(fh.read(200_000))
    cases["truncated-gguf"] = (cut, "is not a readable GGUF file")
    return cases


CASES = ["config-not-json", "auto-map", "unknown-type", "truncated", "pickle-only", "corrupt-gguf", "truncated-gguf"]


@pytest.mark.parametrize("case", CASES)
def test_broken_sources_are_named_not_crashed_on(case, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTBENCH_CACHE", str(tmp_path / "cache"))
    source, expected = broken_sources(tiny_model_dir, tmp_path)[case]
    with pytest.raises(UserError) as info:
        models.resolve(str(source))
    [problem] = info.value.problems
    assert problem.startswith("model.source: ") and expected in problem, problem
    assert not (tmp_path / "cache" / "models").exists() or not any((tmp_path / "cache" / "models").iterdir())
