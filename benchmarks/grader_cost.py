"""Where the grader's time goes on an RL-shaped stream, this tree vs a git revision, alternating.

    python benchmarks/grader_cost.py --before 9cb5ac6            # 4096-item `math` stream, 3 rounds
    python benchmarks/grader_cost.py --before 9cb5ac6 --rounds 5 --items 2048 --style answer_line
    python benchmarks/grader_cost.py --before 13a7952 --seed 3                 # another stream

Each measurement is a fresh process (``python -c``) that runs the service's warm-up
(``verifier_service/server/warmup.py``: ANTLR's prediction tables, regexes) and grades another seed's
stream, empties the grader's
caches and grades the stream once in order with ``grade`` (cold caches, like one worker seeing the
stream for the first time), timing every item. Items are classed as the service sees them: no
answer marker (``extract`` under budget ``cheap`` finds none: cut off, math-verify's search runs), first sight of a
(gold, extracted answer) pair, repeat. ``before`` and ``after`` alternate (b, a, b, a, ...) so
load from other jobs on a shared machine falls on both; the table reports each round and the
median. Grading seconds per stream bound the service: with W workers and no other overhead it
cannot exceed W x items / seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from verifier import machine, unpack_revision  # noqa: E402

CHILD = r"""
import json, sys, time
from stapo.verifier_service import grader
from stapo.verifier_service.clients.loadgen import build_stream, load_golds
import stapo.verifier_service.server.warmup  # what the service's fork server runs before forking workers
n, style, seed = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
golds = load_golds(source=sys.argv[4])
for p, g, m in build_stream(1024, seed=7, style=style, golds=golds):
    grader.grade(p, g)
grader.cache_clear()
seen, out = set(), {"no_marker": [0, 0.0], "first": [0, 0.0], "repeat": [0, 0.0]}
for p, g, m in build_stream(n, seed=seed, style=style, golds=golds):
    t0 = time.perf_counter()
    r = grader.grade(p, g)
    dt = time.perf_counter() - t0
    if (a := grader.extract(p, budget="cheap")) is None or a.text is None:
        cls = "no_marker"
    else:
        cls = "first" if (g, r.extracted) not in seen else "repeat"
        seen.add((g, r.extracted))
    out[cls][0] += 1
    out[cls][1] += dt
print(json.dumps(out))
"""


def measure(
    pythonpath: Path | None, items: int, style: str, seed: int = 0, golds: str = "math500+gsm8k"
) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(items), style, str(seed), golds],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="git revision to compare with (e.g. 9cb5ac6)")
    ap.add_argument("--items", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--style", default="boxed", choices=["boxed", "answer_line"])
    ap.add_argument(
        "--seed", type=int, default=0, help="seed of the measured stream (the warm-up stream uses 7)"
    )
    ap.add_argument(
        "--golds",
        default=None,
        help="gold set (loadgen.GOLD_SOURCES); default as benchmarks/verifier.py's streams: dapo17k for "
        "answer_line, math500+gsm8k for boxed",
    )
    args = ap.parse_args()
    golds = args.golds or ("dapo17k" if args.style == "answer_line" else "math500+gsm8k")
    tree = unpack_revision(args.before)
    rows: dict[str, list[dict]] = {"before": [], "after": []}
    for _ in range(args.rounds):
        for name, path in (("before", tree), ("after", None)):
            rows[name].append(measure(path, args.items, args.style, args.seed, golds))
    print(f"machine: {machine()}; load average now {os.getloadavg()[0]:.1f}")
    print(
        f"stream: build_stream({args.items}, seed={args.seed}, style={args.style!r}, golds={golds}); "
        f"before = {args.before}"
    )
    print(
        "| variant | round | no marker s (n) | first sight s (n) | repeat s (n) | total s | items/s/process |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, runs in rows.items():
        for i, r in enumerate(runs, 1):
            tot = sum(v[1] for v in r.values())
            cells = " | ".join(f"{r[k][1]:.3f} ({r[k][0]})" for k in ("no_marker", "first", "repeat"))
            print(f"| {name} | {i} | {cells} | {tot:.3f} | {args.items / tot:.0f} |")
    for name, runs in rows.items():
        med = {k: statistics.median(r[k][1] for r in runs) for k in ("no_marker", "first", "repeat")}
        tot = statistics.median(sum(v[1] for v in r.values()) for r in runs)
        print(
            f"| {name} | median | {med['no_marker']:.3f} | {med['first']:.3f} | {med['repeat']:.3f} "
            f"| {tot:.3f} | {args.items / tot:.0f} |"
        )


if __name__ == "__main__":
    main()
