"""What quantbench knows about a checkpoint directory: its info file, read back by later stages."""

import shutil

from quantbench.cli import main
from tests.conftest import TINY_SUITE
from tests.helpers import runs


def test_a_corrupt_info_file_is_bad_input_naming_file_line_and_column(workdir, tiny_model_dir, capsys):
    checkpoint = workdir / "ckpt"
    shutil.copytree(tiny_model_dir, checkpoint)
    (checkpoint / "quantbench.json").write_text("{\n")
    (workdir / "suites").mkdir()
    (workdir / "suites" / "default.yaml").write_text(TINY_SUITE)
    assert main(["evaluate", str(checkpoint)]) == 2
    err = capsys.readouterr().err
    assert f"error: {checkpoint / 'quantbench.json'}: not valid JSON (line 2, column 1: Expecting property name" in err
    assert "Traceback" not in err
    assert runs() == []


def test_a_gguf_checkpoint_is_a_target_and_a_truncated_one_is_refused(tmp_path):
    """A `method: gguf` checkpoint holds a .gguf file, not safetensors: later stages (bench,
    evaluate, stack) take it; one whose file does not read as GGUF is bad input, named."""
    import pytest

    from quantbench.core.errors import UserError
    from quantbench.sources.checkpoint import check_weights
    from tests import gguf_files as gg

    good = tmp_path / "good"
    good.mkdir()
    gg.write_tiny_gguf(good / "model.gguf", gg.gpt2_bpe_vocab(400, add_bos=False))
    check_weights(good, "run")  # no error
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.gguf").write_bytes((good / "model.gguf").read_bytes()[:5000])
    with pytest.raises(UserError, match=r"run: .*bad/model\.gguf is not a readable GGUF file"):
        check_weights(bad, "run")
