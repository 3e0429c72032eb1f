"""Starting and stopping a real `rsgl serve` on loopback for the server tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(
    log_path: Path, *flags: str, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    """Starts `rsgl serve` on a free port and waits until /health answers 200; `env` adds
    environment variables."""
    port = free_port()
    cmd = [sys.executable, "-m", "rsgl", "serve", "--port", str(port), *flags]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        assert proc.poll() is None, log_path.read_text()
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    pytest.fail("server did not start: " + log_path.read_text())


def stop(proc: subprocess.Popen[bytes], log_path: Path) -> str:
    """SIGTERM (a graceful drain), then the log; the exit must be clean (0)."""
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=90)
    text = log_path.read_text()
    assert code == 0, text
    assert "Application shutdown complete" in text
    return text
