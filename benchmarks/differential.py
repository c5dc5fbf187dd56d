"""Differential harness: stapo's grader and plain math-verify on pairs built from the shipped golds.

The pairs come from ``benchmarks/differential_gen.py`` (equivalent rewrites and near misses of the
answer keys in ``evals/data``, labelled by construction, written without reading the grader). Both
graders see the same pairs in the same run:

- ``stapo``: ``grade(response, gold).correct`` (mode ``math``);
- ``math-verify``: ``verify(parse(gold), parse(response))``, math-verify's defaults (the way open-r1
  / TRL reward functions call it; timeouts off because they rely on ``signal.alarm``).

Per family: accuracy, false positives (a wrong answer rewarded: the error RL learns from) and false
negatives (a right answer unrewarded).

    python benchmarks/differential.py                      # dev split, seed 0
    python benchmarks/differential.py --split heldback     # the held-back split (seed 1000)
    python benchmarks/differential.py --show fp            # list stapo's false positives
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from differential_gen import HELDBACK_SEED, Pair, generate  # noqa: E402


def math_verify_says(response: str, gold: str) -> bool:
    from math_verify import parse, verify

    try:
        return bool(
            verify(parse(gold, parsing_timeout=None), parse(response, parsing_timeout=None), timeout_seconds=None)
        )
    except Exception:  # noqa: BLE001 - a crash is no reward, as in a reward function
        return False


def stapo_says(response: str, gold: str) -> bool:
    from stapo.verifier_service.grader import grade

    return grade(response, gold).correct


GRADERS = {"stapo": stapo_says, "math-verify": math_verify_says}


def run(pairs: list[Pair]) -> dict[str, dict[str, list[int]]]:
    """-> {family: {grader: [n, right, fp, fn]}} (family "all" too)."""
    out: dict[str, dict[str, list[int]]] = defaultdict(lambda: {g: [0, 0, 0, 0] for g in GRADERS})
    for p in pairs:
        for name, fn in GRADERS.items():
            got = fn(p.response, p.gold)
            for fam in (p.family, "all"):
                t = out[fam][name]
                t[0] += 1
                t[1] += got == p.expected
                t[2] += got and not p.expected
                t[3] += (not got) and p.expected
    return out


def render(res: dict[str, dict[str, list[int]]], pairs: list[Pair], title: str) -> str:
    neg = sum(not p.expected for p in pairs)
    lines = [
        f"**{title}** ({len(pairs)} pairs, {neg} near misses)",
        "",
        "| family | pairs | stapo acc | stapo FP | stapo FN | math-verify acc | math-verify FP | math-verify FN |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for fam in [f for f in res if f != "all"] + ["all"]:
        a, b = res[fam]["stapo"], res[fam]["math-verify"]
        lines.append(
            f"| {fam} | {a[0]} | {a[1] / a[0]:.1%} | {a[2]} | {a[3]} | {b[1] / b[0]:.1%} | {b[2]} | {b[3]} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--split", choices=("dev", "heldback"), default="dev")
    ap.add_argument("--seed", type=int, default=None, help=f"default 0 (dev) / {HELDBACK_SEED} (heldback)")
    ap.add_argument("--per-family", type=int, default=40, help="golds per family")
    ap.add_argument("--family", action="append", help="only these families")
    ap.add_argument("--show", choices=("fp", "fn", "all"), help="list stapo's errors of this kind")
    args = ap.parse_args(argv)
    seed = args.seed if args.seed is not None else (0 if args.split == "dev" else HELDBACK_SEED)
    pairs = list(generate(seed, args.per_family, split=args.split, families=args.family))
    t0 = time.perf_counter()
    res = run(pairs)
    wall = time.perf_counter() - t0
    print(render(res, pairs, f"differential, {args.split} split, seed {seed}, {args.per_family} golds/family"))
    print(f"\n({wall:.0f} s for both graders)")
    if args.show:
        for p in pairs:
            got = stapo_says(p.response, p.gold)
            kind = "FP" if got and not p.expected else "FN" if p.expected and not got else None
            if kind and (args.show == "all" or args.show == kind.lower()):
                print(f"{kind} [{p.family}/{p.how}] gold={p.gold!r} response={p.response[-140:]!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
