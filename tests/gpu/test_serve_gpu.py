"""What one user hits on a GPU: `deltaserve serve` on the 4B shape (dummy weights) and a streamed
completion through the official openai client."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from deltaserve.tiny import make_tiny


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    model = make_tiny(tmp_path_factory.mktemp("m4b"), "4b-shape", weights=False)
    port = free_port()
    args = ["--model", str(model), "--load-format", "dummy", "--max-num-seqs", "8", "--max-model-len", "4096"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "deltaserve.cli", "serve", *args, "--port", str(port)], env=dict(os.environ)
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600  # first start compiles and autotunes every kernel
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert proc.poll() is None, f"server exited with {proc.returncode}"
        time.sleep(1)
    yield base
    proc.terminate()
    assert proc.wait(timeout=60) == 0


def test_streamed_completion_on_the_4b_shape(server):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server}/v1", api_key="unused")
    model = client.models.list().data[0].id
    chunks = list(
        client.completions.create(
            model=model,
            prompt="Hello, my name is",
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert text and usage.completion_tokens == 16
    load = httpx.get(f"{server}/load").json()
    assert load["running"] == 0 and load["kv_pages_used"] == 0
