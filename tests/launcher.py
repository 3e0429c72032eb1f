"""Starting and stopping a real `rsgl serve` on loopback for the server tests."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest

from rsgl.bench.serve_process import start_server


def launch(
    log_path: Path, *flags: str, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    """Starts `rsgl serve` on a free port and waits until /health answers 200; `env` adds
    environment variables."""
    try:
        return start_server(log_path, *flags, env=env)
    except RuntimeError as exc:
        pytest.fail(str(exc))


def stop(proc: subprocess.Popen[bytes], log_path: Path) -> str:
    """SIGTERM (a graceful drain), then the log; the exit must be clean (0)."""
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=90)
    text = log_path.read_text()
    assert code == 0, text
    assert "Application shutdown complete" in text
    return text
