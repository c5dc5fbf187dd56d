"""A second server, started with a bearer token: auth on every route but health, then graceful shutdown.

The two tests share one server (module scope) to pay its start-up once; the shutdown test runs last
in this file and ends it.
"""

from __future__ import annotations

import signal
import threading

import httpx
import pytest

from tests.service.conftest import start_server, sympy_items, wait_in_flight

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def token_server():
    srv = start_server(workers=1, STAPO_VERIFIER_TOKEN=TOKEN)
    yield srv
    srv.stop()


def test_token_required_on_every_route_but_health(token_server):
    url = token_server.url
    item = {"items": [{"prediction": "\\boxed{2}", "gold": "2"}]}
    assert httpx.post(f"{url}/v1/verify", json=item).status_code == 401
    bad = httpx.post(f"{url}/v1/verify", json=item, headers={"Authorization": "Bearer nope"})
    assert bad.status_code == 401 and bad.headers["www-authenticate"] == "Bearer"
    assert "token" in bad.json()["detail"]
    ok = httpx.post(f"{url}/v1/verify", json=item, headers={"Authorization": f"Bearer {TOKEN}"})
    assert ok.status_code == 200 and ok.json()["results"][0]["correct"] is True
    assert httpx.post(f"{url}/get_reward", json={"query": ["1"], "labels": ["1"]}).status_code == 401
    assert httpx.get(f"{url}/metrics").status_code == 401
    assert httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
    assert httpx.get(f"{url}/healthz").status_code == 200  # probes never need the token
    assert httpx.get(f"{url}/readyz").status_code == 200


def test_graceful_shutdown_finishes_in_flight_request(token_server):
    """SIGTERM while a request is being graded: the request still gets all its results, then the server
    exits and leaves no process behind (workers, fork server: every descendant is gone)."""
    import psutil

    items = sympy_items(30)
    descendants = psutil.Process(token_server.proc.pid).children(recursive=True)
    assert token_server.worker_pids() and set(token_server.worker_pids()) <= {p.pid for p in descendants}
    out: dict = {}

    def send() -> None:
        with httpx.Client(timeout=60, headers={"Authorization": f"Bearer {TOKEN}"}) as c:
            r = c.post(f"{token_server.url}/v1/verify", json={"items": items})
            out["code"] = r.status_code
            out["results"] = r.json()["results"]

    t = threading.Thread(target=send)
    t.start()
    wait_in_flight(token_server, t)
    token_server.proc.send_signal(signal.SIGTERM)
    t.join(timeout=60)
    code = token_server.stop()
    assert out["code"] == 200 and len(out["results"]) == len(items)
    assert all(r["status"] == "ok" and r["correct"] for r in out["results"])
    assert code in (0, -signal.SIGTERM)  # uvicorn re-raises SIGTERM after its graceful shutdown
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{token_server.url}/healthz", timeout=2)
    _, alive = psutil.wait_procs(descendants, timeout=10)
    assert not alive, [(p.pid, p.name()) for p in alive]
