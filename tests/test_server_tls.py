"""--ssl-keyfile / --ssl-certfile: the server speaks HTTPS, the openai client reaches it, and SIGTERM
ends the server promptly with a TLS connection still open."""

from __future__ import annotations

import ssl
import subprocess
import sys
import time

import httpx
import openai
import pytest
import trustme
from server_fixture import MODEL, SMALL_ENGINE, free_port

# Asserts wall-clock bounds: `make test` runs it alone, after the tests it runs side by side.
pytestmark = pytest.mark.serial


def test_https_with_the_given_certificate(tmp_path) -> None:
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    key_file, cert_file, ca_file = tmp_path / "key.pem", tmp_path / "cert.pem", tmp_path / "ca.pem"
    cert.private_key_pem.write_to_path(key_file)
    cert.cert_chain_pems[0].write_to_path(cert_file)
    ca.cert_pem.write_to_path(ca_file)
    port = free_port()
    cmd = [sys.executable, "-m", "deltaserve.cli", "serve", *SMALL_ENGINE, "--port", str(port)]
    cmd += ["--ssl-keyfile", str(key_file), "--ssl-certfile", str(cert_file)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        http = httpx.Client(verify=ssl.create_default_context(cafile=str(ca_file)), timeout=60)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                if http.get(f"https://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        client = openai.OpenAI(
            base_url=f"https://127.0.0.1:{port}/v1", api_key="none", http_client=http, max_retries=0
        )
        out = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
        assert out.choices[0].text is not None
        plain = httpx.Client(timeout=5)
        try:
            plain.get(f"http://127.0.0.1:{port}/health")
            raise AssertionError("plain HTTP was answered")
        except httpx.TransportError:
            pass
        # SIGTERM while the client's idle keep-alive TLS connection is still open: the server exits in
        # seconds (asyncio would give the connection 30 s for a close_notify the client never sends).
        started = time.monotonic()
        proc.terminate()
        assert proc.wait(20) == 0
        assert time.monotonic() - started < 10
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(60)
