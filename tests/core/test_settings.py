"""Settings files (quantbench.core.settings): every kind is read by one reader, so a file that is not
UTF-8 text is refused naming the file and the first bad byte (exit 2), whichever command reads it."""

import pytest

from quantbench.cli import main
from quantbench.core.errors import UserError

# a recipe saved in Latin-1: é is the byte 0xe9, which UTF-8 never has alone
LATIN1 = "quantize:\n  method: fp8\ndescription: café\n".encode("latin-1")


def _load(kind: str, path):
    from quantbench.jobs import sweep
    from quantbench.jobs.stack import schema
    from quantbench.quality.suite import load_suite
    from quantbench.recipe import load_recipe
    from quantbench.release.gate import load_policy
    from quantbench.speed.measure import load_profile

    return {
        "recipe": lambda: load_recipe(path),
        "stack": lambda: schema.load(str(path)),
        "sweep": lambda: sweep.load_sweep(str(path)),
        "suite": lambda: load_suite(path.stem),
        "profile": lambda: load_profile(path.stem),
        "policy": lambda: load_policy(str(path)),
    }[kind]()


@pytest.mark.parametrize("kind", ["recipe", "stack", "sweep", "suite", "profile", "policy"])
def test_a_settings_file_that_is_not_utf8_names_the_file_and_the_byte(kind, tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTBENCH_SUITES", str(tmp_path))
    monkeypatch.setenv("QUANTBENCH_PROFILES", str(tmp_path))
    path = tmp_path / f"latin1-{kind}.yaml"
    path.write_bytes(LATIN1)
    with pytest.raises(UserError) as refused:
        _load(kind, path)
    offset = LATIN1.index(b"\xe9")
    assert refused.value.problems == [f"{path}: not UTF-8 text (byte 0xe9 at offset {offset}); save it as UTF-8"]


def test_validate_refuses_random_bytes_with_exit_2_and_no_traceback(workdir, capsys):
    import random

    path = workdir / "recipes" / "noise.yaml"
    path.write_bytes(b"\xff" + random.Random(0).randbytes(3000))
    assert main(["validate", "--no-model", str(path)]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {path}: not UTF-8 text (byte 0xff at offset 0); save it as UTF-8\n"
