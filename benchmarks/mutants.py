"""Curated mutation check: do the tests catch the bugs that would silently corrupt results?

Each mutant is a small textual patch (one exact snippet replaced) that plants a realistic bug in a
critical rule: an S2T condition flipped, a local normalizer where the global one belongs, a
gather dropped, pass@k off by one, the first box graded instead of the last, a worker's deadline
kill skipped, a timeout verdict cached, a numeric tolerance loosened. For each, the runner copies
the repository's tracked and untracked (not ignored) files to a temporary directory, applies the
patch there (the working tree is never touched), runs the mapped tests with a time limit and
reports

    killed            a test failed (what we want)
    killed-by-timeout the only failures were time limits (a hang: it should fail fast instead)
    survived          every mapped test passed: the tests cannot see this bug
    error             the tests did not run (collection error, crash): counted as killed but shown
    stale             the patch no longer applies (the code was rewritten): update the mutant

Score = killed / (applied mutants), timeouts not counted as killed. Before the mutants, each test
selection runs once on the unpatched copy; a selection that fails there is reported and its
mutants are skipped (a red baseline would "kill" everything).

The copy is imported as ``stapo`` through a shim on PYTHONPATH (a ``stapo`` package of symlinks
built from pyproject's package-dir map), which wins over the editable install's finder, so every
subprocess the tests start (servers, grader workers, torchrun ranks) sees the mutant too.

    python benchmarks/mutants.py                 # every mutant (about 20 min on 2 busy cores)
    python benchmarks/mutants.py -k s2t -k pool  # mutants whose name contains any of these
    python benchmarks/mutants.py --list          # the list, and whether each patch still applies

Opt-in (``make mutants``), not part of the test suite. Its last score is in docs/testing.md; run it
before declaring a change to the areas it covers done, and add a mutant with every new critical rule.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

try:
    import tomllib  # Python 3.11+
except ImportError:  # pragma: no cover
    raise SystemExit("benchmarks/mutants.py needs Python 3.11+ (tomllib)") from None

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str  # repository-relative
    old: str  # must occur exactly once in ``file``
    new: str
    tests: tuple[str, ...]  # pytest node ids / paths, relative to the repository
    why: str
    timeout_s: int = 240
    # the same bug in a rewritten version of the code: (file, old, new), tried in order when the
    # main snippet no longer applies, so a rewrite in flight does not leave the rule unchecked
    alts: tuple[tuple[str, str, str], ...] = ()

    def patches(self) -> tuple[tuple[str, str, str], ...]:
        return ((self.file, self.old, self.new), *self.alts)


S2T = ("tests/unit/test_s2t_spread.py", "tests/unit/test_algos.py")
UPDATE = ("tests/unit/test_s2t_spread.py",)
METRICS = ("tests/unit/test_eval_metrics.py",)
EXTRACT = ("tests/unit/verifier_service/grader/test_grader.py",)
POOL = ("tests/service/test_pool_deadline_contract.py",)
NUMERIC = ("tests/unit/verifier_service/grader/test_grader_tolerances.py",)

MUTANTS: list[Mutant] = [
    # ------------------------------------------------------------------ core/algos: S2T
    Mutant("s2t-adv-flipped", "core/algos/weights.py",
           "return mask.bool() & (adv > 0) & lowp & lowh  # [B, T]",
           "return mask.bool() & (adv < 0) & lowp & lowh  # [B, T]", S2T,
           "silence negative-advantage tokens instead of positive ones"),
    Mutant("s2t-p-flipped", "core/algos/weights.py",
           "lowp = logprobs.detach().double().exp() < float(tau_p)",
           "lowp = logprobs.detach().double().exp() > float(tau_p)", S2T, "silence high-probability tokens"),
    Mutant("s2t-h-flipped", "core/algos/weights.py",
           "lowh = entropy.detach().double() < float(tau_h)", "lowh = entropy.detach().double() > float(tau_h)", S2T,
           "silence high-entropy tokens"),
    Mutant("s2t-h-dropped", "core/algos/weights.py",
           "return mask.bool() & (adv > 0) & lowp & lowh  # [B, T]",
           "return mask.bool() & (adv > 0) & lowp  # [B, T]", S2T,
           "entropy condition ignored (every candidate silenced)"),
    Mutant("s2t-silenced-stay-in-denominator", "core/algos/weights.py",
           "            denom_mask=keep,\n", "            denom_mask=ctx.mask.clone(),\n", S2T,
           "silenced tokens still count in the token-mean denominator (not STAPO's renormalization)"),
    Mutant("quantile-off-by-one", "core/algos/weights.py",
           "    pos = q * (n - 1)\n", "    pos = q * n\n", S2T, "quantile index off by one"),
    Mutant("top-entropy-quota-off-by-one", "core/algos/weights.py",
           "return min(n, max(1, math.ceil(frac * n - 1e-9)))", "return min(n, max(1, math.ceil(frac * n - 1e-9) + 1))",
           ("tests/unit/test_algos.py",), "20-Entropy keeps one token too many"),
    Mutant("top-entropy-gather-dropped", "core/algos/weights.py",
           "thr = top_fraction_threshold(ctx.gathered(local), rho, largest=True)",
           "thr = top_fraction_threshold(local, rho, largest=True)", S2T,
           "20-Entropy ranks one rank's tokens only"),
    # ------------------------------------------------------------------ core/algos: losses, aggregation, advantages
    Mutant("token-mean-local-normalizer", "core/algos/aggregation.py",
           "        return _weighted(per_token_loss, weights).sum() / _norm(normalizer, per_token_loss)\n",
           "        return _weighted(per_token_loss, weights).sum() / _norm(weights.denom_mask.sum(), per_token_loss)\n",
           S2T, "token-mean divides by the micro-batch's own count, not the global one"),
    Mutant("clip-bounds-swapped", "core/algos/losses.py",
           "torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)", "torch.clamp(ratio, 1.0 - eps_high, 1.0 + eps_low)",
           ("tests/unit/test_algos.py",), "clip-higher's eps_low / eps_high swapped"),
    Mutant("ppo-min-flipped", "core/algos/losses.py",
           "loss = torch.maximum(loss_unclipped, loss_clipped)", "loss = torch.minimum(loss_unclipped, loss_clipped)",
           ("tests/unit/test_algos.py",), "optimistic instead of pessimistic PPO bound"),
    Mutant("grpo-biased-std", "core/algos/advantages.py",
           "std = rewards.std(dim=1, keepdim=True)", "std = rewards.std(dim=1, keepdim=True, unbiased=False)",
           ("tests/unit/test_algos.py",), "GRPO with the biased group std (verl uses the unbiased one)"),
    Mutant("rloo-off-by-one", "core/algos/advantages.py",
           "/ (g - 1)", "/ g", ("tests/unit/test_algos.py",), "RLOO leave-one-out mean over G instead of G - 1"),
    # ------------------------------------------------------------------ the loop's global reductions
    Mutant("s2t-quantile-over-all-tokens", "core/algos/weights.py",
           "        ents = candidate_entropies(ctx.entropy, cand, ctx.gather)",
           "        ents = candidate_entropies(ctx.entropy, ctx.mask, ctx.gather)", S2T,
           "tau_h^(q) taken over every valid token instead of the candidates (A > 0, p < tau_p)"),
    Mutant("s2t-quantile-gather-dropped", "core/algos/weights.py",
           "    return gather(local) if gather is not None else local\n",
           "    return local\n", S2T,
           "tau_h^(q) over one rank's candidates instead of the global mini-batch's"),
    Mutant("normalizer-not-summed-over-ranks", "core/train/loop.py",
           "            norm = reduce(norm) if reduce is not None else norm\n", "            norm = norm\n", UPDATE,
           "each rank normalizes by its own token count",
           alts=(("core/train/update.py", "        return ctx, tw, self.reduce(self.parts.agg.normalizer(tw, self.mask))\n",
                  "        return ctx, tw, self.parts.agg.normalizer(tw, self.mask)\n"),)),
    Mutant("stats-weighting-without-stats", "core/train/update.py",
           "            if keep_graphs:  # statistics first:",
           "            if False:  # statistics first:", UPDATE,
           "a weighting that reads p / H (S2T) weighted from zeros instead of the forward's statistics"),
    # ------------------------------------------------------------------ evals/metrics
    Mutant("pass-at-k-off-by-one", "evals/metrics.py",
           "    for i in range(n - c + 1, n + 1):\n", "    for i in range(n - c + 2, n + 1):\n", METRICS,
           "unbiased pass@k product misses a factor"),
    Mutant("pass-at-k-early-exit-off-by-one", "evals/metrics.py",
           "    if n - c < k:\n", "    if n - c <= k:\n", METRICS, "pass@k is 1 one wrong sample too early"),
    Mutant("maj-at-k-tie-to-last", "evals/metrics.py",
           "        if len(cluster) > len(best):\n", "        if len(cluster) >= len(best):\n", METRICS,
           "maj@k ties go to the last cluster"),
    # ------------------------------------------------------------------ grader extraction
    Mutant("first-box-instead-of-last", "verifier_service/grader/extraction.py",
           "    group = [boxes[-1]]\n", "    group = [boxes[0]]\n", EXTRACT, "grade the first \\boxed{} answer"),
    # ------------------------------------------------------------------ grader pool
    Mutant("deadline-kill-skipped", "verifier_service/server/pool.py",
           "(*job.items[i], self.max_chars), timeout=deadline)",
           "(*job.items[i], self.max_chars), timeout=None)", POOL,
           "a runaway worker is never killed (pebble's per-task timeout off): the item hangs"),
    Mutant("timeouts-cached", "verifier_service/server/cache.py",
           '        if r.status in ("ok", "no_answer"):  # never',
           '        if r.status in ("ok", "no_answer", "timeout"):  # never', POOL,
           "a retry of a timed-out item is answered from the cache"),
    # ------------------------------------------------------------------ numeric tolerances
    Mutant("numeric-rel-tol-10x", "verifier_service/grader/numeric.py",
           "\nREL_TOL = 1e-5\n", "\nREL_TOL = 1e-4\n", NUMERIC,
           "the numeric rejection's tolerance loosened 10x"),
    Mutant("numeric-rel-tol-tightened-10x", "verifier_service/grader/numeric.py",
           "\nREL_TOL = 1e-5\n", "\nREL_TOL = 1e-6\n", NUMERIC,
           "the numeric rejection stricter than math-verify's rounding: rejects accepted answers"),
    Mutant("numeric-max-magnitude-10x", "verifier_service/grader/numeric.py",
           "MAX_MAGNITUDE = mpmath.mpf(10) ** 30", "MAX_MAGNITUDE = mpmath.mpf(10) ** 31", NUMERIC,
           "values past the trusted magnitude evaluated"),
    Mutant("numeric-max-len-off-by-one", "verifier_service/grader/numeric.py",
           "    if len(s) > MAX_LEN:", "    if len(s) >= MAX_LEN:", NUMERIC, "length bound off by one"),
    Mutant("numeric-exponent-bound-10x", "verifier_service/grader/numeric.py",
           "if abs(ex) > 1000:", "if abs(ex) > 10000:", NUMERIC, "huge exponents evaluated"),
    Mutant("numeric-zero-denominator-10x", "verifier_service/grader/numeric.py",
           "if abs(den) < 1e-20:", "if abs(den) < 1e-21:", NUMERIC, "division by ~0 evaluated"),
    Mutant("exact-constants-different-loosened-10x", "verifier_service/grader/rules/symbolic.py",
           'if diff > sympy.Float("1e-30", 60):', 'if diff > sympy.Float("1e-29", 60):', NUMERIC,
           "two exact constants 1e-30 apart no longer told apart"),
    Mutant("rounded-gold-half-unit-10x", "verifier_service/grader/rules/numbers.py",
           "return abs(pred_value - g.num.value) <= Fraction(1, 2 * 10**d)",
           "return abs(pred_value - g.num.value) <= Fraction(1, 2 * 10 ** (d - 1))", NUMERIC,
           "a rounded gold matches answers 10x too far away"),
]


# ----------------------------------------------------------------------------- the copy


def repo_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                         capture_output=True).stdout.decode()
    return [f for f in out.split("\0") if f and (ROOT / f).is_file()]


def make_copy(dest: Path, files: list[str]) -> None:
    for f in files:
        d = dest / f
        d.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, d)
    make_shim(dest)


def make_shim(tree: Path) -> None:
    """``tree/.mutant-site``: a ``stapo`` package of symlinks (stapo -> stapo_pkg, stapo.core -> core, ...:
    pyproject's package-dir map), put first on PYTHONPATH so the copy is what gets imported."""
    pkg_dirs = tomllib.loads((tree / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    shim = tree / ".mutant-site"
    for pkg, folder in sorted(pkg_dirs.items(), key=lambda kv: kv[0].count(".")):
        parts = pkg.split(".")
        if len(parts) == 1:
            (shim / pkg).mkdir(parents=True)
            for item in (tree / folder).iterdir():
                (shim / pkg / item.name).symlink_to(item)
        else:
            link = shim.joinpath(*parts)
            if link.is_symlink():
                link.unlink()
            link.symlink_to(tree / folder)


def applicable(m: Mutant, tree: Path) -> tuple[tuple[str, str, str] | None, str]:
    """The first of the mutant's patches whose snippet occurs exactly once in ``tree`` (None if no
    patch does), and a note: which file it patches, or why none applies."""
    why = []
    for f, old, new in m.patches():
        path = tree / f
        n = path.read_text().count(old) if path.is_file() else -1
        if n == 1:
            return (f, old, new), f
        why.append(f"{f}: " + ("no such file" if n < 0 else f"snippet found {n} times (expected once)"))
    return None, "; ".join(why)


def apply(m: Mutant, tree: Path) -> str | None:
    """Patch ``tree`` in place; None, or why the patch no longer applies."""
    patch, why = applicable(m, tree)
    if patch is None:
        return why
    f, old, new = patch
    path = tree / f
    path.write_text(path.read_text().replace(old, new))
    return None


def run_tests(tree: Path, tests: tuple[str, ...], timeout_s: int) -> tuple[str, float, str]:
    """(outcome, seconds, tail of the output): outcome in passed / failed / timeout / error."""
    env = dict(os.environ, PYTHONPATH=str(tree / ".mutant-site"), PYTHONDONTWRITEBYTECODE="1")
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        return "timeout", time.monotonic() - t0, out[-1500:]
    took = time.monotonic() - t0
    if p.returncode == 0:
        return "passed", took, out[-1500:]
    if p.returncode == 1:
        failures = re.findall(r"^(?:FAILED|ERROR) .*$", out, re.M)
        if failures and all("Timeout" in f for f in failures):
            return "timeout", took, out[-1500:]
        return "failed", took, out[-1500:]
    return "error", took, out[-1500:]


def check_import(tree: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(tree / ".mutant-site"))
    where = subprocess.run([sys.executable, "-c", "import stapo.core.algos as a; print(a.__file__)"], env=env,
                           capture_output=True, text=True, check=True).stdout.strip()
    if not where.startswith(str(tree)):
        raise SystemExit(f"the copy is not what gets imported (stapo.core.algos from {where}); aborting")


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-k", action="append", default=[], help="only mutants whose name contains this (repeatable)")
    ap.add_argument("--list", action="store_true", help="list the mutants and whether each still applies")
    ap.add_argument("--no-baseline", action="store_true", help="skip the unpatched run of each test selection")
    args = ap.parse_args(argv)
    chosen = [m for m in MUTANTS if not args.k or any(k in m.name for k in args.k)]
    files = repo_files()

    if args.list:
        for m in chosen:
            patch, why = applicable(m, ROOT)
            ok = f"applies to {why}" if patch is not None else f"STALE (patch no longer applies: {why})"
            print(f"{m.name:38s} {ok:45s} {m.why}")
        return 0

    results: list[tuple[Mutant, str, float, str]] = []
    with tempfile.TemporaryDirectory(prefix="stapo-mutants-") as tmp:
        base = Path(tmp) / "tree"
        make_copy(base, files)
        check_import(base)
        red: dict[tuple[str, ...], str] = {}
        if not args.no_baseline:
            for sel in dict.fromkeys(m.tests for m in chosen):
                outcome, took, tail = run_tests(base, sel, max(m.timeout_s for m in chosen if m.tests == sel))
                print(f"baseline {' '.join(sel)}: {outcome} ({took:.0f} s)", flush=True)
                if outcome != "passed":
                    red[sel] = tail
        for m in chosen:
            if m.tests in red:
                results.append((m, "baseline-red", 0.0, red[m.tests]))
                print(f"{m.name:38s} skipped: its tests fail without the mutant", flush=True)
                continue
            tree = Path(tmp) / m.name
            shutil.copytree(base, tree, symlinks=True)
            shutil.rmtree(tree / ".mutant-site")  # its links point into the base copy
            make_shim(tree)
            stale = apply(m, tree)
            if stale is not None:
                results.append((m, "stale", 0.0, stale))
                print(f"{m.name:38s} STALE: {stale}", flush=True)
            else:
                outcome, took, tail = run_tests(tree, m.tests, m.timeout_s)
                verdict = {"failed": "killed", "passed": "survived", "timeout": "killed-by-timeout",
                           "error": "error"}[outcome]
                results.append((m, verdict, took, tail))
                print(f"{m.name:38s} {verdict:18s} {took:6.0f} s", flush=True)
            shutil.rmtree(tree, ignore_errors=True)

    applied = [r for r in results if r[1] not in ("stale", "baseline-red")]
    killed = [r for r in applied if r[1] in ("killed", "error")]
    print()
    print(f"{'mutant':38s} {'outcome':18s} {'s':>5s}  what it plants")
    for m, verdict, took, _ in results:
        print(f"{m.name:38s} {verdict:18s} {took:5.0f}  {m.why}")
    score = len(killed) / len(applied) if applied else float("nan")
    print(f"\nscore: {len(killed)}/{len(applied)} killed ({score:.0%}); "
          f"timeout-only {sum(r[1] == 'killed-by-timeout' for r in applied)}, "
          f"survived {sum(r[1] == 'survived' for r in applied)}, stale {sum(r[1] == 'stale' for r in results)}, "
          f"baseline red {sum(r[1] == 'baseline-red' for r in results)}")
    for m, verdict, _, tail in results:
        if verdict in ("survived", "error", "killed-by-timeout", "baseline-red"):
            print(f"\n--- {m.name} ({verdict}): {m.file}; tests {' '.join(m.tests)}\n{tail[-800:]}")
    return 0 if applied and len(killed) == len(applied) else 1


if __name__ == "__main__":
    raise SystemExit(main())
