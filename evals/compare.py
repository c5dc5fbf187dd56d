"""`stapo compare`: runs side by side — accuracy tables with deltas, training curves, PNG + HTML.

Inputs are any mix of

- training run dirs (``metrics.jsonl``, ``val.jsonl``, ``summary.json``, ``config.yaml``; written by
  `stapo train`), and
- eval output dirs (``results.json``; written by `stapo eval`).

The first dir is the baseline: every table shows each other run's value and its delta against it
in percentage points, as the paper reports STAPO against GRPO / DAPO. Outputs in ``--out``:

- ``compare.json``: every number shown (tables, per-run summaries), for scripts and tests;
- ``curves/<metric>.png``: one plot per training metric (reward, validation accuracy, entropy,
  response length, silenced fraction, clip fractions, grad norm), all runs on the same axes,
  EMA-smoothed with the raw values faint behind;
- ``report.html``: one self-contained page (images embedded as data URIs) that opens offline.

Before any number, compare checks that the comparison is fair: it reads each training run's
``config.yaml`` and lists every key that differs from the baseline's, grouped by
:mod:`stapo.core.fairness` into the method (the comparison itself), execution (no effect on the
objective) and confounds (batch, length, grader, reward scale, sampler, schedule, seed, model,
data, eval). When runs differ in any confound, a warning heads the terminal output and the HTML
report, naming each key and both values (``report["config_check"]``).

After the numbers, :func:`conclusion` states the verdict of every group against the baseline
group, metric by metric (direction, size, the paired 95% t interval, whether it excludes 0), and
:func:`val_resolution` warns when the validation set is too small to move in steps under 5 points.

Usage::

    report = compare_runs([Path("runs/grpo"), Path("runs/stapo")], out_dir=Path("cmp"))
    report["tables"]["avg"]["rows"]["aime24"]["stapo"]   # accuracy of run "stapo" on aime24
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stapo.core.tracking import read_jsonl
from stapo.evals.metrics import metric_value
from stapo.evals.report import esc, html_page, html_table, img_tag, section

__all__ = ["RunData", "CURVES", "load_run", "compare_runs", "terminal_tables", "group_runs", "seeded_summary",
           "unit_of", "conclusion", "conclusion_text", "val_resolution"]

CURVES: tuple[tuple[str, str], ...] = (
    ("reward/mean", "mean reward"),
    ("val/accuracy", "validation accuracy"),
    ("entropy/mean", "mean token entropy (nats)"),
    ("response_length/mean", "mean response length (tokens)"),
    ("stapo/silenced_frac", "silenced token fraction"),
    ("actor/clip_frac_low", "clip fraction (low side)"),
    ("actor/clip_frac_high", "clip fraction (high side)"),
    ("actor/grad_norm", "gradient norm (before clipping)"),
)
"""(metrics.jsonl key, plot title) of the curves drawn; ``val/accuracy`` also reads ``val.jsonl``."""

KINDS = ("avg", "pass", "maj")


def unit_of(key: str) -> str:
    """The one unit a metric is shown in everywhere (tables, compare.json, report.html, PNG axes):
    accuracies, fractions and rates in % (a silenced rate of 0.0208 is 2.08 %); entropies in nats;
    lengths in tokens; step counts; wall time in seconds; "" for unitless numbers (reward, loss, norms)."""
    k = key.removeprefix("final ")
    if "accuracy" in k or "frac" in k or "rate" in k or "clip_ratio" in k:
        return "%"
    if "entropy" in k:
        return "nats"
    if "length" in k:
        return "tokens"
    return {"steps": "steps", "wall_s": "s"}.get(k, "")


def in_unit(key: str, v: float | None) -> float | None:
    """A metric's value (as logged: fractions in [0, 1]) in the unit :func:`unit_of` names."""
    return None if v is None else (100.0 * v if unit_of(key) == "%" else v)


def labelled(key: str) -> str:
    """``silenced_rate (%)``: the metric's name with its unit, as every table row and axis shows it."""
    u = unit_of(key)
    return f"{key} ({u})" if u else key


@dataclass
class RunData:
    """What compare reads from one dir."""

    label: str
    path: Path
    results: dict[str, Any] | None = None  # results.json (eval dir)
    metrics: list[dict[str, Any]] = field(default_factory=list)  # metrics.jsonl rows
    val: list[dict[str, Any]] = field(default_factory=list)  # val.jsonl rows
    summary: dict[str, Any] | None = None  # summary.json
    algorithm: str | None = None  # config.yaml algorithm.name / token_weighting
    config: dict[str, Any] | None = None  # config.yaml as saved (nested), for the confound check
    config_changes: list[str] = field(default_factory=list)  # "from step N: key old -> new" per resume change

    @property
    def kinds(self) -> list[str]:
        out = []
        if self.results is not None:
            out.append("eval")
        if self.metrics or self.val or self.summary is not None:
            out.append("train")
        return out


_read_jsonl = read_jsonl  # torn last line of a run still writing (or killed) is ignored


def load_run(path: Path, label: str | None = None) -> RunData:
    """Read a training run dir or an eval dir; an error names what was expected."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"compare: {path} is not a directory")
    run = RunData(label=label or path.name, path=path)
    if (path / "results.json").is_file():
        run.results = json.loads((path / "results.json").read_text())
        if "benchmarks" not in run.results:
            raise ValueError(f"{path / 'results.json'}: no 'benchmarks' key (not written by `stapo eval`?)")
    run.metrics = _read_jsonl(path / "metrics.jsonl")
    run.val = _read_jsonl(path / "val.jsonl")
    if (path / "summary.json").is_file():
        run.summary = json.loads((path / "summary.json").read_text())
    cfg_path = path / "config.yaml"
    if cfg_path.is_file():
        import yaml

        try:
            cfg = yaml.safe_load(cfg_path.read_text()) or {}
            alg = cfg.get("algorithm", {}) or {}
            run.algorithm = alg.get("name") or alg.get("token_weighting")
            run.config = cfg if isinstance(cfg, dict) else None
        except yaml.YAMLError:
            run.algorithm = None
    run.config_changes = read_config_changes(path)
    if not run.kinds:
        raise ValueError(
            f"compare: {path} has none of results.json (eval dir) or metrics.jsonl / val.jsonl / summary.json "
            "(training run dir)"
        )
    return run


def read_config_changes(path: Path) -> list[str]:
    """``from step N: key old -> new`` for each change a resume recorded in ``config_changes.jsonl``
    (``{"step", "changes": [{"key", "old", "new", "bookkeeping"}]}`` rows; bookkeeping changes such as
    a longer ``trainer.max_steps`` are marked). Rows or fields it does not know are skipped."""
    out = []
    for row in _read_jsonl(path / "config_changes.jsonl"):
        changes = row.get("changes") if isinstance(row, dict) else None
        for c in changes if isinstance(changes, list) else []:
            if isinstance(c, dict) and "key" in c:
                mark = " (bookkeeping)" if c.get("bookkeeping") else ""
                out.append(f"from step {row.get('step', '?')}: {c['key']} {c.get('old')!r} -> {c.get('new')!r}{mark}")
    return out


def _labels(paths: Sequence[Path]) -> list[str]:
    """Dir names, made unique with the parent's name (then an index) when two runs share one."""
    names = [Path(p).resolve().name for p in paths]
    out = []
    for p, n in zip(paths, names, strict=True):
        out.append(f"{Path(p).resolve().parent.name}/{n}" if names.count(n) > 1 else n)
    seen: dict[str, int] = {}
    final = []
    for lab in out:
        seen[lab] = seen.get(lab, 0) + 1
        final.append(lab if seen[lab] == 1 and out.count(lab) == 1 else f"{lab}#{seen[lab]}")
    return final


