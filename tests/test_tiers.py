"""The fast tier starts no server, browser or database: conftest's guard recognises one."""

import subprocess

import pytest

from tests.conftest import _server_like


def test_the_fast_tier_guard_knows_a_server_when_it_sees_one():
    assert _server_like(["/venv/bin/transformers", "serve", "/ckpt", "--port", "1"])
    assert _server_like(["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", "x"])
    assert _server_like(["python", "-m", "quantbench", "ui", "--port", "5000"])
    assert _server_like(["/usr/bin/chromium", "--headless"]) and _server_like(["ray", "start", "--head"])
    assert not _server_like(["python", "-m", "quantbench", "quantize", "r", "--json"])
    assert not _server_like(["python", "-m", "quantbench.quantize.gptqmodel", "/tmp/job.json"])


def test_an_unmarked_test_cannot_start_a_server():
    with pytest.raises(AssertionError, match="mark it `slow`"):
        subprocess.Popen(["python", "-m", "quantbench", "ui", "--port", "1"])
