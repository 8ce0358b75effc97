"""What quantbench knows about a checkpoint directory: its info file, read back by later stages."""

import json
import shutil
from pathlib import Path

import pytest

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



@pytest.mark.parametrize(
    "content, base, expected",
    [
        ({"run_id": 5}, True, "run_id: expected a string (or null), got 5"),
        ({"base_model": "builtin:x"}, False, "base_model: expected an object (or null), got \"builtin:x\""),
        ({"base_model": {"source": ["a"]}, "weights_sha": {}}, False,
         "base_model.source: expected a string (or null), got [\"a\"]"),
        ([1, 2], True, "not a JSON object (got an array); quantbench writes this file with the checkpoint"),
    ],
)
def test_an_info_file_of_the_wrong_types_is_bad_input_naming_field_and_type(workdir, tiny_model_dir, capsys, content,
                                                                            base, expected):
    """Valid JSON that is not what quantbench writes (edited by hand, written by another tool): both
    stages that read it refuse it, exit 2, naming the file, the field and the type it must have."""
    from quantbench.tracking import Tracker

    with Tracker("elsewhere").start_run("a store to look the run id up in", {}):
        pass
    checkpoint = workdir / "ckpt"
    shutil.copytree(tiny_model_dir, checkpoint)
    info = checkpoint / "quantbench.json"
    info.write_text(json.dumps(content))
    (workdir / "suites").mkdir()
    (workdir / "suites" / "default.yaml").write_text(TINY_SUITE)
    for command in ("evaluate", "bench"):
        assert main([command, str(checkpoint), *(["--base", str(tiny_model_dir)] if base else [])]) == 2
        err = capsys.readouterr().err
        assert f"error: {info}: {expected}" in err, err
        assert "Traceback" not in err
    if isinstance(content, dict) and "weights_sha" in content:
        assert f"error: {info}: weights_sha: expected a string (or null), got {{}}" in err  # every field at once
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


@pytest.mark.slow  # the real llama.cpp: llama-quantize, and llama-perplexity in the evaluate stage
@pytest.mark.llamacpp
def test_a_gguf_file_on_its_own_is_evaluated_against_the_base_it_names(workdir, capsys):
    """A GGUF file as downloaded (no directory, no quantbench info) is a target like a checkpoint
    directory: with --base it is scored against that base (a Q8_0 file of an F32 one: close),
    both ways (transformers de-quantizing it, and llama.cpp itself). Without --base, or truncated,
    it is bad input, named, and no run is made."""
    from quantbench.engines import llamacpp
    from quantbench.engines import llamacpp_build as build
    from tests import gguf_files as gg
    from tests.helpers import last_json

    base = gg.write_tiny_gguf(workdir / "tiny.gguf", gg.gpt2_bpe_vocab(400, add_bos=False))
    gguf = workdir / "tiny-Q8_0.gguf"
    tools = build.ensure("the test")
    llamacpp.run_tool([tools.tool("llama-quantize"), str(base), str(gguf), "Q8_0"], workdir / "q.log", "quantize")
    (workdir / "suites").mkdir()
    (workdir / "suites" / "tiny.yaml").write_text(TINY_SUITE.replace("tokens: 640", "tokens: 1024"))
    assert main(["evaluate", str(gguf), "--suite", "tiny"]) == 2
    assert f"'{gguf}': a GGUF file on its own names no base model: give it with --base SOURCE" in capsys.readouterr().err
    assert main(["evaluate", str(gguf), "--base", str(base), "--suite", "tiny", "--json"]) == 0, capsys.readouterr().err
    result = last_json(capsys.readouterr().out)
    m = result["metrics"]
    # llama-perplexity prints its KLD to 6 decimals: a Q8_0 file's ~1e-6 may print as 0.000000
    assert 0 < m["quality/kld_mean"] < 0.01 and 0 <= m["quality_engine/kld_mean"] < 0.01
    assert m["quality_engine/same_top_p"] > 0.9  # llama.cpp's own reading: the same top token almost always
    [candidate] = [r for r in runs() if r.data.tags.get("quantbench.role") == "candidate"]
    assert candidate.info.status == "FINISHED" and candidate.data.tags["quantbench.format"] == "gguf"
    view = Path(result["checkpoint"])
    assert (view / gguf.name).resolve() == gguf.resolve()  # linked, not copied
    quant = json.loads((view / "config.json").read_text())["quantization_config"]
    assert quant == {"quant_method": "gguf", "type": "Q8_0", "file": gguf.name}
    cut = workdir / "cut.gguf"
    cut.write_bytes(gguf.read_bytes()[:5000])
    assert main(["evaluate", str(cut), "--base", str(base), "--suite", "tiny"]) == 2
    assert f"{cut} is not a readable GGUF file" in capsys.readouterr().err
    assert len([r for r in runs() if r.data.tags.get("quantbench.role") == "candidate"]) == 1
