"""Verifier service vs plain math-verify on RL-shaped streams; writes benchmarks/RESULTS.md.

    python benchmarks/verifier.py                     # 3 streams x 4096 items, 64 per request, 4 in flight
    python benchmarks/verifier.py --repeat 3          # the whole thing 3 times, every run reported
    python benchmarks/verifier.py --items 1024 --streams math  # quicker
    python benchmarks/verifier.py --before 8887d46    # also the service as of that commit, same run

What runs, per stream: a fresh ``stapo verifier serve`` on a free loopback port (one worker per
core, cold caches), the stream of ``stapo.verifier_service.clients.loadgen.build_stream`` sent over HTTP,
the same items once more (all result-cache hits: the HTTP + pool ceiling), then the same items
through ``math_verify.verify(parse(gold), parse(prediction))`` one by one in this process. Both
numbers come from the same run on the same machine and are reported as a ratio; the load average
is recorded because other work on a small machine moves them.

Variants of the service, each started fresh on the same stream in the same run: ``after`` (this
tree), ``no-inline`` (this tree without inline verdicts: every first-seen answer goes to a worker),
``switch-5ms`` (this tree with Python's default GIL switch interval instead of the service's 0.5 ms),
``no-verdict`` (this tree with the verdict cache off: what the fairness/cancellation/admission
machinery costs by itself), ``after+httpx`` (this tree, measured with the httpx client instead of
the lean one) and, with ``--before REV``, ``before`` (the service of that git revision, unpacked with
``git archive`` into a temporary folder that goes first on PYTHONPATH).

The client (``--client``, default ``raw``: ``loadgen.CLIENTS``) runs on the same cores as the
service. A trainer runs it on its own machine; here its CPU is taken from the service, so the
default is a lean keep-alive HTTP/1.1 client over asyncio streams (~0.2 ms of CPU per 64-item
request) rather than httpx (~1.5 ms): ``after+httpx`` shows what the heavier client costs.

Streams (``STREAMS``): ``math`` MATH-500 + GSM8K golds, ``\\boxed{}`` endings, prompts revisited;
``math-fresh`` the same golds, every group a new prompt; ``dapo`` DAPO-Math-17k golds (all integers,
what STAPO trains on) with the DAPO template's ``Answer:`` line.
"""

from __future__ import annotations

import argparse
import atexit
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from stapo.verifier_service.clients.loadgen import (
    CLIENTS,
    build_stream,
    load_golds,
    run_baseline,
    run_service_load,
    stream_stats,
)

RESULTS = Path(__file__).with_name("RESULTS.md")
SECTION = "## Verifier service"
STREAMS: dict[str, dict] = {
    "math": {"source": "math500+gsm8k", "style": "boxed", "revisit": True},
    "math-fresh": {"source": "math500+gsm8k", "style": "boxed", "revisit": False},
    "dapo": {"source": "dapo17k", "style": "answer_line", "revisit": True},
}


def machine() -> str:
    cpu = "unknown CPU"
    try:
        m = re.search(r"model name\s*:\s*(.+)", Path("/proc/cpuinfo").read_text())
        cpu = m.group(1).strip() if m else cpu
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (
        f"{cores} cores ({cpu}), {platform.system()} {platform.release()}, Python {platform.python_version()}"
    )


