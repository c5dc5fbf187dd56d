"""`stapo verifier serve | bench | explain`: run the math-verification service, load-test one on loopback,
or grade one response and say which rule decided.

    stapo verifier serve --workers 2 --deadline 5            # 127.0.0.1:8000 unless told otherwise
    STAPO_VERIFIER_TOKEN=s3cret stapo verifier serve --host 0.0.0.0 --limit-concurrency 256
    stapo verifier serve --host 0.0.0.0 --allow-unauthenticated   # a private network, on purpose
    stapo verifier bench http://127.0.0.1:8000 --requests 40 --batch 64
    stapo verifier explain 10 "\\boxed{10\\pi square units}"       # extracted, verdict, rule

Every serve flag has a ``STAPO_VERIFIER_*`` environment twin (see
``stapo.verifier_service.server.settings``); a flag wins over the environment. Prefer the environment for
the token: ``--token`` shows in ``ps``. Serving a non-loopback address without a token is refused
unless ``--allow-unauthenticated`` is given.
"""

from __future__ import annotations

import errno
import ipaddress
from pathlib import Path
from typing import Annotated
from urllib.parse import urlparse

import typer

from stapo.cli.common import CLIError

app = typer.Typer(
    help="The math-verification service: serve it, or load-test it.\n\nExamples:\n\n\b\n"
    "  stapo verifier serve --workers 2 --deadline 5       # 127.0.0.1:8000\n"
    "  STAPO_VERIFIER_TOKEN=s3cret stapo verifier serve --host 0.0.0.0\n"
    "  stapo verifier bench http://127.0.0.1:8000 --requests 40 --batch 64",
    no_args_is_help=True,
)


def build_settings(**overrides: object):  # -> Settings (imported lazily: keeps `stapo --help` fast)
    """Settings from the environment, with the flags that were given on top; a bad value is a CLIError."""
    from pydantic import ValidationError

    from stapo.verifier_service.server.settings import Settings

    given = {k: v for k, v in overrides.items() if v is not None}
    try:
        return Settings(**given)
    except ValidationError as err:
        msgs = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'settings'}: {e['msg']}" for e in err.errors())
        raise CLIError(f"bad verifier setting: {msgs}") from err


