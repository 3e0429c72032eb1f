"""Starting `rsgl serve` on loopback as a child process (benchmarks and tests)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

STARTUP_TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(
    log_path: Path, *flags: str, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    """`rsgl serve FLAGS` on a free port, once /health answers 200; RuntimeError (with the
    server's log) if it exits or does not come up. `env` adds environment variables."""
    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "rsgl", "serve", "--port", str(port), *flags]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"rsgl serve exited ({proc.returncode}):\n{log_path.read_text()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("rsgl serve did not start:\n" + log_path.read_text())
