"""The serving-engine seam: an engine is one class and one registry line. A test engine (a real
server process, tests/engines/echo_server.py) registered here shows up in `doctor`, in `--engine`
and `--server` choices, in a recipe's `bench.engine`, and is what `auto` picks where it serves;
`quantbench bench` then measures through it end to end, and stops it."""

import json
import os
import sys
from pathlib import Path

import psutil
import pytest

from quantbench import engines
from quantbench.cli import build_parser, main
from quantbench.engines import ServerSettings, ServingEngine
from quantbench.recipe import BenchSpec
from tests.conftest import TINY_PROFILE
from tests.helpers import OWNER, last_json, ours, runs

SCRIPT = Path(__file__).with_name("echo_server.py")
GAP_MS = 20  # the echo server's pause before each token


class EchoServer(ServingEngine):
    """Serves unquantized checkpoints only (a quantization_config: refused, with the reason)."""

    name = "echo"
    label = "echo server"
    kind = "server"
    health_timeout_s = 30.0

    def status(self):
        return True, "1.0", "test engine: streams one word per requested token"

    def unserved(self, checkpoint):
        config = checkpoint if isinstance(checkpoint, dict) else json.loads((Path(checkpoint) / "config.json").read_text())
        return "echo serves unquantized checkpoints only" if config.get("quantization_config") else None

    def describe(self, compiled=True):
        return "echo server 1.0"

    def server_command(self, checkpoint, port, settings: ServerSettings, tmp):
        return echo_command(checkpoint, port, GAP_MS)


@pytest.fixture
def echo():
    engines.register("echo", f"{__name__}:EchoServer", auto_before="vllm")
    yield engines.get("echo")
    engines.unregister("echo")


def echo_command(checkpoint, port: int, gap_ms: float, *extra: str) -> tuple[list[str], dict[str, str]]:
    """The echo server's command line and environment: only this test process's mark (`ours`)."""
    cmd = [sys.executable, str(SCRIPT), "serve", "--port", str(port), "--model", str(checkpoint),
           "--gap-ms", str(gap_ms), *extra]
    return cmd, {OWNER: os.environ[OWNER]}


def echo_servers() -> list:
    """The echo servers this test process started that are still running."""
    return ours(p for p in psutil.process_iter(["cmdline"]) if str(SCRIPT) in (p.info["cmdline"] or []))


def test_a_registered_engine_is_in_every_choice_and_first_for_auto(echo, tiny_model_dir, capsys):
    assert "echo" in engines.engine_choices() and engines.AUTO[0] == "echo"
    args = build_parser().parse_args(["bench", "x", "--engine", "echo", "--server", "echo"])
    assert (args.engine, args.server) == ("echo", "echo")
    assert BenchSpec(engine="echo").engine == "echo"
    chosen = engines.choose("auto", "auto", tiny_model_dir, tiny_model_dir)
    assert chosen.engine is echo and chosen.why == "auto: echo server serves this format on this CPU"
    # where it does not serve the checkpoint, auto says why and takes the next in order
    config = {**json.loads((tiny_model_dir / "config.json").read_text()), "quantization_config": {"quant_method": "fp8"}}
    chosen = engines.choose("auto", "auto", config, tiny_model_dir)
    assert chosen.engine is not echo and "echo server does not serve the checkpoint on this CPU: echo serves " \
        "unquantized checkpoints only" in chosen.why
    assert main(["doctor", "--json"]) == 0
    facts = {f["name"]: f for f in last_json(capsys.readouterr().out)["engines"]}
    assert facts["echo server"] == {"name": "echo server", "available": True, "version": "1.0",
                                    "detail": "test engine: streams one word per requested token"}


def test_unknown_engines_are_named_with_the_choices(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "x", "--engine", "vlm"])
    assert "invalid choice: 'vlm'" in capsys.readouterr().err
    with pytest.raises(Exception, match=r"unknown value 'vlm'\. Did you mean 'vllm'\?"):
        BenchSpec(engine="vlm")
    with pytest.raises(Exception, match="--engine: unknown engine 'vlm'. Did you mean 'vllm'"):
        engines.get("vlm")
    assert "echo" not in engines.engine_choices()  # unregistered again after its test


def test_the_old_name_backend_still_picks_the_engine_and_says_it_is_deprecated(capsys, caplog):
    """`--backend` (bench, noise) and a recipe's `bench.backend` were the engine's names before it was
    called `engine`: still read, into the same place, with a warning; a recipe's sha is unchanged."""
    for command in ("bench", "noise"):
        args = build_parser().parse_args([command, "x", "--backend", "hf"])
        assert args.engine == "hf" and "--backend is deprecated; it is now called --engine" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "x", "--backend", "vlm"])
    assert "invalid choice: 'vlm'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--help"])
    assert "--backend ENGINE deprecated: the old name of --engine" in " ".join(capsys.readouterr().out.split())
    with caplog.at_level("WARNING"):
        assert BenchSpec(backend="hf") == BenchSpec(engine="hf")
    assert "bench.backend is deprecated; it is now called bench.engine" in caplog.text
    with pytest.raises(Exception, match="backend is the old name of engine: give engine alone"):
        BenchSpec(backend="hf", engine="hf")


@pytest.mark.slow  # starts a server process for the checkpoint and one for its base
def test_bench_measures_through_a_registered_engine(echo, workdir, tiny_model_dir, capsys):
    (workdir / "profiles").mkdir()
    (workdir / "profiles" / "tiny.yaml").write_text(TINY_PROFILE.replace("repetitions: 1", "repetitions: 2"))
    assert main(["bench", str(tiny_model_dir), "--base", str(tiny_model_dir), "--profile", "tiny", "--json"]) == 0
    out = capsys.readouterr().out
    assert "measured through: echo server 1.0 (auto: echo server serves this format on this CPU)" in out
    m = last_json(out)["metrics"]
    for prefix in ("speed/", "base_speed/"):
        # 4 tokens a request, each sent after a 20 ms pause: no request can end sooner than 80 ms
        # after it was sent, nor its first token come sooner than 20 ms (a client that reads late
        # may see gaps shorter than the server's, never a whole request shorter)
        assert m[prefix + "e2e_ms_p50"] >= 4 * GAP_MS and m[prefix + "ttft_ms_p50"] >= GAP_MS
        assert m[prefix + "c1/throughput_tok_s"] <= 1000 / GAP_MS and m[prefix + "peak_mem_mb"] > 0
    [run] = runs()
    assert run.info.status == "FINISHED"
    assert run.data.tags["quantbench.bench_server"] == "echo" and run.data.tags["quantbench.bench_backend"] == "serve"
    assert run.data.tags["quantbench.bench_engine"] == "echo server 1.0"
    assert echo_servers() == []  # both stopped