def unpack_revision(rev: str) -> Path:
    """``git archive REV`` laid out as an importable ``stapo`` package (pyproject's package-dir)."""
    root = Path(__file__).resolve().parent.parent
    dest = Path(tempfile.mkdtemp(prefix="stapo-before-"))
    atexit.register(shutil.rmtree, dest, True)  # removed when the harness exits
    src = dest / "src"
    src.mkdir()
    tar = subprocess.run(["git", "-C", str(root), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=tar, check=True)
    pkg = dest / "stapo"
    shutil.copytree(src / "stapo_pkg", pkg)
    for sub in ("cli", "core", "evals", "verifier_service", "configs"):
        shutil.copytree(src / sub, pkg / sub)
    return dest


def start_server(
    workers: int | None, *, pythonpath: Path | None = None, env_extra: dict[str, str] | None = None
) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # A private loopback service: no token (the harness's clients send none), quiet unless overridden.
    env = {**os.environ, "STAPO_VERIFIER_LOG_LEVEL": "warning", **(env_extra or {})}
    env.pop("STAPO_VERIFIER_TOKEN", None)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    cmd = [sys.executable, "-m", "stapo.cli.main", "verifier", "serve", "--port", str(port)]
    if workers:
        cmd += ["--workers", str(workers)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    end = time.monotonic() + 120
    while time.monotonic() < end:
        try:
            body = httpx.get(f"{url}/readyz", timeout=2).json()
            if body.get("workers_ready") == body.get("workers"):
                return proc, url
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("the service did not become ready in 120 s")


def write_section(text: str) -> None:
    """Replace (or append) only the '## Verifier service' section of RESULTS.md."""
    old = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    pattern = re.compile(rf"^{re.escape(SECTION)}\n.*?(?=^## |\Z)", re.S | re.M)
    text = text.rstrip() + "\n\n"
    new = pattern.sub(lambda _: text, old) if pattern.search(old) else old.rstrip() + "\n\n" + text
    RESULTS.write_text(new.rstrip() + "\n")


VARIANT_ENV: dict[str, dict[str, str]] = {
    "no-verdict": {"STAPO_VERIFIER_VERDICT_CACHE": "false"},
    "no-inline": {"STAPO_VERIFIER_INLINE_VERDICTS": "false"},
    "switch-5ms": {"STAPO_VERIFIER_SWITCH_INTERVAL_MS": "5"},
}
"""Environment of a service variant (``before`` and ``after`` run as shipped)."""


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def run_variant(items: list, args: argparse.Namespace, variant: str) -> dict:
    """One fresh service (cold caches) of one variant: the stream, then the same items again."""
    env = VARIANT_ENV.get(variant, {})
    pythonpath = args.before_tree if variant == "before" else None
    client = "httpx" if variant.endswith("+httpx") else args.client
    proc, url = start_server(args.workers, pythonpath=pythonpath, env_extra=env)
    try:
        load = {"batch": args.batch, "concurrency": args.concurrency, "client": client}
        svc = run_service_load(url, items, **load)
        # Same items again: every one is a result-cache hit, so this is the ceiling of HTTP + pool.
        again = run_service_load(url, items, **load)
        workers = httpx.get(f"{url}/readyz").json()["workers"]
        text = httpx.get(f"{url}/metrics").text
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    sent = _metric(text, "stapo_verifier_cache_misses_total") - len(items)  # the second pass sends none
    return {
        "svc": svc, "again": again, "workers": workers,
        "to_workers": (_metric(text, "stapo_verifier_cache_misses_total") or sent) / max(1, len(items)),
        "verdict_hits": _metric(text, 'stapo_verifier_pool_events_total{event="verdict_hits"}') / max(1, len(items)),
        # share of the workers' wall time spent grading (the rest: waiting on the parent, IPC)
        "busy": svc.grade_ms / 1000 / max(1e-9, svc.seconds * workers),
    }  # fmt: skip


def run_stream(name: str, args: argparse.Namespace) -> dict:
    """One stream: every service variant fresh (cold caches), then plain math-verify on the items."""
    spec = STREAMS[name]
    items = build_stream(
        args.items, seed=args.seed, golds=load_golds(source=spec["source"]), style=spec["style"],
        revisit=spec["revisit"],
    )  # fmt: skip
    load_before = os.getloadavg()[0]
    variants = {v: run_variant(items, args, v) for v in args.variants}
    after = variants[args.variants[-1]]
    svc, again, workers = after["svc"], after["again"], after["workers"]
    # math-verify warms up too (regexes, ANTLR's prediction tables), as the service's fork server did;
    # on the stream's own first items, which can only favour the baseline.
    run_baseline(items[:256])
    base = run_baseline(items)
    agree = sum(a == b for a, b in zip(svc.correct, base.correct, strict=False)) / max(1, len(base.correct))
    return {
        "stream": name, "stats": stream_stats(items), "svc": svc, "again": again, "base": base,
        "ratio": svc.items_per_s / base.items_per_s, "agree": agree, "workers": workers,
        "load": (load_before, os.getloadavg()[0]), "variants": variants,
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--items", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=64, help="items per request")
    ap.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    ap.add_argument("--workers", type=int, default=None, help="service workers (default: one per core)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--streams", default=",".join(STREAMS), help=f"comma list of {', '.join(STREAMS)}")
    ap.add_argument(
        "--repeat", type=int, default=1, help="run everything this many times; all runs are reported"
    )
    ap.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    ap.add_argument(
        "--client", default="raw", choices=CLIENTS, help="how the load is sent (see the module doc)"
    )
    ap.add_argument(
        "--variants",
        default="no-verdict,no-inline,after+httpx,after",
        help="comma list of service variants (before is added by --before); the last one is the headline",
    )
    ap.add_argument(
        "--before",
        default=None,
        help="git revision whose service is measured too, in the same run (e.g. 8887d46)",
    )
    args = ap.parse_args()
    args.before_tree = unpack_revision(args.before) if args.before else None
    args.variants = (["before"] if args.before else []) + [
        v.strip() for v in args.variants.split(",") if v.strip()
    ]
    unknown = [v for v in args.variants if v not in ("before", "after", "after+httpx", *VARIANT_ENV)]
    if unknown:
        raise SystemExit(
            f"--variants: unknown {unknown}; valid: after, after+httpx, {', '.join(VARIANT_ENV)}"
        )
    names = [x.strip() for x in args.streams.split(",") if x.strip()]
    bad = [x for x in names if x not in STREAMS]
    if bad:
        raise SystemExit(f"--streams: unknown {bad}; valid: {', '.join(STREAMS)}")

    runs = [run_stream(name, args) | {"run": k + 1} for k in range(args.repeat) for name in names]
    console = Console()
    table = Table(title=f"{args.items} RL-shaped items per stream")
    cols = ("run", "stream", "service", "items/s", "p50 ms", "p99 ms", "cached/s", "to workers", "busy",
            "math-verify/s", "ratio", "load")  # fmt: skip
    for col in cols:
        table.add_column(col, justify="left" if col in ("run", "stream", "service") else "right")
    lines = []
    for r in runs:
        base = r["base"]
        for v, res in r["variants"].items():
            svc, again = res["svc"], res["again"]
            cells = (
                str(r["run"]), r["stream"], v, f"{svc.items_per_s:.0f}", f"{svc.pct(50) * 1e3:.1f}",
                f"{svc.pct(99) * 1e3:.1f}", f"{again.items_per_s:.0f}", f"{res['to_workers']:.0%}",
                f"{res['busy']:.0%}", f"{base.items_per_s:.0f}", f"{svc.items_per_s / base.items_per_s:.1f}x",
                f"{r['load'][0]:.1f}/{r['load'][1]:.1f}",
            )  # fmt: skip
            table.add_row(*cells)
            lines.append("| " + " | ".join(c if k != 10 else f"**{c}**" for k, c in enumerate(cells)) + " |")
    console.print(table)
    if args.no_write:
        return

    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    rows = "\n".join(lines)
    first = {r["stream"]: r for r in runs if r["run"] == 1}
    stats_rows = "\n".join(
        f"| {name} | {STREAMS[name]['source']} | {STREAMS[name]['style']} | {'yes' if STREAMS[name]['revisit'] else 'no'} | "
        f"{st['distinct_golds']} | {st['distinct_per_group']:.2f} | {st['answer_repeat']:.0%} | {st['response_repeat']:.0%} | "
        f"{st['integer_golds']:.0%} | {st['latex_golds']:.0%} | {st['no_marker']:.1%} | {st['mean_chars']:.0f} |"
        for name, st in ((n, r["stats"]) for n, r in first.items())
    )

    def ratios(v: str) -> str:
        xs = [r["variants"][v]["svc"].items_per_s / r["base"].items_per_s for r in runs if v in r["variants"]]
        return f"{min(xs):.1f}x to {max(xs):.1f}x" if xs else "n/a"

    workers = runs[0]["workers"]
    before = f" --before {args.before}" if args.before else ""
    write_section(
        f"""{SECTION}

`python benchmarks/verifier.py --items {args.items} --batch {args.batch} --concurrency {args.concurrency} --streams {args.streams} --repeat {args.repeat} --client {args.client} --variants {",".join(v for v in args.variants if v != "before")}{before}` ({when})

Machine: {machine()}; **shared with other jobs** (load average before / after each stream in the
last column: compare only rows of the same stream and run, which ran minutes apart). Each service
variant was started fresh for each stream (cold caches, {workers} workers); the client (`{args.client}`,
see the harness's docstring) ran on the same machine (it encodes the request bodies before the clock
starts, as a trainer would on its own machine). Service latency is per request ({args.batch} items). Before its timed run, math-verify grades
the stream's first 256 items once (its warm-up; the service's workers are warmed in the fork server).

Variants: `before` = the service at `{args.before or "-"}`;
`no-verdict` = this tree with `STAPO_VERIFIER_VERDICT_CACHE=false` (fair queueing, cancellation,
admission, recycling: the machinery alone); `no-inline` = this tree with
`STAPO_VERIFIER_INLINE_VERDICTS=false` (verdicts reused by (mode, gold, extracted answer), but every
first-seen answer graded by a worker); `after` = this tree as shipped (also short string/number
verdicts decided in the server process); `after+httpx` = the same service measured with the httpx
client. "to workers": share of items that reached a grading worker. "busy": grading time reported
(workers, and the server process for inline verdicts) / (wall time x workers).

| run | stream | service | items/s | p50 ms | p99 ms | cached items/s | to workers | busy | math-verify items/s | ratio | load |
|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|
{rows}

Throughput ratio service / math-verify over {len(runs)} stream runs: `{args.variants[-1]}` **{ratios(args.variants[-1])}**;
{"; ".join(f"`{v}` {ratios(v)}" for v in args.variants[:-1])}.

The streams (`loadgen.build_stream`, `loadgen.stream_stats`, seed {args.seed}): groups of 8 responses per
gold; a group draws from a few final answers (the gold, an equivalent form, two near misses: one
digit changed), each wrapped in reasoning text that differs per response; ~4% are cut off before
any answer. "answer repeat" counts items whose (gold, final answer) pair came earlier in the
stream; no whole response repeats.

| stream | golds | ending | prompts revisited | distinct golds | answers per group | answer repeat | response repeat | integer golds | LaTeX golds | no marker | mean chars |
|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|
{stats_rows}
"""
    )
    console.print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
