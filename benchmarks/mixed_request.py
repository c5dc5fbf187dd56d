"""One request that mixes pathological items with ordinary ones, sent without ``budget_s``.

    python benchmarks/mixed_request.py                          # 2 workers, 5 s deadline, 40 + 20 items
    python benchmarks/mixed_request.py --workers 4 --pathological 80

What runs: a fresh ``stapo verifier serve`` on a free loopback port; one ``/v1/verify`` request of
``--pathological`` items built to hold a worker for a whole deadline (power towers, factorials,
huge floats, nested and left-nested exponents, Gamma and binomials of huge numbers, and shapes the
pool's ``looks_costly`` does not know: the sine of a huge power, nested exponentials), each with a
gold of its own, shuffled with ``--ordinary`` right answers that need a real sympy comparison.
Reported: the request's wall time against the default budget (``default_budget_factor`` x the
deadline), how many ordinary items came back graded right, the statuses of the pathological ones,
and the pool's ``sliced_items`` (items that outran their first slice).
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import subprocess
import sys
import time
from collections import Counter

import httpx

SHAPES = (
    lambda k: f"\\boxed{{{k + 3}^{{{k + 3}^{{{k + 3}^{{{k + 3}}}}}}}}}",  # power tower
    lambda k: f"\\boxed{{({10**8 + k})!}}",  # factorial
    lambda k: f"\\boxed{{{k + 2}.5 \\times 10^{{{123_456_789 + k}}}}}",  # huge float
    lambda k: f"the answer is $\\boxed{{{k + 1}.25e{98_765_432 + k}}}$",  # huge float, e-notation
    lambda k: f"\\boxed{{e^{{e^{{e^{{{k + 20}}}}}}}}}",  # nested exponents
    lambda k: f"\\boxed{{((({k + 11}^{k + 11})^{k + 11})^{k + 11})^{k + 11}}}",  # left-nested powers
    lambda k: f"\\boxed{{\\Gamma(10^{{{10 + k % 3}}})}}",
    lambda k: f"\\boxed{{\\binom{{10^{{10}}}}{{{k + 5} \\cdot 10^{{8}}}}}}",
    lambda k: f"\\boxed{{\\sin(10^{{{88_000 + k}}})}}",  # not a shape looks_costly knows
    lambda k: f"\\boxed{{\\exp(\\exp(\\exp(\\exp({12 + k}))))}}",  # not a shape looks_costly knows
)


def pathological(n: int) -> list[dict]:
    return [{"prediction": SHAPES[k % len(SHAPES)](k), "gold": str(600_000 + k)} for k in range(n)]


def ordinary(n: int, start: int) -> list[dict]:
    """Right answers in another form than the gold: a real sympy comparison each."""
    return [
        {
            "prediction": f"so \\boxed{{\\frac{{{k}\\sqrt{{3}}}}{{{k + 2}}}}}",
            "gold": f"\\frac{{\\sqrt{{{3 * k * k}}}}}{{{k + 2}}}",
        }
        for k in range(start, start + n)
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--deadline", type=float, default=5.0)
    ap.add_argument("--pathological", type=int, default=40)
    ap.add_argument("--ordinary", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    from stapo.verifier_service.server.scheduler import looks_costly
    from stapo.verifier_service.server.settings import Settings

    port = free_port()
    env = dict(
        os.environ, STAPO_VERIFIER_WORKERS=str(args.workers), STAPO_VERIFIER_DEADLINE_S=str(args.deadline)
    )
    env.pop("STAPO_VERIFIER_TOKEN", None)
    cmd = [sys.executable, "-m", "stapo.cli.main", "verifier", "serve", "--port", str(port)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        end = time.monotonic() + 120
        while time.monotonic() < end:
            try:
                if httpx.get(f"{url}/readyz", timeout=2).json().get("workers_ready") == args.workers:
                    break
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.2)
        bad, good = pathological(args.pathological), ordinary(args.ordinary, 1000 + args.seed * 100)
        items = bad + good
        order = list(range(len(items)))
        random.Random(args.seed).shuffle(order)
        t0 = time.monotonic()
        r = httpx.post(f"{url}/v1/verify", json={"items": [items[i] for i in order]}, timeout=600)
        wall = time.monotonic() - t0
        r.raise_for_status()
        got = dict(zip(order, r.json()["results"], strict=True))
        nb = len(bad)
        right = sum(got[i]["status"] == "ok" and got[i]["correct"] for i in range(nb, len(items)))
        statuses = Counter(got[i]["status"] for i in range(nb))
        sliced = [
            ln.split()[-1]
            for ln in httpx.get(f"{url}/metrics").text.splitlines()
            if 'event="sliced_items"' in ln and not ln.startswith("#")
        ]
        budget = Settings().default_budget_factor * args.deadline
        unknown = sum(not looks_costly(x["prediction"]) for x in bad)
        print(
            f"| workers / deadline / default budget | {args.workers} / {args.deadline:g} s / {budget:g} s |"
        )
        print(
            f"| pathological (of which looks_costly does not know) / ordinary | {nb} ({unknown}) / {len(good)} |"
        )
        print(f"| wall time of the request | {wall:.1f} s |")
        print(f"| ordinary items graded right | {right} / {len(good)} |")
        print(f"| pathological statuses | {', '.join(f'{k} {v}' for k, v in sorted(statuses.items()))} |")
        print(f"| items that outran their first slice | {sliced[0] if sliced else '?'} |")
        print(f"| load average after | {os.getloadavg()[0]:.1f} |")
    finally:
        proc.terminate()
        proc.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