@app.command("serve")
def serve(
    host: Annotated[
        str | None, typer.Option(help="Interface to bind [env STAPO_VERIFIER_HOST; default 127.0.0.1].")
    ] = None,
    port: Annotated[int | None, typer.Option(help="TCP port [STAPO_VERIFIER_PORT; default 8000].")] = None,
    workers: Annotated[
        int | None, typer.Option(help="Grading processes [STAPO_VERIFIER_WORKERS; default: one per core].")
    ] = None,
    deadline: Annotated[
        float | None,
        typer.Option(help="Hard per-item deadline in seconds [STAPO_VERIFIER_DEADLINE_S; default 5]."),
    ] = None,
    max_items: Annotated[
        int | None, typer.Option(help="Most items per request; more is answered 413 [STAPO_VERIFIER_MAX_ITEMS; default 4096].")
    ] = None,
    max_prediction_chars: Annotated[
        int | None,
        typer.Option(help="Longer predictions answer 'too_large' [STAPO_VERIFIER_MAX_PREDICTION_CHARS; default 100000 characters]."),
    ] = None,
    max_gold_chars: Annotated[
        int | None, typer.Option(help="Longer golds answer 'too_large' [STAPO_VERIFIER_MAX_GOLD_CHARS; default 10000 characters].")
    ] = None,
    max_body_bytes: Annotated[
        int | None, typer.Option(help="Largest request body, else 413 [STAPO_VERIFIER_MAX_BODY_BYTES; default 16777216 (16 MiB)].")
    ] = None,
    cache_size: Annotated[
        int | None, typer.Option(help="Result cache entries, 0 = off [STAPO_VERIFIER_CACHE_SIZE].")
    ] = None,
    log_level: Annotated[
        str | None, typer.Option(help="uvicorn log level [STAPO_VERIFIER_LOG_LEVEL].")
    ] = None,
    token: Annotated[
        str | None,
        typer.Option(
            help="Bearer token every route but the probes requires [STAPO_VERIFIER_TOKEN; prefer the "
            "environment: a flag shows in ps]."
        ),
    ] = None,
    allow_unauthenticated: Annotated[
        bool,
        typer.Option(
            "--allow-unauthenticated",
            help="Serve a non-loopback --host without a token (refused otherwise) "
            "[STAPO_VERIFIER_ALLOW_UNAUTHENTICATED].",
        ),
    ] = False,
    limit_concurrency: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Most concurrent connections before uvicorn answers 503 [STAPO_VERIFIER_LIMIT_CONCURRENCY; "
            "default: no limit].",
        ),
    ] = None,
    max_queue_s: Annotated[
        float | None,
        typer.Option(
            help="Queued grading work (estimated seconds) past which requests get 429 + Retry-After "
            "[STAPO_VERIFIER_MAX_QUEUE_S; default 60].",
        ),
    ] = None,
    access_log: Annotated[
        bool, typer.Option(help="Log every request (off: high request rates); ?token= is redacted.")
    ] = False,
) -> None:
    """Serve POST /v1/verify, POST /get_reward, /healthz, /readyz, /metrics and /docs with uvicorn."""
    settings = build_settings(
        host=host,
        port=port,
        workers=workers,
        deadline_s=deadline,
        max_items=max_items,
        max_prediction_chars=max_prediction_chars,
        max_gold_chars=max_gold_chars,
        max_body_bytes=max_body_bytes,
        cache_size=cache_size,
        log_level=log_level,
        token=token,
        allow_unauthenticated=allow_unauthenticated or None,
        limit_concurrency=limit_concurrency,
        max_queue_s=max_queue_s,
    )
    check_exposure(settings)
    check_port(settings.host, settings.port)  # before the grading pool starts
    import sys

    import uvicorn

    sys.setswitchinterval(settings.switch_interval_ms / 1000.0)

    from stapo.verifier_service.server.app import create_app
    from stapo.verifier_service.server.middleware import redact_access_log

    redact_access_log()
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=access_log,
        limit_concurrency=settings.limit_concurrency,
        timeout_graceful_shutdown=int(settings.graceful_shutdown_s) or None,
    )


def check_exposure(settings) -> None:
    """Refuse a non-loopback address without a token unless the user said so (secure by default)."""
    if _is_loopback(settings.host) or settings.token is not None:
        return
    if not settings.allow_unauthenticated:
        raise CLIError(
            f"--host {settings.host} is not loopback and no token is set: anyone who can reach the port could "
            "use the service. Set STAPO_VERIFIER_TOKEN (or --token), or pass --allow-unauthenticated if the "
            "network is private on purpose."
        )
    from rich.console import Console

    Console(stderr=True).print(
        f"[yellow]warning:[/] serving {settings.host} without a token (--allow-unauthenticated): anyone who "
        "can reach the port can use the service."
    )


