"""Authenticated integrations and secure defaults, over real HTTP.

One server with a token and the access log on (module scope); its stderr is read at the end to
check that ``?token=`` never reaches the log.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from urllib.parse import urlparse

import httpx
import pytest

from stapo.core.config import RewardConfig
from stapo.core.task.rewards import RewardError, RewardFunction
from tests.service.conftest import free_port, start_server

TOKEN = "t0ken-for-the-security-tests"


@pytest.fixture(scope="module")
def secured():
    srv = start_server(
        workers=1,
        args=("--access-log",),
        capture_stdout=True,
        STAPO_VERIFIER_TOKEN=TOKEN,
        STAPO_VERIFIER_LOG_LEVEL="info",
    )
    yield srv
    srv.stop()


def _raw_request(url: str, head: str, body: bytes = b"", wait_s: float = 3.0) -> bytes:
    """Send raw HTTP (headers, part of a body) and read what comes back within ``wait_s``."""
    u = urlparse(url)
    with socket.create_connection((u.hostname, u.port), timeout=wait_s) as s:
        s.sendall(head.encode() + body)
        s.settimeout(wait_s)
        try:
            return s.recv(65536)
        except TimeoutError:
            return b""


def test_docs_and_their_assets_need_no_token_and_nothing_else_opens(secured):
    """The API description is public (schema only, no data), with the scripts its pages load; the
    assets' prefix opens nothing but those files."""
    for path in ("/docs", "/redoc", "/openapi.json", "/docs-assets/swagger-ui-bundle.js", "/docs-assets/redoc.standalone.js"):
        assert httpx.get(secured.url + path).status_code == 200, path
    assert httpx.get(secured.url + "/metrics").status_code == 401
    assert httpx.get(secured.url + "/docs-assets/../metrics").status_code in (401, 404)
    assert httpx.post(secured.url + "/docs-assets/x/../../v1/verify", json={"items": []}).status_code in (401, 404, 405)


def test_token_is_checked_before_the_body_is_read(secured):
    """A request without the token is refused from its headers; the server does not wait
    for (or parse) the 1 MB body it announced."""
    head = (
        "POST /v1/verify HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        "Content-Length: 1000000\r\n\r\n"
    )
    t0 = time.monotonic()
    got = _raw_request(secured.url, head, b'{"items": [')
    assert got.startswith(b"HTTP/1.1 401"), got[:200]
    assert time.monotonic() - t0 < 2.0
    assert b"www-authenticate: Bearer" in got.lower().replace(
        b"www-authenticate: bearer", b"www-authenticate: Bearer"
    )


def test_trainer_reads_the_token_from_the_environment(secured, monkeypatch):
    """With no token in its config, the trainer's reward function uses STAPO_VERIFIER_TOKEN.
    (Before the access-log test below, which stops the module's server to read its whole log.)"""
    cfg = RewardConfig(urls=[secured.url], retries=0)
    monkeypatch.delenv("STAPO_VERIFIER_TOKEN", raising=False)
    rf = RewardFunction(cfg)
    with pytest.raises(RewardError, match="401"):
        rf(["\\boxed{2}"], ["2"])
    rf.close()
    monkeypatch.setenv("STAPO_VERIFIER_TOKEN", TOKEN)
    rf = RewardFunction(cfg)
    batch = rf(["\\boxed{2}", "\\boxed{3}"], ["2", "2"])
    rf.close()
    assert batch.rewards == [cfg.scale.correct, cfg.scale.wrong] and all(batch.valid)


