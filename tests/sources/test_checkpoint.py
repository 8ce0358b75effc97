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
