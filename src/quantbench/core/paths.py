"""Where quantbench keeps what it caches, and whether the model hub can be reached: the two facts
about the machine that the sources, engines and texts all ask."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from urllib.parse import urlparse


def cache_dir() -> Path:
    return Path(os.environ.get("QUANTBENCH_CACHE", Path.home() / ".cache" / "quantbench"))


def hub_reachable(timeout: float = 3.0) -> bool:
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return False
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False
