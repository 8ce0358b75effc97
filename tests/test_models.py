import pytest

from quantbench import models
from quantbench.errors import UserError


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
