"""Starting `rsgl serve` on loopback as a child process (benchmarks and tests)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from rsgl.parent_death import PARENT_LINK_ENV, ParentLink

STARTUP_TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(
    log_path: Path, *flags: str, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    """`rsgl serve FLAGS` on a free port, once /health answers 200; RuntimeError (with the
    server's log) if it exits or does not come up. `env` adds environment variables. The
    server dies with this process, however it ends (`rsgl.parent_death`): a benchmark
    killed mid-run leaves no server holding a model."""
    port = free_port()
    cmd = [sys.executable, "-m", "rsgl", "serve", "--port", str(port), *flags]
    link = {PARENT_LINK_ENV: ParentLink.here().encode()}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {}), **link}
        )
    return proc, wait_healthy(proc, f"http://127.0.0.1:{port}", log_path, "rsgl serve")


def wait_healthy(
    proc: subprocess.Popen[bytes],
    url: str,
    log_path: Path,
    name: str,
    timeout_s: float = STARTUP_TIMEOUT_S,
) -> str:
    """`url` once its /health answers 200; RuntimeError with the end of the server's log if
    the process exits first or `timeout_s` passes (the process is then killed)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"{name} exited ({proc.returncode}):\n{log_path.read_text()[-4000:]}"
            )
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{name} did not start:\n{log_path.read_text()[-4000:]}")
