"""Reachability probes as users' networks have them: a proxy in the way (``HTTP(S)_PROXY``), a self-hosted W&B
server, offline switches. The Hub is the local stand-in; the proxy is a small forwarding proxy run by the test."""

from __future__ import annotations

import http.client
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import huggingface_hub
import pytest
from conftest import free_port
from fake_hub import FakeHub
from huggingface_hub import constants

from hf_tune.records import wandb_run
from hf_tune.records.wandb_run import wandb_base_url, wandb_can_sync
from hf_tune.workflows import hub


class LocalServer:
    """An HTTP server on 127.0.0.1 in a thread, recording (method, target) of every request it is sent."""

    def __init__(self, handle):
        self.requests: list[tuple[str, str]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def handle_one_request(self):
                self.raw_requestline = self.rfile.readline(65537)
                if self.parse_request():
                    server.requests.append((self.command, self.path))
                    handle(self)
                self.close_connection = True

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def answer(request: BaseHTTPRequestHandler, status: int = 200, body: bytes = b"", headers=()) -> None:
    request.send_response(status)
    for name, value in headers:
        request.send_header(name, value)
    request.send_header("Content-Length", str(len(body)))
    request.end_headers()
    if request.command != "HEAD":
        request.wfile.write(body)


def forwarding_proxy(routes: dict[str, str]) -> LocalServer:
    """A plain-HTTP forwarding proxy that knows host names no resolver does: ``routes`` maps them to addresses.
    It refuses CONNECT (no HTTPS here) and names it refuses with a 502, as a proxy that cannot reach a host does."""

    def forward(request: BaseHTTPRequestHandler) -> None:
        target = urlsplit(request.path)
        if request.command == "CONNECT" or target.hostname not in routes:
            return answer(request, 502)
        body = request.rfile.read(int(request.headers.get("Content-Length") or 0))
        upstream = http.client.HTTPConnection(routes[target.hostname], target.port or 80, timeout=10)
        headers = {k: v for k, v in request.headers.items() if not k.lower().startswith(("proxy-", "connection"))}
        upstream.request(request.command, target.path or "/", body=body or None, headers=headers)
        response = upstream.getresponse()
        relayed = [(k, v) for k, v in response.getheaders() if k.lower() not in ("content-length", "connection",
                                                                                 "transfer-encoding")]
        answer(request, response.status, response.read(), relayed)
        upstream.close()

    return LocalServer(forward)


@pytest.fixture
def network(monkeypatch):
    """No proxy from the machine's own environment, and probes that ask afresh (they are cached per process)."""
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)
    for name in ("WANDB_BASE_URL", "WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.setenv(name, "")  # recorded, so a WANDB_MODE the code sets is undone after the test
        monkeypatch.delenv(name)
    monkeypatch.setenv("NETRC", "/nonexistent/netrc")
    monkeypatch.setenv("WANDB_CONFIG_DIR", "/nonexistent/wandb")

    def use_proxy(url: str) -> None:
        for name in ("HTTP_PROXY", "HTTPS_PROXY"):
            monkeypatch.setenv(name, url)
        huggingface_hub.close_session()  # its client reads the proxy settings when it is made

    clear = (hub.hub_is_reachable.cache_clear, wandb_run.server_answers.cache_clear, huggingface_hub.close_session)
    for step in clear:
        step()
    yield use_proxy
    for step in clear:
        step()


def test_the_hub_probe_reaches_a_hub_that_only_the_proxy_can_reach(network, monkeypatch):
    with FakeHub() as fake, forwarding_proxy({"hub.invalid": "127.0.0.1"}) as proxy:
        endpoint = f"http://hub.invalid:{fake.url.rsplit(':', 1)[1]}"  # .invalid: no resolver knows the name
        monkeypatch.setattr(constants, "ENDPOINT", endpoint)
        assert hub.hub_is_reachable() is False
        hub.hub_is_reachable.cache_clear()
        network(proxy.url)
        assert hub.hub_is_reachable() is True
    assert proxy.requests == [("HEAD", f"{endpoint}/")]
    assert [(method, path) for method, path, _ in fake.requests] == [("HEAD", "/")]


def test_the_hub_probe_says_unreachable_when_the_proxy_cannot_reach_the_hub(network, monkeypatch):
    with forwarding_proxy({}) as proxy:
        monkeypatch.setattr(constants, "ENDPOINT", "http://hub.invalid")
        network(proxy.url)
        assert hub.hub_is_reachable() is False  # the proxy answers, with a 502
    assert proxy.requests == [("HEAD", "http://hub.invalid/")]


def test_the_hub_probe_sends_nothing_under_HF_HUB_OFFLINE(network, monkeypatch):
    with FakeHub() as fake:
        monkeypatch.setattr(constants, "ENDPOINT", fake.url)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
        assert hub.hub_is_reachable() is False
    assert fake.requests == []


def test_the_wandb_probe_asks_the_self_hosted_server_through_the_proxy(network, monkeypatch):
    with LocalServer(answer) as wandb_server, forwarding_proxy({"wandb.invalid": "127.0.0.1"}) as proxy:
        base_url = f"http://wandb.invalid:{wandb_server.port}"
        monkeypatch.setenv("WANDB_BASE_URL", base_url)
        monkeypatch.setenv("WANDB_API_KEY", "local-key")
        assert wandb_can_sync() == (False, f"the W&B server {base_url} does not answer")
        wandb_run.server_answers.cache_clear()
        network(proxy.url)
        assert wandb_can_sync() == (True, "")
    assert proxy.requests == [("HEAD", f"{base_url}/")]  # that server only: nothing went to api.wandb.ai
    assert wandb_server.requests == [("HEAD", "/")]


def test_the_wandb_key_is_the_one_for_the_configured_server(network, monkeypatch, tmp_path):
    with LocalServer(answer) as wandb_server:
        (tmp_path / "settings").write_text(f"[default]\nbase_url = {wandb_server.url}\n")  # `wandb login --host`
        monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path))
        assert wandb_base_url() == wandb_server.url
        netrc = tmp_path / "netrc"
        netrc.write_text("machine api.wandb.ai login user password cloud-key\n")
        netrc.chmod(0o600)
        monkeypatch.setenv("NETRC", str(netrc))
        assert wandb_can_sync() == (False, f"no W&B API key for {wandb_server.url} (WANDB_API_KEY, or "
                                           f"`wandb login --host {wandb_server.url}`)")
        netrc.write_text(f"machine 127.0.0.1:{wandb_server.port} login user password local-key\n")
        assert wandb_can_sync() == (True, "")
    assert wandb_server.requests == [("HEAD", "/")]


def test_the_wandb_probe_sends_nothing_when_wandb_mode_is_offline(network, monkeypatch):
    with LocalServer(answer) as wandb_server:
        monkeypatch.setenv("WANDB_BASE_URL", wandb_server.url)
        monkeypatch.setenv("WANDB_API_KEY", "local-key")
        monkeypatch.setenv("WANDB_MODE", "offline")
        assert wandb_can_sync() == (False, "WANDB_MODE=offline")
    assert wandb_server.requests == []


def test_a_wandb_server_that_is_down_is_reported_by_its_url(network, monkeypatch):
    base_url = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("WANDB_BASE_URL", base_url)
    monkeypatch.setenv("WANDB_API_KEY", "local-key")
    assert wandb_can_sync() == (False, f"the W&B server {base_url} does not answer")