def check_port(host: str, port: int) -> None:
    """Bind ``host:port`` once and let go, as uvicorn will (``SO_REUSEADDR``): a port another process
    listens on, a privileged port or an address not on this machine is one line naming the fix."""
    import socket

    if port == 0:
        return  # any free port
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as err:
            why = "another process listens there" if err.errno == errno.EADDRINUSE else err.strerror
            raise CLIError(
                f"cannot serve on {host}:{port} ({why}); pick another --port (STAPO_VERIFIER_PORT), or stop "
                "what holds it"
            ) from None


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@app.command("bench")
def bench(
    url: Annotated[str, typer.Argument(help="A running service on loopback, e.g. http://127.0.0.1:8000")],
    requests: Annotated[int, typer.Option(min=1, max=10_000, help="Requests to send (a bounded load).")] = 32,
    batch: Annotated[int, typer.Option(min=1, max=4096, help="Items per request (8 answers per gold).")] = 64,
    concurrency: Annotated[int, typer.Option(min=1, max=64, help="Requests in flight at once.")] = 4,
    baseline: Annotated[
        bool, typer.Option(help="Also grade the same items with plain math-verify in this process.")
    ] = True,
    data: Annotated[
        Path | None, typer.Option(help="Folder with math500.jsonl / gsm8k_test.jsonl for golds.")
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of the generated stream.")] = 0,
) -> None:
    """Send an RL-shaped stream (groups of 8 answers per gold) and print throughput and p50/p99 latency."""
    import os

    from rich.console import Console
    from rich.table import Table

    from stapo.verifier_service.clients.loadgen import (
        build_stream,
        load_golds,
        run_baseline,
        run_service_load,
    )

    host = urlparse(url).hostname or ""
    if urlparse(url).scheme not in ("http", "https") or not _is_loopback(host):
        raise CLIError(
            f"URL: the bench only targets a service on loopback (http://127.0.0.1:PORT), got {url!r}"
        )
    if data is not None and not (data / "math500.jsonl").is_file():
        raise CLIError(f"--data: {data} has no math500.jsonl")
    golds = load_golds(data)
    items = build_stream(requests * batch, golds=golds, seed=seed)
    console = Console()
    console.print(f"{len(items)} items in {requests} requests of {batch}, {concurrency} in flight -> {url}")
    svc = run_service_load(
        url, items, batch=batch, concurrency=concurrency, token=os.environ.get("STAPO_VERIFIER_TOKEN")
    )
    if svc.errors == requests:
        raise CLIError(f"every request to {url} failed: is the service running (stapo verifier serve)?")
    table = Table(title="stapo verifier bench")
    for col in ("run", "items", "seconds", "items/s", "p50 ms", "p99 ms", "errors"):
        table.add_column(col, justify="right" if col != "run" else "left")
    table.add_row(
        "service (per request)", str(svc.items), f"{svc.seconds:.2f}", f"{svc.items_per_s:.0f}",
        f"{svc.pct(50) * 1e3:.1f}", f"{svc.pct(99) * 1e3:.1f}", str(svc.errors),
    )  # fmt: skip
    if baseline:
        base = run_baseline(items)
        table.add_row(
            "math-verify, 1 process (per item)", str(base.items), f"{base.seconds:.2f}", f"{base.items_per_s:.0f}",
            f"{base.pct(50) * 1e3:.2f}", f"{base.pct(99) * 1e3:.2f}", "0",
        )  # fmt: skip
        console.print(table)
        console.print(f"service / math-verify throughput: [bold]{svc.items_per_s / base.items_per_s:.1f}x[/]")
    else:
        console.print(table)
    console.print(f"statuses: {dict(sorted(svc.statuses.items()))}")


@app.command("explain")
def explain(
    gold: Annotated[str, typer.Argument(help="The gold answer, as in the data set (e.g. '\\frac{1}{2}').")],
    response: Annotated[str, typer.Argument(help="The model's full response text.")],
    mode: Annotated[str, typer.Option(help="Grading mode: math or dapo.")] = "math",
    think: Annotated[str, typer.Option(help="Reasoning cut: optional, required or ignore.")] = "optional",
) -> None:
    """Grade one response and say why: the extracted answer, the verdict and the rule that decided."""
    from stapo.verifier_service.grader import grade

    try:
        res = grade(response, gold, mode, think=think)
    except ValueError as err:
        raise CLIError(str(err)) from err
    typer.echo(f"extracted: {res.extracted if res.extracted is not None else '(none)'}")
    verdict = "correct" if res.correct else "wrong" if res.status in ("ok", "no_answer") else "none"
    typer.echo(f"verdict:   {verdict} (status {res.status})")  # undecided, timeout, error: no verdict
    typer.echo(f"rule:      {res.rule or '(none)'}")
