"""``epmoe serve`` over HTTPS (vLLM's ``--ssl-keyfile``, ``--ssl-certfile``; and ``--uvicorn-log-level``): a real
server process with a certificate made by ``trustme``, driven by the official ``openai`` client."""

from __future__ import annotations

import ssl
import time

import httpx
import openai
import pytest
import trustme

from tests.server.conftest import API_KEY

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    """``(trusting, key_path, cert_path)``: an ``ssl.SSLContext`` trusting a test CA, and a certificate it issued for
    127.0.0.1."""
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    d = tmp_path_factory.mktemp("tls")
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    cert.private_key_pem.write_to_path(str(d / "key.pem"))
    cert.cert_chain_pems[0].write_to_path(str(d / "cert.pem"))
    return ssl.create_default_context(cafile=str(d / "ca.pem")), d / "key.pem", d / "cert.pem"


@pytest.fixture(scope="module")
def server(start_server, tls):
    ca, key, cert = tls
    return start_server("--ssl-keyfile", str(key), "--ssl-certfile", str(cert), "--uvicorn-log-level", "info",
                        verify=ca)


def test_https_serves_the_openai_client(server, tls):
    assert server.url.startswith("https://127.0.0.1:")
    with httpx.Client(verify=tls[0]) as http:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60,
                               http_client=http)
        got = client.completions.create(model=client.models.list().data[0].id, prompt="Mixture of experts",
                                        max_tokens=3, temperature=0)
    assert got.usage.completion_tokens == 3 and got.choices[0].finish_reason == "length"


def test_plain_http_and_unknown_certificates_are_refused(server, tls):
    with httpx.Client(verify=tls[0], timeout=10) as http:
        assert http.get(f"{server.url}/health").status_code == 200
    with pytest.raises(httpx.TransportError):
        httpx.get(server.url.replace("https://", "http://") + "/health", timeout=10)
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(f"{server.url}/health", timeout=10)  # the system's CAs do not know the test CA


def test_uvicorn_log_level_reaches_uvicorn(server, tls):
    with httpx.Client(verify=tls[0], timeout=10) as http:
        assert http.get(f"{server.url}/version").status_code == 200
    deadline = time.monotonic() + 10  # the server's line may land just after the answer does
    while '"GET /version HTTP/1.1" 200' not in server.log.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    log = server.log.read_text()
    assert "Application startup complete" in log
    assert '"GET /version HTTP/1.1" 200' in log  # uvicorn's access log, on at info unless disabled


def test_disabled_access_log_logs_no_requests(start_server):
    server = start_server("--uvicorn-log-level", "info", "--disable-uvicorn-access-log")
    assert httpx.get(f"{server.url}/version", timeout=10).status_code == 200
    time.sleep(1)  # time for a line the server would write just after answering
    log = server.log.read_text()
    assert "Application startup complete" in log and "GET /version" not in log
