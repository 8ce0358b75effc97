"""The echo server (tests/engines/echo_server.py: a real streaming server process, no model)
registered as an engine, for the speed tests that check what is refused before a server starts."""

import pytest

from quantbench import engines


@pytest.fixture
def echo_engine():
    engines.register("echo", "tests.engines.test_registry:EchoServer")
    yield engines.get("echo")
    engines.unregister("echo")
