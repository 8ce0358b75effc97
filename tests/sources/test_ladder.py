"""The size ladder's rungs on disk: what a rung holds (its model and its GGUF conversions) and its removal.
An 8B rung holds ~28 GiB, which a CI machine sharing the disk does not have to spare."""

from quantbench.sources import ladder


def test_a_rung_holds_its_model_and_its_conversions_and_remove_frees_only_those(tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTBENCH_CACHE", str(tmp_path))
    model = ladder.path("llama-3.2-1b")
    model.mkdir(parents=True)
    (model / "model.safetensors").write_bytes(b"w" * 1000)
    conversion = tmp_path / "gguf" / "0123456789abcdef-0.3.36-F16"
    conversion.mkdir(parents=True)
    (conversion / "llama-3.2-1b-F16.gguf").write_bytes(b"g" * 500)
    (conversion / "convert.log").write_text("log\n")
    other = tmp_path / "gguf" / "fedcba9876543210-0.3.36-F16"  # another model's conversion stays
    other.mkdir()
    (other / "SmolLM2-135M-Instruct-F16.gguf").write_bytes(b"s" * 300)
    ladder.path("llama-3.2-3b").mkdir()  # another rung stays

    assert ladder.held("llama-3.2-1b") == [model, conversion]
    assert ladder.remove("llama-3.2-1b") == 1000 + 500 + 4
    assert not model.exists() and not conversion.exists()
    assert other.is_dir() and ladder.path("llama-3.2-3b").is_dir()
    assert ladder.held("llama-3.2-1b") == [] and ladder.remove("llama-3.2-1b") == 0
