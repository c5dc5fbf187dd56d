"""Chaos and load harness of the verifier service: many clients, hostile inputs, workers SIGKILLed.

    python benchmarks/verifier_chaos.py                        # 8 clients x 2,000 items, kills every ~1 s
    python benchmarks/verifier_chaos.py --items 500 --no-write # a smaller run, print only

What runs: a fresh ``stapo verifier serve`` on a free loopback port (``--workers``, ``--deadline``);
``--clients`` threads, each with its own :class:`VerifierClient` (retries, 429 waits), send
``--items`` RL-shaped items each (``loadgen.build_stream``) in requests of ``--batch``, with a
``--hostile-frac`` share replaced by inputs built to hang or blow up a grader (power towers, a
factorial of 10^10, deep braces, regex bombs); a prober sends a 1-item request every 0.25 s (the
"small requests" whose latency is reported); a killer SIGKILLs a random grading worker every
``--kill-every`` seconds on average; a sampler records the RSS of the server and its workers.

Reported: items lost (sent minus answered; must be 0: a request that failed after all retries
counts its items as lost), answered-in-deadline share (ordinary items that came back graded, not
'timeout'/'error'), the statuses, small-request p50/p99 and their share under 2 deadlines, the
verdicts of a sample of ordinary items against in-process grading, and RSS over time.
Results go to the "## Verifier chaos" section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

import httpx
import psutil
from rich.console import Console
from rich.table import Table

from stapo.verifier_service.clients.client import VerifierClient, VerifierUnavailable
from stapo.verifier_service.clients.loadgen import build_stream
from stapo.verifier_service.grader import grade

sys.path.insert(0, str(Path(__file__).resolve().parent))
from verifier import machine, start_server  # noqa: E402  (the service harness: same machine line and launcher)

RESULTS = Path(__file__).with_name("RESULTS.md")
SECTION = "## Verifier chaos"

HOSTILE = [
    ("\\boxed{5^{5^{5^{5^5}}}}", "3"),
    ("\\boxed{(10^{10})!}", "3"),
    ("\\boxed{" + "{" * 10_000 + "1" + "}" * 10_000 + "}", "1"),
    ("the answer is " + "a " * 20_000 + "!", "1"),
    ("Answer:" + " (" * 20_000, "1"),
    ("\\boxed{9^{9^{9^{9^9}}}}", "2"),
    ("$" * 30_000, "1"),
    ("\\boxed{" * 3000, "1"),
]


def worker_pids(server_pid: int) -> list[int]:
    out = []
    for child in psutil.Process(server_pid).children():
        try:
            if "forkserver" in " ".join(child.cmdline()):
                out += [g.pid for g in child.children()]
        except psutil.Error:
            pass
    return out


def tree_rss_mb(server_pid: int) -> float:
    root = psutil.Process(server_pid)
    total = 0
    for p in [root, *root.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total / 2**20


def alive(pid: int, started: float) -> bool:
    """The same process (not a reused PID) still runs."""
    try:
        p = psutil.Process(pid)
        return p.create_time() == started and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--items", type=int, default=2000, help="items per client")
    ap.add_argument("--batch", type=int, default=50, help="items per request")
    ap.add_argument("--hostile-frac", type=float, default=0.005, help="share of items built to hang a grader")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--deadline", type=float, default=2.0)
    ap.add_argument("--kill-every", type=float, default=1.0, help="mean seconds between worker SIGKILLs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    rng = random.Random(args.seed)

    streams = []
    hostile_idx: list[set[int]] = []
    for c in range(args.clients):
        items = build_stream(args.items, seed=args.seed * 100 + c)
        bad = set(rng.sample(range(len(items)), int(round(args.hostile_frac * len(items)))))
        for i in bad:
            p, g = HOSTILE[rng.randrange(len(HOSTILE))]
            items[i] = (p + " " * rng.randrange(50), g, "math")  # distinct: no cache answers them
        streams.append(items)
        hostile_idx.append(bad)

    load_before = os.getloadavg()[0]
    proc, url = start_server(
        args.workers, env_extra={"STAPO_VERIFIER_DEADLINE_S": str(args.deadline), "STAPO_VERIFIER_LOG_LEVEL": "error"}
    )
    stop = threading.Event()
    results: list[list | None] = [None] * args.clients
    failures: list[str] = []
    busy = Counter()
    probes: list[float] = []
    probe_fail = 0
    rss: list[tuple[float, float]] = []
    seen: dict[int, float] = {}  # pid -> start time of every process of the service's tree seen
    kills = 0
    t_start = time.monotonic()

    def client(c: int) -> None:
        with VerifierClient(url, timeout_s=120, retries=8, batch_size=args.batch, concurrency=2) as vc:
            try:
                results[c] = vc.verify(streams[c])
            except VerifierUnavailable as err:
                failures.append(f"client {c}: {err}")
            busy["waits"] += vc.busy_waits
            busy["wait_s"] += vc.busy_wait_s

    def prober() -> None:
        nonlocal probe_fail
        k = 0
        with httpx.Client(base_url=url, timeout=60) as h:
            while not stop.is_set():
                k += 1
                t0 = time.monotonic()
                try:
                    r = h.post(
                        "/v1/verify", json={"items": [{"prediction": f"\\boxed{{{k}}}", "gold": str(k)}]}
                    )
                    if r.status_code == 200 and r.json()["results"][0]["correct"]:
                        probes.append(time.monotonic() - t0)
                    else:
                        probe_fail += 1
                except httpx.HTTPError:
                    probe_fail += 1
                stop.wait(0.25)

    def killer() -> None:
        nonlocal kills
        while not stop.wait(rng.expovariate(1.0 / args.kill_every)):
            pids = worker_pids(proc.pid)
            if pids:
                try:
                    os.kill(rng.choice(pids), signal.SIGKILL)
                    kills += 1
                except ProcessLookupError:
                    pass

    def sampler() -> None:
        while not stop.wait(1.0):
            try:
                rss.append((time.monotonic() - t_start, tree_rss_mb(proc.pid)))
                seen.update((p.pid, p.create_time()) for p in psutil.Process(proc.pid).children(recursive=True))
            except psutil.Error:
                pass

    aux = [threading.Thread(target=f, daemon=True) for f in (prober, killer, sampler)]
    clients = [threading.Thread(target=client, args=(c,)) for c in range(args.clients)]
    try:
        for t in aux + clients:
            t.start()
        for t in clients:
            t.join()
        wall = time.monotonic() - t_start
        stop.set()
        for t in aux:
            t.join(5)
        metrics = httpx.get(f"{url}/metrics").text
    finally:
        stop.set()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    end = time.monotonic() + 10.0  # the fork server's children die with it, within moments
    while (orphans := [p for p, t in seen.items() if alive(p, t)]) and time.monotonic() < end:
        time.sleep(0.2)

    sent = args.clients * args.items
    answered = sum(len(r) for r in results if r is not None)
    statuses: Counter[str] = Counter()
    ordinary = ordinary_ok = 0
    sample: list[tuple[tuple, object]] = []
    for c, res in enumerate(results):
        if res is None:
            continue
        for i, r in enumerate(res):
            statuses[r.status] += 1
            if i not in hostile_idx[c]:
                ordinary += 1
                ordinary_ok += r.status not in ("timeout", "error")
                if rng.random() < 200 / sent:
                    sample.append((streams[c][i], r))
    mismatch = sum(
        1
        for (p, g, m), r in sample
        if r.status not in ("timeout", "error") and grade(p, g, m).correct != r.correct
    )
    restarts = {
        k: int(float(v))
        for k, v in re.findall(r'worker_restarts_total\{reason="(\w+)"\} ([0-9.e+]+)', metrics)
    }
    small_in = sum(1 for x in probes if x <= 2 * args.deadline) / max(1, len(probes))
    rss_max = max((m for _, m in rss), default=float("nan"))
    rss_series = ", ".join(f"{t:.0f}s {m:.0f}" for t, m in rss[:: max(1, len(rss) // 12)])

    table = Table(
        title=f"verifier chaos: {args.clients} clients x {args.items} items, SIGKILL every ~{args.kill_every} s"
    )
    for col in ("measure", "value"):
        table.add_column(col)
    rows = [
        ("items sent / answered / lost", f"{sent} / {answered} / {sent - answered}"),
        ("failed client batches", str(len(failures))),
        ("ordinary items answered graded (not timeout/error)", f"{ordinary_ok / max(1, ordinary):.2%}"),
        ("statuses", ", ".join(f"{k} {v}" for k, v in sorted(statuses.items()))),
        ("sampled verdicts differing from in-process grading", f"{mismatch} / {len(sample)}"),
        ("small requests: p50 / p99 / <= 2 deadlines", f"{pct(probes, 50) * 1e3:.0f} ms / {pct(probes, 99) * 1e3:.0f} ms / {small_in:.1%} (failed: {probe_fail})"),
        ("workers SIGKILLed by the harness", str(kills)),
        ("worker restarts (server)", ", ".join(f"{k} {v}" for k, v in sorted(restarts.items()))),
        ("client 429 waits", f"{busy['waits']} ({busy['wait_s']:.1f} s)"),
        ("wall time / items per s", f"{wall:.1f} s / {sent / wall:.0f}"),
        ("processes of the service left 10 s after SIGTERM (seen during the run)", f"{len(orphans)} ({len(seen)})"),
        ("RSS of server + workers, MiB (max)", f"{rss_max:.0f}"),
        ("RSS over time (s MiB)", rss_series),
        ("load average before / after", f"{load_before:.1f} / {os.getloadavg()[0]:.1f}"),
    ]  # fmt: skip
    for k, v in rows:
        table.add_row(k, v)
    Console().print(table)
    for f in failures[:5]:
        print(f)
    if args.no_write:
        return
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    body = "\n".join(f"| {k} | {v} |" for k, v in rows)
    text = f"""{SECTION}

`python benchmarks/verifier_chaos.py --clients {args.clients} --items {args.items} --batch {args.batch} --hostile-frac {args.hostile_frac} --workers {args.workers} --deadline {args.deadline} --kill-every {args.kill_every}` ({when})

Machine: {machine()}, shared with other jobs (load in the last row). A fresh service with
{args.workers} workers and a {args.deadline} s deadline; {args.clients} concurrent `VerifierClient`s (retries, 429
waits) send RL-shaped streams with {args.hostile_frac:.1%} of items replaced by inputs built to hang a grader,
while a random worker is SIGKILLed every ~{args.kill_every} s and a prober sends a 1-item request every
0.25 s ("small requests"). "lost" = items sent without an answer (must be 0); "left after SIGTERM" =
processes of the service's tree (server, fork server, workers) still alive 10 s after it exited (must be 0).

| measure | value |
|---|---|
{body}
"""
    old = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    pattern = re.compile(rf"^{re.escape(SECTION)}\n.*?(?=^## |\Z)", re.S | re.M)
    text = text.rstrip() + "\n\n"
    new = pattern.sub(lambda _: text, old) if pattern.search(old) else old.rstrip() + "\n\n" + text
    RESULTS.write_text(new.rstrip() + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
