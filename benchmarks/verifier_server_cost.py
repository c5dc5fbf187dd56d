"""CPU of the verification server's own process per item, this tree vs a git revision.

The service answers most items of an RL stream in its own process (caches, in-process verdicts),
so that process's CPU is a main limit of its throughput. For each round, each stream style and
each variant, a fresh server (``benchmarks/verifier.py``'s ``start_server``) gets the stream
three times: ``cold`` (first sight), then ``cached`` and ``cached2`` (every item answered from the
result cache). Per pass: items/s (wall), the server process's CPU per item (all its threads,
from /proc/<pid>/task/*/schedstat: ns resolution, where psutil's ticks are 10 ms = 2.4 us/item
at 4096 items) and the workers' CPU. Variants alternate within each round; medians are printed.

The client is a lean raw-socket HTTP/1.1 client (keep-alive, 4 connections, bodies encoded
before the clock starts), so that its own cost on a small machine stays small (~0.015 s per
4096 items).

Usage::

    python benchmarks/verifier_server_cost.py --before 13a7952 --rounds 4 --styles answer_line,boxed
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from verifier import start_server, unpack_revision  # noqa: E402

from stapo.verifier_service.clients.loadgen import build_stream, load_golds  # noqa: E402


async def raw_load(port: int, bodies: list[bytes], concurrency: int) -> list[list[dict]]:
    """POST every body to /v1/verify over ``concurrency`` keep-alive connections; results in order."""
    out: list = [None] * len(bodies)
    todo = list(range(len(bodies)))[::-1]

    async def conn() -> None:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        while todo:
            i = todo.pop()
            b = bodies[i]
            w.write(
                b"POST /v1/verify HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n" % len(b) + b
            )
            head = await r.readuntil(b"\r\n\r\n")
            n = next(
                int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:")
            )
            out[i] = json.loads(await r.readexactly(n))["results"]
        w.close()

    await asyncio.gather(*(conn() for _ in range(concurrency)))
    return out


def cpu_s(pid: int) -> float:
    """CPU seconds of every thread of a process (0 once it is gone)."""
    total = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0
    for t in tasks:
        try:
            with open(f"/proc/{pid}/task/{t}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError):
            pass
    return total / 1e9


def main() -> None:
    import psutil

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--before", required=True, help="git revision to compare with (unpacked like verifier.py --before)"
    )
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument(
        "--styles", default="answer_line,boxed", help="loadgen stream styles (answer_line = dapo-style)"
    )
    ap.add_argument("--items", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=4)
    args = ap.parse_args()
    trees = {"before": unpack_revision(args.before), "after": None}
    bodies = {}
    for style in args.styles.split(","):
        src = "dapo17k" if style == "answer_line" else "math500+gsm8k"
        items = build_stream(args.items, seed=0, style=style, golds=load_golds(source=src))
        bodies[style] = [
            json.dumps(
                {"items": [{"prediction": p, "gold": g, "mode": m} for p, g, m in items[i : i + args.batch]]}
            ).encode()
            for i in range(0, len(items), args.batch)
        ]
    rows: dict[tuple[str, str, str], list[tuple[float, float, float]]] = {}
    answers: dict[tuple[str, str], list] = {}
    for rnd in range(args.rounds):
        for style, bs in bodies.items():
            for name, tree in trees.items():
                proc, url = start_server(None, pythonpath=tree)
                try:
                    port = int(url.rsplit(":", 1)[1])
                    kids = [k.pid for k in psutil.Process(proc.pid).children(recursive=True)]
                    for pas in ("cold", "cached", "cached2"):
                        kb = {k: cpu_s(k) for k in kids}
                        pb = cpu_s(proc.pid)
                        t0 = time.perf_counter()
                        out = asyncio.run(raw_load(port, bs, args.concurrency))
                        dt = time.perf_counter() - t0
                        row = (args.items / dt, (cpu_s(proc.pid) - pb) / args.items * 1e6,
                               sum(max(0.0, cpu_s(k) - kb[k]) for k in kids))  # fmt: skip
                        rows.setdefault((style, pas, name), []).append(row)
                        verdicts = [(r["status"], r["correct"], r["extracted"]) for b in out for r in b]
                        answers.setdefault((style, name), verdicts)
                        print(f"round {rnd} {style:11s} {pas:7s} {name:6s} {row[0]:7.0f} items/s  "
                              f"server {row[1]:5.1f} us/item  workers {row[2]:.3f} s  load {os.getloadavg()[0]:.2f}",
                              flush=True)  # fmt: skip
                finally:
                    proc.terminate()
                    proc.wait()
    print("\n| stream | pass | variant | items/s | server CPU us/item | workers CPU s |")
    print("|---|---|---|---:|---:|---:|")
    for (style, pas, name), rs in rows.items():
        med = [statistics.median(r[k] for r in rs) for k in range(3)]
        print(f"| {style} | {pas} | {name} | {med[0]:.0f} | {med[1]:.1f} | {med[2]:.3f} |")
    for style in bodies:
        same = answers[(style, "before")] == answers[(style, "after")]
        print(f"{style}: every item's (status, correct, extracted) equal in both trees: {same}")


if __name__ == "__main__":
    main()
