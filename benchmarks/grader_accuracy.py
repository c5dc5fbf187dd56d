"""Accuracy of the stapo math grader vs plain math-verify on the labelled grading tables.

Tables (rows ``{"gold", "prediction", "expected", "source"}``):

- ``verifier_service/data/grader_cases.jsonl``: the regression table the grader was built against
  (math-verify's own tests + hand-written rows);
- ``verifier_service/data/grader_heldout.jsonl``: an independent held-out table (other public graders'
  tests and behaviours, model-style outputs on real benchmark golds), written before the grader was
  measured on it;
- ``verifier_service/data/corpus_dev.jsonl`` and ``corpus_heldback.jsonl``: the large corpus by family
  (``benchmarks/build_grader_corpus.py``; rows also carry ``family``). The dev part is what the grader
  was tuned on (tests read it); the held-back part is read ONLY here.

For each table, and each ``family`` (corpus) or ``source`` group inside it, the harness prints accuracy, false positives
(a wrong answer rewarded: the worse error for RL) and false negatives of

- ``stapo``: ``stapo.verifier_service.grader.grade(prediction, gold).correct``;
- ``math-verify``: plain ``verify(parse(gold), parse(prediction))`` (math-verify defaults, timeouts
  off because they rely on ``signal.alarm``), what open-r1 / TRL style reward functions do.

    python benchmarks/grader_accuracy.py                  # print the table
    python benchmarks/grader_accuracy.py --write          # also update "## Grader accuracy" in RESULTS.md
    python benchmarks/grader_accuracy.py --show-errors    # list every row stapo gets wrong
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import re
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TABLES = {
    "cases": ROOT / "verifier_service/data/grader_cases.jsonl",
    "heldout": ROOT / "verifier_service/data/grader_heldout.jsonl",
    "corpus-dev": ROOT / "verifier_service/data/corpus_dev.jsonl",
    "corpus-heldback": ROOT / "verifier_service/data/corpus_heldback.jsonl",
}
RESULTS = ROOT / "benchmarks/RESULTS.md"
SECTION = "## Grader accuracy"


@dataclass
class Tally:
    """Counts of one grader on one subset of rows."""

    n: int = 0
    right: int = 0
    fp: int = 0
    fn: int = 0
    errors: list = field(default_factory=list)

    def add(self, got: bool, row: dict) -> None:
        self.n += 1
        if got == row["expected"]:
            self.right += 1
        elif got:
            self.fp += 1
            self.errors.append(row)
        else:
            self.fn += 1
            self.errors.append(row)

    @property
    def acc(self) -> float:
        return self.right / self.n if self.n else 0.0


def load(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text("utf-8").splitlines() if line.strip()]


def plain_math_verify(pred: str, gold: str) -> bool:
    """What a plain math-verify reward does: parse both sides whole-text, verify, never raise."""
    from math_verify import parse, verify

    try:
        return bool(
            verify(parse(gold, parsing_timeout=None), parse(pred, parsing_timeout=None), timeout_seconds=None)
        )
    except Exception:
        return False


def stapo_grade(pred: str, gold: str) -> bool:
    from stapo.verifier_service.grader import grade

    return grade(pred, gold).correct


def group_of(row: dict) -> str:
    """A short group name: the corpus family, the repository (and test), or the group before any parenthesis."""
    if "family" in row:
        return row["family"]
    src = row["source"]
    if src.startswith("huggingface/Math-Verify"):
        return "math-verify tests"
    return re.sub(r"\s*\(.*$", "", src)


def measure(rows: list[dict]) -> dict[str, dict[str, Tally]]:
    """-> {subset: {"stapo": Tally, "math-verify": Tally}} for "all", each group, and "non-math-verify"."""
    out: dict[str, dict[str, Tally]] = defaultdict(lambda: {"stapo": Tally(), "math-verify": Tally()})
    for row in rows:
        got = {
            "stapo": stapo_grade(row["prediction"], row["gold"]),
            "math-verify": plain_math_verify(row["prediction"], row["gold"]),
        }
        subsets = ["all", group_of(row)]
        if not row["source"].startswith("huggingface/Math-Verify"):
            subsets.append("non-math-verify")
        for s in subsets:
            for k, v in got.items():
                out[s][k].add(v, row)
    return out


def render(name: str, rows: list[dict], res: dict[str, dict[str, Tally]]) -> str:
    neg = sum(not r["expected"] for r in rows)
    lines = [
        f"**{name}** (`{TABLES[name].relative_to(ROOT)}`, {len(rows)} rows, {neg} expected=False)",
        "",
        "| subset | rows | stapo acc | stapo FP | stapo FN | math-verify acc | math-verify FP | math-verify FN |",
        "|---|---|---|---|---|---|---|---|",
    ]
    order = ["all", "non-math-verify"] + sorted(k for k in res if k not in ("all", "non-math-verify"))
    for key in order:
        if key not in res:
            continue
        a, b = res[key]["stapo"], res[key]["math-verify"]
        lines.append(f"| {key} | {a.n} | {a.acc:.1%} | {a.fp} | {a.fn} | {b.acc:.1%} | {b.fp} | {b.fn} |")
    return "\n".join(lines)


def write_section(body: str) -> None:
    """Replace (or append) only the "## Grader accuracy" section of RESULTS.md."""
    text = RESULTS.read_text("utf-8") if RESULTS.exists() else "# Benchmark results\n"
    block = f"{SECTION}\n\n{body.rstrip()}\n"
    pattern = re.compile(rf"^{re.escape(SECTION)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _m: block + "\n", text, count=1).rstrip() + "\n"
    else:
        text = text.rstrip() + "\n\n" + block
    RESULTS.write_text(text, "utf-8")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--write", action="store_true", help="update the '## Grader accuracy' section of RESULTS.md"
    )
    ap.add_argument("--show-errors", action="store_true", help="print every row the stapo grader gets wrong")
    ap.add_argument("--table", choices=sorted(TABLES), action="append", help="only these tables")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    parts = []
    for name in args.table or list(TABLES):
        rows = load(TABLES[name])
        res = measure(rows)
        parts.append(render(name, rows, res))
        print(parts[-1] + "\n")
        if args.show_errors:
            for r in res["all"]["stapo"].errors:
                from stapo.verifier_service.grader import grade

                g = grade(r["prediction"], r["gold"])
                kind = "FP" if g.correct else "FN"
                print(
                    f"  {kind} gold={r['gold']!r} extracted={g.extracted!r} status={g.status} "
                    f"[{group_of(r)}]\n      pred={r['prediction'][-160:]!r}"
                )
    wall = time.perf_counter() - t0
    header = (
        f"`python benchmarks/grader_accuracy.py --write` ({time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, "
        f"{wall:.0f} s)\n\nMachine: {platform.machine()}, {os.cpu_count()} logical CPUs, Python "
        f"{platform.python_version()}, math-verify {importlib.metadata.version('math-verify')}. Accuracy does "
        "not depend on the machine."
    )
    body = header + "\n\n" + "\n\n".join(parts) + (
        "\n\nFP = a wrong answer graded correct, FN = a right answer graded wrong. "
        "stapo = `grade(prediction, gold).correct`; math-verify = `verify(parse(gold), parse(prediction))` "
        "(math-verify defaults, timeouts off)."
    )
    if args.write:
        write_section(body)
        print(f"wrote {SECTION!r} in {RESULTS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
