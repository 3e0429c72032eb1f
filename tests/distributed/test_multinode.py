"""A two-"node" tensor-parallel server on loopback: `rsgl serve --nnodes 2` started twice,
node 0 with the HTTP server and rank 0, node 1 with only rank 1."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
from launcher import launch, stop

from rsgl.bench.serve_process import free_port


def test_two_nodes_on_loopback_serve_a_completion_and_stop_cleanly(tmp_path: Path) -> None:
    common = ["--tp", "2", "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{free_port()}"]
    common += ["--dtype", "float32", "--max-total-tokens", "4096", "--cpu-threads", "1"]
    node1_log = tmp_path / "node1.log"
    with open(node1_log, "wb") as log:
        node1 = subprocess.Popen(
            [sys.executable, "-m", "rsgl", "serve", "--node-rank", "1", *common],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        node0_log = tmp_path / "node0.log"
        node0, url = launch(node0_log, "--node-rank", "0", *common)
        body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
        answer = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 8
        info = httpx.get(f"{url}/get_server_info", timeout=10).json()
        assert info["tp_size"] == 2 and len(info["tp_shards"]) == 2
        stop(node0, node0_log)  # SIGTERM to node 0: it drains, then stops rank 1
        assert node1.wait(timeout=60) == 0, node1_log.read_text()
        assert "stopped by rank 0" in node1_log.read_text()
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()