# ----------------------------------------------------------------------------- tables


def _finite(v: Any) -> float | None:
    if v is None:
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def accuracy_tables(runs: Sequence[RunData]) -> dict[str, Any]:
    """avg / pass / maj tables over benchmarks (rows) and eval runs (columns), with deltas.

    Values are in % (0-100); deltas are value - baseline in percentage points (the first run that
    has the benchmark is not assumed: the baseline is always the first run, and a missing baseline
    value gives no delta). The ``Avg.`` row is the mean over benchmarks that every eval run has.
    """
    evals = [r for r in runs if r.results is not None]
    baseline = runs[0].label
    benches: list[str] = []
    for r in evals:
        for b in r.results["benchmarks"]:  # type: ignore[index]
            if b not in benches:
                benches.append(b)
    common = [b for b in benches if all(b in r.results["benchmarks"] for r in evals)]  # type: ignore[index]
    tables: dict[str, Any] = {}
    for kind in KINDS:
        rows: dict[str, dict[str, float | None]] = {}
        ks: dict[str, dict[str, int | None]] = {}
        for b in benches:
            rows[b], ks[b] = {}, {}
            for r in evals:
                m = r.results["benchmarks"].get(b)  # type: ignore[index]
                rows[b][r.label] = in_unit("accuracy", metric_value(m, kind)) if m else None
                ks[b][r.label] = _k_of(m, kind) if m else None
        if len(common) > 0 and evals:
            rows["Avg."] = {
                r.label: sum(rows[b][r.label] for b in common) / len(common)  # type: ignore[misc]
                for r in evals
            }
        delta = {
            b: {
                lab: (v - vals[baseline]) if v is not None and vals.get(baseline) is not None else None
                for lab, v in vals.items()
                if lab != baseline
            }
            for b, vals in rows.items()
        }
        tables[kind] = {"columns": [r.label for r in evals], "rows": rows, "k": ks, "delta": delta}
    tables["common_benchmarks"] = common
    return tables


def _k_of(m: dict[str, Any], kind: str) -> int | None:
    for key in m:
        if key.startswith(f"{kind}@"):
            return int(key.split("@", 1)[1])
    return None