def test_openrlhf_query_token_and_redacted_access_log(secured):
    """OpenRLHF's remote reward client sends only Content-Type; ``?token=`` works on
    /get_reward (only there), and the access log never shows the token."""
    body = {"query": ["Q: 1+1? A: so \\boxed{2}"], "prompts": ["Q: 1+1? A:"], "labels": ["2"]}
    assert httpx.post(f"{secured.url}/get_reward", json=body).status_code == 401
    assert httpx.post(f"{secured.url}/get_reward?token=wrong", json=body).status_code == 401
    r = httpx.post(f"{secured.url}/get_reward?token={TOKEN}", json=body)
    assert r.status_code == 200 and r.json()["rewards"] == [1.0]
    item = {"items": [{"prediction": "\\boxed{2}", "gold": "2"}]}
    assert httpx.post(f"{secured.url}/v1/verify?token={TOKEN}", json=item).status_code == 401  # header only
    ok = httpx.post(f"{secured.url}/v1/verify", json=item, headers={"Authorization": f"Bearer {TOKEN}"})
    assert ok.status_code == 200
    assert httpx.get(f"{secured.url}/readyz").status_code == 200  # probes never need it
    assert httpx.get(f"{secured.url}/openapi.json").status_code == 200
    assert httpx.get(f"{secured.url}/metrics").status_code == 401
    secured.stop()
    log = secured.proc.stdout.read().decode(errors="replace") + secured.proc.stderr.read().decode(
        errors="replace"
    )
    assert "/get_reward?token=***" in log, log[-2000:]
    assert TOKEN not in log and "token=wrong" not in log


def _serve(
    *args: str, env: dict[str, str] | None = None, wait_s: float = 30.0
) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if not k.startswith("STAPO_VERIFIER_")}
    e.update(env or {})
    cmd = [sys.executable, "-m", "stapo.cli.main", "verifier", "serve", "--port", str(free_port()), *args]
    return subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=wait_s)


def test_non_loopback_without_token_refuses_to_start():
    """Secure by default: a non-loopback host without a token refuses to start, naming both fixes."""
    out = _serve("--host", "0.0.0.0")
    assert out.returncode != 0
    err = out.stderr + out.stdout
    assert "STAPO_VERIFIER_TOKEN" in err and "--allow-unauthenticated" in err
    out = _serve(env={"STAPO_VERIFIER_HOST": "::"})
    assert out.returncode != 0 and "--allow-unauthenticated" in out.stderr + out.stdout


def test_exposure_check_passes_with_a_token_or_the_explicit_flag():
    from stapo.cli.common import CLIError
    from stapo.cli.verifier import build_settings, check_exposure

    check_exposure(build_settings(host="0.0.0.0", token="x"))
    check_exposure(build_settings(host="0.0.0.0", allow_unauthenticated=True))
    check_exposure(build_settings(host="127.0.0.1"))
    with pytest.raises(CLIError, match="allow-unauthenticated"):
        check_exposure(build_settings(host="10.1.2.3"))
    assert build_settings(limit_concurrency=8).limit_concurrency == 8


def test_limit_concurrency_reaches_uvicorn():
    """--limit-concurrency 2 (uvicorn counts the connection being accepted too): while one request is in
    flight, a second connection gets uvicorn's 503; alone, it is served."""
    srv = start_server(workers=1, args=("--limit-concurrency", "2"))
    try:
        import threading

        done: dict = {}
        hang = {"prediction": "\\boxed{5^{5^{5^{5^5}}}}", "gold": "1"}  # in flight a full deadline (2 s)

        def slow() -> None:
            done["code"] = httpx.post(f"{srv.url}/v1/verify", json={"items": [hang]}, timeout=60).status_code

        for _ in range(3):  # the hanging request itself may be the one refused if a probe raced it
            done.clear()
            t = threading.Thread(target=slow)
            t.start()
            time.sleep(0.5)  # it holds its connection ~2 s (one deadline)
            codes = set()
            while t.is_alive() and 503 not in codes:
                codes.add(httpx.get(f"{srv.url}/healthz").status_code)
                time.sleep(0.02)
            t.join(60)
            if done.get("code") == 200:
                break
        assert 503 in codes and done["code"] == 200
        assert httpx.get(f"{srv.url}/healthz").status_code == 200  # alone again: served
    finally:
        srv.stop()