def training_summary(run: RunData) -> dict[str, float | None]:
    """One row of numbers per training run: validation at start, end and best, steps, final metrics.

    "final" values are the mean of the last 10% of steps (at least 1), which is steadier than the
    very last step of a noisy RL curve.
    """
    vals = [_finite(v.get("accuracy")) for v in run.val]
    vals_f = [v for v in vals if v is not None]
    s = run.summary or {}
    out: dict[str, float | None] = {
        "steps": _finite(s.get("steps")) if s.get("steps") is not None else (
            float(max(int(m.get("step", 0)) for m in run.metrics)) if run.metrics else None
        ),
        "val_accuracy_before": _finite(s.get("val_accuracy_before")) if s else (vals_f[0] if vals_f else None),
        "val_accuracy_after": _finite(s.get("val_accuracy_after")) if s else (vals_f[-1] if vals_f else None),
        "val_accuracy_best": max(vals_f) if vals_f else None,
        "silenced_rate": silenced_rate(run),
        "wall_s": _finite(s.get("wall_s")),
    }
    tail = max(1, len(run.metrics) // 10)
    for key, _ in CURVES:
        if key == "val/accuracy":
            continue
        xs = [_finite(m.get(key)) for m in run.metrics[-tail:]]
        xs_f = [x for x in xs if x is not None]
        out[f"final {key}"] = sum(xs_f) / len(xs_f) if xs_f else None
    return out


def _epochs(run: RunData) -> int:
    alg = (run.config or {}).get("algorithm") or {}
    return int(alg.get("ppo_epochs") or 1)


def silenced_rate(run: RunData) -> float | None:
    """Silenced (token, epoch) pairs over all of the run's steps / valid tokens x PPO epochs: the
    S2T rate the whole run had (None without the metrics)."""
    sil = [_finite(m.get("stapo/silenced_count")) for m in run.metrics]
    tok = [_finite(m.get("tokens/valid")) for m in run.metrics]
    pairs = [(a, b) for a, b in zip(sil, tok, strict=True) if a is not None and b is not None]
    total = sum(b for _, b in pairs) * _epochs(run)
    return sum(a for a, _ in pairs) / total if pairs and total > 0 else None


_NOT_COMPARED = ("time/", "perf/", "phase/", "stapo/tau_h")
"""Metric prefixes that differ between two runs of the same computation: wall-clock timings, and the
diagnostics drawn at each run's configured thresholds (the phase cells, tau_h), which a run without
S2T still logs at its own config's values."""


def identical_metrics(a: RunData, b: RunData, *, rel: float = 1e-4, abs_: float = 1e-6) -> bool:
    """Whether two runs logged the same steps with the same values, to 4 significant digits (``rel``;
    ``abs_`` for values near 0), for every shared metric except :data:`_NOT_COMPARED`: the two
    updates computed the same thing up to float rounding (two aggregations that agree in exact
    arithmetic sum in different orders)."""
    if not a.metrics or len(a.metrics) != len(b.metrics):
        return False
    for ra, rb in zip(a.metrics, b.metrics, strict=True):
        keys = (set(ra) & set(rb)) - {k for k in set(ra) | set(rb) if k.startswith(_NOT_COMPARED)}
        for k in keys:
            x, y = ra[k], rb[k]
            if x == y:
                continue
            if not (isinstance(x, (int, float)) and isinstance(y, (int, float)) and same_value(x, y, rel=rel, abs_=abs_)):
                return False
    return True


def same_value(x: float, y: float, *, rel: float = 1e-4, abs_: float = 1e-6) -> bool:
    """Two numbers equal to 4 significant digits (``abs_`` near 0): the tolerance of "identical"
    everywhere in compare (runs, per-seed differences), wide enough for float rounding (one update
    summed in another order) and far below any difference a method makes."""
    return x == y or math.isclose(x, y, rel_tol=rel, abs_tol=abs_)


def s2t_notes(runs: Sequence[RunData], groups: dict[str, list[RunData]] | None = None) -> list[str]:
    """Plain sentences for the fairness box: runs whose S2T mask never fired, and runs whose metrics
    are identical (the method changed nothing the run measured), each said once per group: a group
    whose every run never fired is one note, and groups identical seed by seed are one note."""
    groups = groups or {r.label: [r] for r in runs}
    ids = {id(r) for r in runs}
    members = {g: [r for r in m if id(r) in ids] for g, m in groups.items()}
    members = {g: m for g, m in members.items() if m}
    notes = []
    for g, rs in members.items():
        idle = [r for r in rs if (((r.config or {}).get("algorithm") or {}).get("token_weighting") == "s2t"
                                  and r.metrics and silenced_rate(r) == 0)]
        if len(rs) > 1 and len(idle) == len(rs):
            steps = sorted({len(r.metrics) for r in rs})
            notes.append(f"S2T never fired in {g} ({len(rs)} runs: {', '.join(r.label for r in rs)}): 0 tokens "
                         f"silenced over {'/'.join(map(str, steps))} steps in each, so its update is the same "
                         "objective without the mask; `stapo calibrate` measures the rate its thresholds give on "
                         "this model.")
            continue
        for r in idle:
            tokens = sum(_finite(m.get("tokens/valid")) or 0.0 for m in r.metrics)
            notes.append(f"S2T never fired in {r.label}: 0 tokens silenced over {len(r.metrics)} steps "
                         f"({tokens:,.0f} response tokens), so its update is the same objective without the mask; "
                         "`stapo calibrate` measures the rate its thresholds give on this model.")
    mode, keys = _pairing_keys(members)
    same = identical_group_pairs(members, keys)
    covered: set[tuple[str, str]] = set()
    for cls in _classes(list(members), same):
        if len(cls) < 2:
            continue
        covered |= {(a.label, b.label) for g in cls for h in cls for a in members[g] for b in members[h]}
        n = len(members[cls[0]])
        if n == 1:
            notes.append(f"{' and '.join(members[g][0].label for g in cls)} logged identical metrics at every step "
                         "(to 4 significant digits, timings aside): here the methods did not differ in effect.")
            continue
        names = ", ".join(cls[:-1]) + f" and {cls[-1]}"
        notes.append(f"{names} logged identical metrics at every step, run by run ({n} runs each, paired by "
                     f"{'seed' if mode == 'seed' else 'position'}; to 4 significant digits, "
                     "timings aside): here the methods did not differ in effect.")
    flat = [r for m in members.values() for r in m]
    for i, a in enumerate(flat):
        for b in flat[i + 1:]:
            if (a.label, b.label) not in covered and identical_metrics(a, b):
                notes.append(f"{a.label} and {b.label} logged identical metrics at every step (to 4 significant "
                             "digits, timings aside): here the methods did not differ in effect.")
    return notes


def identical_group_pairs(groups: dict[str, list[RunData]], keys: dict[str, Any]) -> list[tuple[str, str]]:
    """(a, b) for every two groups whose runs logged identical metrics pair by pair: both hold the
    same pairing keys (``keys``: run label -> seed or position) and each pair is identical."""
    out = []
    names = list(groups)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            ra = {keys[r.label]: r for r in groups[a]}
            rb = {keys[r.label]: r for r in groups[b]}
            if set(ra) == set(rb) and len(ra) == len(groups[a]) == len(groups[b]) and all(
                    identical_metrics(ra[k], rb[k]) for k in ra):
                out.append((a, b))
    return out


def _classes(names: list[str], pairs: list[tuple[str, str]]) -> list[list[str]]:
    """The names joined by ``pairs`` into classes (transitively), each in the order of ``names``."""
    root = {n: n for n in names}

    def find(n: str) -> str:
        while root[n] != n:
            n = root[n]
        return n

    for a, b in pairs:
        root[find(b)] = find(a)
    out: dict[str, list[str]] = {}
    for n in names:
        out.setdefault(find(n), []).append(n)
    return list(out.values())


# ----------------------------------------------------------------------------- seeds


def run_seed(run: RunData) -> int | None:
    """The run's ``trainer.seed`` (config.yaml, or the config an eval dir's results.json carries)."""
    for cfg in (run.config, (run.results or {}).get("config")):
        seed = ((cfg or {}).get("trainer") or {}).get("seed") if isinstance(cfg, dict) else None
        if isinstance(seed, int):
            return seed
    return None


def _replicate_key(run: RunData) -> str | None:
    """What two seeds of one method share: the config without its seed and execution keys."""
    from stapo.core.fairness import classify, flatten

    if run.config is None or "train" not in run.kinds:
        return None
    flat = flatten(run.config)
    return json.dumps(sorted((k, repr(v)) for k, v in flat.items() if classify(k) not in ("seed", "execution")))


def group_runs(runs: Sequence[RunData], names: Sequence[str] | None = None) -> dict[str, list[RunData]]:
    """Runs by method, in order of first appearance: ``names`` (one per run, ``--group``), or else the
    training runs whose configs differ only in seed and execution keys, each with its own seed,
    named by the recipe (``algorithm.name``); every other run is a group of its own under its label."""
    if names is not None:
        if len(names) != len(runs):
            raise ValueError(f"compare: {len(names)} --group labels for {len(runs)} runs (give one per run, in order)")
        out: dict[str, list[RunData]] = {}
        for r, g in zip(runs, names, strict=True):
            out.setdefault(g, []).append(r)
        return out
    keys = [_replicate_key(r) for r in runs]
    for k in set(keys):  # a repeated seed is a rerun, not a replicate: those runs stay apart
        seeds = [run_seed(r) for r, kk in zip(runs, keys, strict=True) if kk == k]
        if k is not None and len(set(seeds)) < len(seeds):
            keys = [None if kk == k else kk for kk in keys]
    out = {}
    taken = {r.label for r in runs}
    named: dict[str, str] = {}
    for r, k in zip(runs, keys, strict=True):
        if k is None or keys.count(k) < 2:
            out[r.label] = [r]
            continue
        if k not in named:
            name = r.algorithm or r.label
            while name in out or (name in taken and name != r.label):
                name += "*"
            named[k] = name
            out[name] = []
        out[named[k]].append(r)
    return out


def _pairing_keys(groups: dict[str, list[RunData]]) -> tuple[str, dict[str, Any]]:
    """("seed", {label: seed}) when every run names a seed and no group repeats one; else
    ("order", {label: position in its group})."""
    seeds = {r.label: run_seed(r) for g in groups.values() for r in g}
    ok = all(v is not None for v in seeds.values()) and all(
        len({seeds[r.label] for r in g}) == len(g) for g in groups.values())
    if ok:
        return "seed", seeds
    return "order", {r.label: i for g in groups.values() for i, r in enumerate(g)}


def _seeded_metric(key: str, groups: dict[str, list[RunData]], value: Any, keys: dict[str, Any]) -> dict[str, Any]:
    """{"groups": {g: mean_interval + values}, "paired": {g: paired_difference vs the first group}}
    of one metric; ``value(run)`` gives a run's value (None: not counted). Group intervals are
    clipped to the metric's range (:func:`bounds_of`); a paired difference is marked ``identical``
    when every pair agrees to 4 significant digits (:func:`same_value`)."""
    from stapo.evals.compare_stats import mean_interval, paired_difference

    per: dict[str, dict[Any, float]] = {}
    for g, members in groups.items():
        vals = {keys[r.label]: value(r) for r in members}
        per[g] = {k: v for k, v in vals.items() if v is not None}
    out: dict[str, Any] = {"groups": {}, "paired": {}}
    names = [g for g in groups if per[g]]
    for g in names:
        st = clip_interval(mean_interval(list(per[g].values())), bounds_of(key))
        out["groups"][g] = st | {"values": {str(k): v for k, v in per[g].items()}}
    base = next(iter(groups))
    for g in names:
        if g != base and per.get(base):
            p = paired_difference(per[base], per[g])
            shared = [s for s in per[g] if s in per[base]]
            out["paired"][g] = p | {"identical": bool(shared) and all(same_value(per[base][s], per[g][s]) for s in shared)}
    return out


def bounds_of(key: str) -> tuple[float, float | None] | None:
    """The range a metric's values can take, in its unit: % values [0, 100]; lengths, steps, seconds,
    entropies and norms [0, inf); None for signed quantities (reward, loss)."""
    if unit_of(key) == "%":
        return (0.0, 100.0)
    if unit_of(key) in ("tokens", "steps", "s", "nats") or "norm" in key:
        return (0.0, None)
    return None


def clip_interval(st: dict[str, Any], bounds: tuple[float, float | None] | None) -> dict[str, Any]:
    """A mean's t interval cut to the metric's range, ``clipped`` saying whether an end moved.

    The t interval is symmetric by construction, so the mean of a few non-negative values near 0
    (a wall time, a rate) gets a negative low end. No mean of such values lies below 0: cutting the
    interval there drops only impossible values, so it covers the true mean exactly as often as
    before, in the same unit as the mean. A log-ratio interval would avoid the cut but estimate a
    geometric mean instead, and it fails on values of 0 (a silenced rate or an accuracy of 0)."""
    if bounds is None or st.get("low") is None:
        return st
    lo, hi = bounds
    low, high = max(st["low"], lo), st["high"] if hi is None else min(st["high"], hi)
    return st | {"low": low, "high": high, "clipped": (low, high) != (st["low"], st["high"])}


def seeded_summary(groups: dict[str, list[RunData]], training: dict[str, dict[str, float | None]],
                   tables: dict[str, Any]) -> dict[str, Any] | None:
    """Every number of the training and accuracy tables as mean and 95% t interval per group, and
    the paired difference of each group against the first; None when no group has two runs."""
    from stapo.evals.compare_stats import INTERVAL_NOTE

    if all(len(g) < 2 for g in groups.values()):
        return None
    out: dict[str, Any] = {"interval": INTERVAL_NOTE, "baseline": next(iter(groups)), "groups": {},
                           "identical_to_baseline": []}
    train_groups = {g: [r for r in m if r.label in training] for g, m in groups.items()}
    train_groups = {g: m for g, m in train_groups.items() if m}
    eval_groups = {g: [r for r in m if r.results is not None] for g, m in groups.items()}
    eval_groups = {g: m for g, m in eval_groups.items() if m}
    out["pairing"] = {}
    if train_groups:
        mode, keys = _pairing_keys(train_groups)
        out["pairing"]["training"] = mode
        out["identical_to_baseline"] = [g for b, g in identical_group_pairs(train_groups, keys) if b == out["baseline"]]
        metric_keys = list(next(iter(training.values())))
        out["training"] = {
            k: {"unit": unit_of(k)} | _seeded_metric(k, train_groups, lambda r, k=k: training[r.label].get(k), keys)
            for k in metric_keys
        }
    if eval_groups:
        mode, keys = _pairing_keys(eval_groups)
        out["pairing"]["eval"] = mode
        out["tables"] = {
            kind: {b: {"unit": "%"} | _seeded_metric("accuracy", eval_groups,
                                                    lambda r, kind=kind, b=b: tables[kind]["rows"][b].get(r.label), keys)
                   for b in tables[kind]["rows"]}
            for kind in KINDS
        }
    for g, members in groups.items():
        out["groups"][g] = {"runs": [r.label for r in members], "seeds": [run_seed(r) for r in members]}
    return out


# ----------------------------------------------------------------------------- fairness


def config_check(runs: Sequence[RunData], groups: dict[str, list[RunData]] | None = None) -> dict[str, Any]:
    """Each training run's config differences from a reference run's, and a warning if any is a confound.

    Without replicates the reference is the first training run. When a group holds several seeds of
    one method (``groups``), each run is checked against the baseline group's run with the same
    seed (else its first run), and seed keys are the replicate axis, listed under ``replicate``, not
    as confounds. ``{"baseline": label, "runs": {label: {"reference", "method", "execution",
    "replicate", "confounds"}}, "unchecked": [labels of training runs without config.yaml],
    "warning": str | None}``; each difference is ``{"key", "group", "base", "other"}``."""
    from stapo.core.fairness import config_differences

    train = [r for r in runs if "train" in r.kinds]
    with_cfg = [r for r in train if r.config is not None]
    out: dict[str, Any] = {"baseline": with_cfg[0].label if with_cfg else None, "runs": {},
                           "unchecked": [r.label for r in train if r.config is None], "warning": None,
                           "notes": s2t_notes(train, groups)}
    if not with_cfg:
        return out
    base = with_cfg[0]
    seeded = groups is not None and any(len(g) > 1 for g in groups.values())
    base_group = next((g for g in (groups or {}).values() if base in g), [base])
    by_seed = {run_seed(r): r for r in reversed(base_group) if r.config is not None}
    for r in with_cfg[1:]:
        ref = by_seed.get(run_seed(r), base) if seeded else base
        if ref is r:
            ref = base
        diffs = config_differences(ref.config or {}, r.config or {})

        def is_confound(d: Any) -> bool:
            return d.confound and not (seeded and d.group == "seed")

        out["runs"][r.label] = {"reference": ref.label} | {
            part: [{"key": d.key, "group": d.group, "base": d.base, "other": d.other} for d in diffs if pick(d)]
            for part, pick in (("method", lambda d: d.group == "method"),
                               ("execution", lambda d: d.group == "execution"),
                               ("replicate", lambda d: seeded and d.group == "seed"),
                               ("confounds", is_confound))
        }
    for r in train:
        trained = [c for c in r.config_changes if not c.endswith("(bookkeeping)")]
        if trained:
            out["notes"].append(f"{r.label} was resumed with other settings than its config.yaml: "
                                + "; ".join(trained) + ". Its steps before and after differ in more than the method.")
    if seeded and groups:
        for name, members in groups.items():
            cfgd = [r for r in members if r.config is not None]
            for r in cfgd[1:]:
                keys = [d.key for d in config_differences(cfgd[0].config or {}, r.config or {}) if d.group == "method"]
                if keys:
                    out["notes"].append(f"{r.label} is in group {name} but differs from {cfgd[0].label} in method keys "
                                        f"({', '.join(keys)}): a group's runs should be seeds of one method.")
    bad = {lab: v["confounds"] for lab, v in out["runs"].items() if v["confounds"]}
    if bad:
        groups = sorted({d["group"] for ds in bad.values() for d in ds})
        out["warning"] = (
            f"WARNING: the runs differ in more than the method ({', '.join(groups)}): "
            + "; ".join(f"{lab} vs {out['runs'][lab]['reference']}: " + ", ".join(f"{d['key']} {d['base']!r} -> {d['other']!r}" for d in ds)
                        for lab, ds in bad.items())
            + ". The comparison does not isolate the method; `stapo recipes matched A B` aligns two recipes."
        )
    return out


# ----------------------------------------------------------------------------- curves


def _series(run: RunData, key: str) -> tuple[list[float], list[float]]:
    """(steps, values in :func:`unit_of`'s unit) of one metric; validation accuracy prefers val.jsonl
    (it holds step 0)."""
    rows = run.val if key == "val/accuracy" and run.val else run.metrics
    src_key = "accuracy" if key == "val/accuracy" and run.val else key
    xs, ys = [], []
    for r in rows:
        y = _finite(r.get(src_key))
        x = _finite(r.get("step"))
        if y is not None and x is not None:
            xs.append(x)
            ys.append(in_unit(key, y))  # type: ignore[arg-type]
    return xs, ys


def _ema(ys: Sequence[float], alpha: float) -> list[float]:
    out, acc = [], None
    for y in ys:
        acc = y if acc is None else alpha * y + (1 - alpha) * acc
        out.append(acc)
    return out


def band(series: Sequence[tuple[list[float], list[float]]], bounds: tuple[float, float | None] | None = None,
         ) -> tuple[list[float], list[float], list[float], list[float]]:
    """(steps, mean, low, high) over seeds at every step that two or more runs logged (one run: its
    value, no band); low / high are the 95% t interval of the mean at that step, cut to ``bounds``
    (:func:`clip_interval`)."""
    from stapo.evals.compare_stats import mean_interval

    at: dict[float, list[float]] = {}
    for xs, ys in series:
        for x, y in zip(xs, ys, strict=True):
            at.setdefault(x, []).append(y)
    steps = sorted(at)
    stats = [clip_interval(mean_interval(at[x]), bounds) for x in steps]
    mean = [st["mean"] for st in stats]
    low = [st["low"] if st["low"] is not None else st["mean"] for st in stats]
    high = [st["high"] if st["high"] is not None else st["mean"] for st in stats]
    return steps, mean, low, high


def plot_curves(runs: Sequence[RunData], out_dir: Path, groups: dict[str, list[RunData]] | None = None) -> dict[str, Path]:
    """One PNG per metric that at least one run has; returns {metric key: png path}.

    With ``groups`` holding several seeds of a method, each group is one line (the mean over its
    seeds, EMA-smoothed per run first past 20 steps) inside a shaded 95% t band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    out_dir.mkdir(parents=True, exist_ok=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    written: dict[str, Path] = {}
    seeded = groups is not None and any(len(g) > 1 for g in groups.values())
    lines = (list(groups.items()) if seeded and groups else [(r.label, [r]) for r in runs])
    for key, title in CURVES:
        per_line = [(name, [_series(r, key) for r in members]) for name, members in lines]
        if not any(xs for _, ss in per_line for xs, _ in ss):
            continue
        fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=110)
        for i, (name, ss) in enumerate(per_line):
            ss = [(xs, ys) for xs, ys in ss if xs]
            if not ss:
                continue
            c = colors[i % len(colors)]
            smooth = max(len(xs) for xs, _ in ss) > 20 and key != "val/accuracy"
            if len(ss) > 1:
                steps, mean, low, high = band([(xs, _ema(ys, 0.15) if smooth else ys) for xs, ys in ss], bounds_of(key))
                ax.fill_between(steps, low, high, color=c, alpha=0.2, linewidth=0)
                ax.plot(steps, mean, color=c, linewidth=1.8, marker="o" if len(steps) <= 20 else None, markersize=3,
                        label=f"{name} (mean of {len(ss)}, 95% band)")
                continue
            ((xs, ys),) = ss
            if smooth:
                ax.plot(xs, ys, color=c, alpha=0.25, linewidth=0.8)
                ax.plot(xs, _ema(ys, 0.15), color=c, linewidth=1.8, label=name)
            else:
                ax.plot(xs, ys, color=c, linewidth=1.8, marker="o" if len(xs) <= 20 else None, markersize=3,
                        label=name)
        ax.set_title(title, fontsize=11)
        ax.set_xlabel("RL step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole: no tick at 1.5
        ax.set_ylabel(labelled(key))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, frameon=False)
        fig.tight_layout()
        path = out_dir / (key.replace("/", "_") + ".png")
        fig.savefig(path)
        plt.close(fig)
        written[key] = path
    return written


# ----------------------------------------------------------------------------- report


def compare_runs(paths: Sequence[Path], *, out_dir: Path, labels: Sequence[str] | None = None,
                 groups: Sequence[str] | None = None) -> dict[str, Any]:
    """Load the runs, write ``compare.json``, ``curves/*.png`` and ``report.html``; return the JSON object.

    ``groups`` names each run's method (``--group``); without it, seeds of one recipe group by
    themselves (:func:`group_runs`)."""
    if not paths:
        raise ValueError("compare: give at least one run dir")
    labs = list(labels) if labels else _labels(paths)
    if len(labs) != len(paths):
        raise ValueError(f"compare: {len(labs)} labels for {len(paths)} runs")
    runs = [load_run(Path(p), lab) for p, lab in zip(paths, labs, strict=True)]
    grouped = group_runs(runs, list(groups) if groups else None)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tables = accuracy_tables(runs)
    train_runs = [r for r in runs if "train" in r.kinds]
    training = {r.label: {k: in_unit(k, v) for k, v in training_summary(r).items()} for r in train_runs}
    train_groups = {g: [r for r in m if "train" in r.kinds] for g, m in grouped.items()}
    train_groups = {g: m for g, m in train_groups.items() if m}
    pngs = plot_curves(train_runs, out_dir / "curves", train_groups) if train_runs else {}
    report = {
        "baseline": runs[0].label,
        "units": {"accuracy tables": "%", "deltas of % values": "percentage points",
                  **{k: unit_of(k) for k in (next(iter(training.values())) if training else {})}},
        "runs": [
            {"label": r.label, "path": str(r.path), "kinds": r.kinds, "algorithm": r.algorithm,
             "model": (r.results or {}).get("model"), "seed": run_seed(r), "config_changes": r.config_changes,
             "group": next(g for g, m in grouped.items() if r in m)}
            for r in runs
        ],
        "tables": tables,
        "training": training,
        "seeded": seeded_summary(grouped, training, tables),
        "curves": {k: str(p.relative_to(out_dir)) for k, p in pngs.items()},
        "config_check": config_check(runs, grouped),
        "val_resolution": val_resolution(train_runs),
    }
    report["conclusion"] = conclusion(report["seeded"], len(grouped))
    (out_dir / "compare.json").write_text(json.dumps(report, indent=2))
    (out_dir / "report.html").write_text(render_html(report, runs, pngs), encoding="utf-8")
    return report


def fmt_value(key: str, v: float | None) -> str:
    """A value in its unit: accuracies 1 decimal, other % values and the rest 3-4 significant
    digits in fixed notation (a 0.0123 % silenced rate never rounds to 0.00)."""
    if v is None:
        return "–"
    if unit_of(key) == "%" and "accuracy" in key:
        return f"{v:.1f}"
    if unit_of(key) == "steps":
        return f"{v:.0f}"
    return _sig(v, 3 if unit_of(key) == "%" else 4)


def fmt_signed(key: str, d: float | None) -> str:
    """A difference in the value's unit (percentage points for % values), with its sign."""
    if d is None:
        return ""
    if unit_of(key) == "%" and "accuracy" in key:
        return f"{d:+.1f}"
    return ("+" if d > 0 else "") + _sig(d, 3)


def _sig(v: float, digits: int) -> str:
    """``digits`` significant digits in fixed notation: 2.0833 -> 2.08, 0.012345 -> 0.0123, 156.2 -> 156."""
    if v == 0 or not math.isfinite(v):
        return f"{v:g}"
    if abs(v) >= 10 ** digits:
        return f"{v:.0f}"
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(v))))
    return f"{v:.{decimals}f}"


def _interval_txt(key: str, st: dict[str, Any]) -> str:
    """``52.5 [48.1, 56.9] n=4``; one run: its value and ``n=1``."""
    if st.get("mean") is None:
        return "–"
    ci = f" [{fmt_value(key, st['low'])}, {fmt_value(key, st['high'])}]" if st.get("low") is not None else ""
    return f"{fmt_value(key, st['mean'])}{ci} n={st['n']}"


def _better_up(key: str) -> bool:
    """Metrics where a higher value is a win (accuracy, reward)."""
    return "accuracy" in key or key.startswith(("reward", "final reward"))


def _paired_txt(key: str, p: dict[str, Any]) -> str:
    """``Δ +2.5 [0.4, 4.6], wins 4/4`` (accuracy, reward) or ``higher in 1/4`` (other metrics);
    ``identical in 3/3 pairs`` when every pair agrees to 4 significant digits."""
    if p.get("mean") is None:
        return "Δ – (no shared seed)"
    if p.get("identical"):
        return f"identical in {p['n']}/{p['n']} pairs"
    ci = f" [{fmt_signed(key, p['low'])}, {fmt_signed(key, p['high'])}]" if p.get("low") is not None else ""
    count = f"wins {p['n_higher']}/{p['n']}" if _better_up(key) else f"higher in {p['n_higher']}/{p['n']}"
    return f"Δ {fmt_signed(key, p['mean'])}{ci}, {count}"


def _seeded_sources(seeded: dict[str, Any]) -> list[tuple[str, str, dict[str, Any], str]]:
    """(row label, metric key, seeded metric, "eval" | "training") of the seeded summary's rows:
    accuracy tables' avg@k first, then training."""
    sources = [(f"avg@k {b} (%)", "accuracy", m, "eval") for b, m in (seeded.get("tables") or {}).get("avg", {}).items()]
    return sources + [(labelled(k), k, m, "training") for k, m in (seeded.get("training") or {}).items()]


def seeded_rows(seeded: dict[str, Any]) -> tuple[list[str], list[tuple[str, list[tuple[str, str]]]]]:
    """(group names, [(row label, [(value text, paired text) per group])]) of the seeded summary, the
    rows the HTML report prints."""
    names = list(seeded["groups"])
    rows: list[tuple[str, list[tuple[str, str]]]] = []
    for label, key, m, _ in _seeded_sources(seeded):
        if not m["groups"]:
            continue  # no run of any group logged it
        cells = []
        for g in names:
            st = m["groups"].get(g)
            p = m["paired"].get(g)
            cells.append((_interval_txt(key, st) if st else "–", _paired_txt(key, p) if p else ""))
        rows.append((label, cells))
    return names, rows


# ----------------------------------------------------------------------------- conclusion


def conclusion(seeded: dict[str, Any] | None, n_train_groups: int = 0) -> list[dict[str, Any]]:
    """The verdict of every group against the baseline group, metric by metric, as items with a
    ``text``: which group is ahead (accuracy, reward) or higher (other metrics), by how much, the
    95% t interval of the paired difference and whether it excludes 0. A group identical to the
    baseline seed by seed is one item; metrics identical in every pair are one item per group.
    Without seeds (no group of two runs) one item says that no interval can be given."""
    if seeded is None:
        if n_train_groups < 2:
            return []
        return [{"verdict": "no seeds", "text": "one run per method, so no interval and no conclusion: a single pair "
                 "of RL runs cannot separate the method from the seed; train 3 or more seeds of each and compare "
                 "them grouped (docs/evaluation.md, \"Comparing methods over seeds\")."}]
    base = seeded["baseline"]
    same = seeded.get("identical_to_baseline") or []
    sources = _seeded_sources(seeded)
    items: list[dict[str, Any]] = []
    for g in seeded["groups"]:
        if g == base:
            continue
        if g in same:
            n = len(seeded["groups"][g]["runs"])
            items.append({"group": g, "baseline": base, "metric": None, "verdict": "identical",
                          "text": f"{g} vs {base}: identical runs in all {n} pairs (every logged metric equal to 4 "
                                  "significant digits, timings aside): the method changed nothing here, so there "
                                  "is nothing to conclude."})
            continue
        level = []
        for label, key, m, part in sources:
            p = m["paired"].get(g)
            if not p or p.get("mean") is None:
                continue
            if p.get("identical"):
                level.append(label)
                continue
            items.append(_verdict(g, base, label, key, p, (seeded.get("pairing") or {}).get(part, "seed")))
        if level:
            items.append({"group": g, "baseline": base, "metric": level, "verdict": "identical",
                          "text": f"{g} vs {base}, identical in every pair: {', '.join(level)}."})
    return items


def _verdict(g: str, base: str, label: str, key: str, p: dict[str, Any], pairing: str) -> dict[str, Any]:
    """One metric's verdict from its paired difference ``p`` (group ``g`` minus ``base``)."""
    up, d = _better_up(key), p["mean"]
    word = ("ahead" if up else "higher") if d > 0 else ("behind" if up else "lower") if d < 0 else "level"
    unit = {"%": " points", "": ""}.get(unit_of(key), f" {unit_of(key)}")
    n = p["n"]
    pairs = f"{n} paired seed{'s' if n != 1 else ''}" if pairing == "seed" else f"{n} pairs (by order)"
    head = f"{g} vs {base}, {label}: " + (f"{g} {word} by {fmt_signed(key, abs(d)).lstrip('+')}{unit}" if d else "level on average")
    out = {"group": g, "baseline": base, "metric": label, "mean": d, "low": p.get("low"), "high": p.get("high"),
           "n": n, "excludes_zero": None}
    if p.get("low") is None:
        return out | {"verdict": "no interval", "text": f"{head}, over {pairs}: one pair gives no interval, "
                                                         "no difference shown."}
    excludes = p["low"] > 0 or p["high"] < 0
    ci = f"95% CI [{fmt_signed(key, p['low'])}, {fmt_signed(key, p['high'])}]"
    verdict = f"{g} {word}" if excludes else "no difference shown"
    return out | {"excludes_zero": excludes, "verdict": verdict,
                  "text": f"{head}, {ci} {'excludes' if excludes else 'includes'} 0 over {pairs}: {verdict}."}


SMALL_VAL_STEP = 5.0
"""Points of validation accuracy one prompt is worth, from which compare warns (20 prompts or fewer)."""


def val_resolution(runs: Sequence[RunData]) -> dict[str, Any] | None:
    """The validation set's size (prompts, one greedy sample each: the last ``n`` of ``val.jsonl``,
    the smallest over runs) and the step in points its accuracy moves by, with a warning when one
    prompt is worth :data:`SMALL_VAL_STEP` points or more; None without validation rows."""
    sizes = [int(r.val[-1]["n"]) for r in runs if r.val and isinstance(r.val[-1].get("n"), (int, float))
             and r.val[-1]["n"] > 0]
    if not sizes:
        return None
    n = min(sizes)
    step = 100.0 / n
    warning = None
    if step >= SMALL_VAL_STEP:
        warning = (f"validation set of {n} prompt{'s' if n != 1 else ''}: validation accuracy moves in steps of "
                   f"{step:.3g} points, so one prompt flips a run by {step:.3g} points and a smaller effect cannot "
                   "show; `--set data.val_size=200` gives steps of 0.5 points.")
    return {"prompts": n, "step_points": step, "warning": warning}


def _delta_cell(key: str, d: float | None, *, colored: bool = True) -> str:
    """`` (+1.3)`` in green / red for accuracies (up is better); muted where up is not better."""
    if d is None:
        return ""
    cls = ("pos" if d > 0 else "neg" if d < 0 else "muted") if colored else "muted"
    return f' <span class="{cls}">({esc(fmt_signed(key, d))})</span>'


def render_html(report: dict[str, Any], runs: Sequence[RunData], pngs: dict[str, Path]) -> str:
    """The report page: run list, seeded summary, accuracy tables (value and delta per cell),
    training table, curves."""
    base = report["baseline"]
    parts = []
    run_rows = [
        [esc(r["label"]) + (" <b>(baseline)</b>" if r["label"] == base else ""), esc(r["group"]),
         esc("" if r["seed"] is None else r["seed"]), esc(", ".join(r["kinds"])),
         esc(r["algorithm"] or ""), esc(r["model"] or ""), esc(r["path"])]
        for r in report["runs"]
    ]
    parts.append(section("Runs", html_table(["run", "group", "seed", "kind", "algorithm", "model", "path"], run_rows,
                                            raw=True, left_cols=7)))
    parts.insert(0, _config_check_html(report["config_check"]))
    res = report.get("val_resolution") or {}
    if report.get("conclusion") or res.get("warning"):
        lines = "".join(f"<li>{esc(it['text'])}</li>" for it in report.get("conclusion") or [])
        warn = (f'<p class="val-warning" style="background:#fff4d6;border:1px solid #b58a00;padding:6px">'
                f'{esc(res["warning"])}</p>' if res.get("warning") else "")
        parts.append(section("Conclusion", warn + (f'<ul id="conclusion">{lines}</ul>' if lines else "")))
    seeded = report.get("seeded")
    if seeded:
        names, rows = seeded_rows(seeded)
        cells = [[esc(label)] + [esc(v) + (f'<br><span class="muted">{esc(p)}</span>' if p else "") for v, p in cs]
                 for label, cs in rows]
        pairing = ", ".join(f"{k}: by {v}" for k, v in seeded["pairing"].items())
        note = (f'<p class="meta">Each cell: mean over the group\'s runs, {esc(seeded["interval"])}; n = runs. '
                f"Δ = the paired difference against <b>{esc(seeded['baseline'])}</b> (mean and 95% t interval of the "
                f"per-seed differences; pairs {esc(pairing)}) and how many pairs are higher. Values in the unit "
                "each row names; differences of % values in percentage points.</p>")
        parts.append(section("Over seeds", note + html_table(["", *names], cells, raw=True, table_id="table-seeded")))
    tables = report["tables"]
    if tables["avg"]["columns"]:
        names_k = {"avg": "avg@k (mean accuracy over k samples, %)", "pass": "pass@k (unbiased, %)",
                   "maj": "maj@k (majority vote, %)"}
        for kind in KINDS:
            t = tables[kind]
            rows_html = []
            for bench, vals in t["rows"].items():
                ks = {k for k in t["k"].get(bench, {}).values() if k}
                k_txt = f"{kind}@{ks.pop()}" if len(ks) == 1 else (f"{kind}@k (k differs)" if ks else "")
                row = [f"{esc(bench)}" + (f' <span class="muted">{esc(k_txt)}</span>' if k_txt else "")]
                for lab in t["columns"]:
                    v = vals.get(lab)
                    d = t["delta"].get(bench, {}).get(lab)
                    row.append(esc(fmt_value("accuracy", v)) + _delta_cell("accuracy", d))
                rows_html.append(row)
            note = (f'<p class="meta">Accuracy in %, deltas in percentage points against <b>{esc(base)}</b>. '
                    f"Avg. = mean over the benchmarks every run has: {esc(', '.join(tables['common_benchmarks']))}.</p>")
            parts.append(section(names_k[kind], note + html_table(["benchmark", *t["columns"]], rows_html, raw=True,
                                                                 table_id=f"table-{kind}")))
    if report["training"]:
        labels = list(report["training"])
        keys = list(next(iter(report["training"].values())))
        rows_html = []
        for key in keys:
            row = [esc(labelled(key))]
            b = report["training"][labels[0]].get(key)
            for lab in labels:
                v = report["training"][lab].get(key)
                d = (v - b) if (unit_of(key) == "%" and v is not None and b is not None and lab != labels[0]) else None
                row.append(esc(fmt_value(key, v)) + _delta_cell(key, d, colored="accuracy" in key))
            rows_html.append(row)
        parts.append(section(
            "Training runs",
            f'<p class="meta">Each row in the unit it names (% for accuracies, fractions and rates); deltas of % '
            f'values in percentage points against <b>{esc(labels[0])}</b> (the first training run); "final" = '
            "mean over the last 10% of steps.</p>"
            + html_table(["", *labels], rows_html, raw=True, table_id="table-training"),
        ))
    if pngs:
        figs = "".join(
            f"<figure>{img_tag(p, key)}<figcaption>{esc(labelled(key))}</figcaption></figure>" for key, p in pngs.items()
        )
        parts.append(section("Training curves", f'<div class="grid">{figs}</div>'))
    return html_page("stapo compare", parts, subtitle=f"{len(runs)} runs, baseline {base}")


def _config_check_html(check: dict[str, Any]) -> str:
    """The fairness section: a red warning box with the confounds, or a one-line all-clear; then every difference."""
    rows = [[esc(lab), esc(d["group"]) + (" <b>(confound)</b>" if part == "confounds" else ""), esc(d["key"]),
             esc(repr(d["base"])), esc(repr(d["other"]))]
            for lab, v in check["runs"].items() for part in ("confounds", "method", "execution", "replicate")
            for d in v.get(part, [])]
    if check["warning"]:
        head = f'<p id="confound-warning" style="background:#fde7e7;border:2px solid #b3261e;color:#8c1d18;padding:8px"><b>{esc(check["warning"])}</b></p>'
    elif check["runs"]:
        head = (f'<p id="config-check" class="meta">The training runs differ from <b>{esc(check["baseline"])}</b> '
                "in method keys only (execution keys do not change the objective; seeds of one group are its "
                "replicates).</p>")
    else:
        head = '<p id="config-check" class="meta">One training run with a config.yaml: nothing to check.</p>'
    for note in check.get("notes", []):
        head += f'<p class="s2t-note" style="background:#fff4d6;border:1px solid #b58a00;padding:6px">{esc(note)}</p>'
    if check["unchecked"]:
        head += f'<p class="meta">Not checked (no config.yaml): {esc(", ".join(check["unchecked"]))}.</p>'
    table = (html_table(["run", "group", "key", f"{check['baseline']} (baseline)", "run's value"], rows, raw=True,
                        left_cols=5, table_id="table-config") if rows else "")
    return section("Is the comparison fair?", head + table)


def terminal_tables(report: dict[str, Any], width: int = 80) -> list[Any]:
    """What the terminal prints before the conclusion, each part at most ``width`` columns: the
    confound table, the notes, the seeded summary (one row per metric and group), avg@k with deltas
    and the per-run training table, both split into as many tables as their columns need."""
    from rich.table import Table
    from rich.text import Text

    out: list[Any] = []
    check = report["config_check"]
    if check["warning"]:
        table = Table(title="[bold red]WARNING: the runs differ in more than the method[/]", title_justify="left",
                      width=min(width, 120))
        for col in ("run", "group", "key", "baseline", "run"):
            table.add_column(col, overflow="fold")
        for lab, v in check["runs"].items():
            for d in v["confounds"]:
                table.add_row(lab, d["group"], d["key"], repr(d["base"]), repr(d["other"]))
        out.append(table)
    for note in check.get("notes", []):
        out.append(Text("note: " + note, style="bold yellow"))
    base = report["baseline"]
    if report.get("seeded"):
        out.append(Text("\n".join(seeded_lines(report["seeded"], width))))
    t = report["tables"]["avg"]
    if t["columns"]:
        deltas = f"deltas vs {base} in points" if base in t["columns"] else f"no deltas: the baseline {base} has no eval results"
        rows = []
        for bench, vals in t["rows"].items():
            cells = []
            for lab in t["columns"]:
                d = t["delta"].get(bench, {}).get(lab)
                color = "green" if (d or 0) > 0 else "red" if (d or 0) < 0 else "dim"
                cells.append(fmt_value("accuracy", vals.get(lab))
                             + (f" [{color}]({fmt_signed('accuracy', d)})[/]" if d is not None else ""))
            rows.append((bench, cells))
        out += fitted_tables(f"avg@k (%) — {deltas}", t["columns"], rows, width)
    if report["training"]:
        labels = list(report["training"])
        confounded = " [bold red](CONFOUNDED: see the warning above)[/]" if check["warning"] else ""
        rows = [(labelled(key), [fmt_value(key, report["training"][lab].get(key)) for lab in labels])
                for key in next(iter(report["training"].values()))]
        out += fitted_tables(f"training runs (each row in the unit it names){confounded}", labels, rows, width)
    return out


def conclusion_text(report: dict[str, Any], width: int = 80) -> str:
    """The block compare ends with: the validation-size warning, then one verdict per line, wrapped
    to ``width`` with an indent under its first line."""
    import textwrap

    items = report.get("conclusion") or []
    warning = (report.get("val_resolution") or {}).get("warning")
    if not items and not warning:
        return ""
    seeded = report.get("seeded") or {}
    confounded = " (CONFOUNDED: see the warning above)" if report["config_check"]["warning"] else ""
    head = (f"conclusion: each group against {seeded['baseline']}, paired by seed, mean difference and its 95% t "
            f"interval{confounded}" if seeded else f"conclusion{confounded}")
    lines = textwrap.wrap(head, width, break_on_hyphens=False)  # names such as stapo-random stay whole
    for text in ([f"warning: {warning}"] if warning else []) + [it["text"] for it in items]:
        lines += textwrap.wrap(text, width, initial_indent="- ", subsequent_indent="  ", break_on_hyphens=False)
    return "\n".join(lines)


LEGEND_AFTER = 16
"""Group names longer than this are shown as a letter key, with a legend, in the seeded summary."""


def seeded_lines(seeded: dict[str, Any], width: int = 80) -> list[str]:
    """The seeded summary as text at most ``width`` wide: per metric a heading line, then one line
    per group (mean [interval] n, and the paired difference against the baseline, moved to its own
    line when both do not fit). Groups identical to the baseline seed by seed are named once and
    shown as the baseline; names longer than :data:`LEGEND_AFTER` get a letter key and a legend."""
    import textwrap

    base = seeded["baseline"]
    same = seeded.get("identical_to_baseline") or []
    shown = [g for g in seeded["groups"] if g not in same]
    keyed = any(len(g) > LEGEND_AFTER for g in shown)
    names = {g: (chr(ord("A") + i) if keyed else g) for i, g in enumerate(shown)}
    head = [f"over seeds: mean [95% t interval, cut to the metric's range] n=runs; Δ = paired difference vs "
            f"{names[base]} by seed"]
    if keyed:
        head.append("groups: " + ", ".join(f"{k} = {g}" for g, k in names.items()))
    if same:
        head.append(f"{', '.join(same)}: identical to {base} run by run (timings aside), shown once as {base}.")
    lines = [w for h in head for w in textwrap.wrap(h, width, break_on_hyphens=False)]
    col = max(len(n) for n in names.values())
    for label, key, m, _ in _seeded_sources(seeded):
        rows = []
        for g in shown:
            st, p = m["groups"].get(g), m["paired"].get(g)
            if st is None:
                continue
            line = f"  {names[g]:<{col}}  {_interval_txt(key, st)}"
            d = _paired_txt(key, p) if p else ""
            if d and len(line) + 2 + len(d) > width:
                rows.append(line)
                line = " " * (4 + col)
            rows.append(f"{line}  {d}".rstrip() if d else line)
        if rows:
            lines += [label, *rows]
    return lines


def fitted_tables(title: str, columns: Sequence[str], rows: Sequence[tuple[str, Sequence[str]]],
                  width: int = 80) -> list[Any]:
    """Rich tables of one label column and the value ``columns``, split into as many tables as it
    takes to keep each within ``width`` (a long row label puts its unit on a second line when the
    columns do not all fit): each column is as wide as its widest value (at least 6),
    its header wrapped at ``-``, ``_``, ``/`` onto up to 3 lines of that width; a header that needs
    more is shown as a number, with a legend line under the table. Cells may hold rich markup."""
    from rich.table import Table
    from rich.text import Text

    def plain(cell: str) -> int:
        return max((Text.from_markup(x).cell_len for x in cell.split("\n")), default=0)

    widths, heads, legend = [], [], []
    for j, c in enumerate(columns):
        w = max([6] + [plain(cells[j]) for _, cells in rows])
        wrapped = wrap_name(c, w)
        if len(wrapped) > 3:
            wrapped = [f"[{len(legend) + 1}]"]
            legend.append(f"[{len(legend) + 1}] {c}")
        widths.append(w)
        heads.append("\n".join(wrapped))
    labels = [lab for lab, _ in rows]
    if max(map(plain, labels), default=1) + 4 + sum(w + 3 for w in widths) > width:  # the unit onto a line of its own
        labels = [lab if len(lab) <= 24 or " (" not in lab else lab.replace(" (", "\n(", 1) for lab in labels]
    label_w = min(max(map(plain, labels), default=1), max(10, width // 3))
    chunks: list[list[int]] = [[]]
    used = label_w + 4  # "│ label │": 2 borders, 2 padding
    for j, w in enumerate(widths):
        if chunks[-1] and used + w + 3 > width:
            chunks.append([])
            used = label_w + 4
        chunks[-1].append(j)
        used += w + 3
    out: list[Any] = []
    for i, js in enumerate(chunks):
        part = f", part {i + 1} of {len(chunks)}" if len(chunks) > 1 else ""
        out.append(Text.from_markup(title + part))  # a line of its own: a table's title wraps at its width
        table = Table()
        table.add_column("", min_width=label_w, max_width=label_w, overflow="fold")
        for j in js:
            table.add_column(heads[j], justify="right", min_width=widths[j], max_width=widths[j], no_wrap=True)
        for lab, (_, cells) in zip(labels, rows, strict=True):
            table.add_row(lab, *[cells[j] for j in js])
        out.append(table)
    if legend:
        out.append(Text("columns: " + ", ".join(legend)))
    return out


def wrap_name(name: str, w: int) -> list[str]:
    """``name`` in lines of at most ``w`` characters, broken after ``-``, ``_``, ``/``, ``.`` or a
    space where it can, else cut."""
    import re

    lines = [""]
    for part in re.findall(r"[^-_/. ]*[-_/. ]?", name):
        while part:
            room = w - len(lines[-1])
            if len(part) <= room:
                lines[-1] += part
                part = ""
            elif lines[-1]:
                lines.append("")
            else:
                lines[-1], part = part[:w], part[w:]
                lines.append("")
    return [x for x in lines if x]
