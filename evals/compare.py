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
from stapo.evals.report import esc, fmt_delta, fmt_num, fmt_pct, html_page, html_table, img_tag, section

__all__ = ["RunData", "CURVES", "load_run", "compare_runs", "terminal_tables"]

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
    if not run.kinds:
        raise ValueError(
            f"compare: {path} has none of results.json (eval dir) or metrics.jsonl / val.jsonl / summary.json "
            "(training run dir)"
        )
    return run


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

    Values are fractions in [0, 1]; deltas are value - baseline (the first run that has the
    benchmark is not assumed: the baseline is always the first run, and a missing baseline value
    gives no delta). The ``Avg.`` row is the mean over benchmarks that every eval run has.
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
                rows[b][r.label] = metric_value(m, kind) if m else None
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
            if not (isinstance(x, (int, float)) and isinstance(y, (int, float))
                    and math.isclose(x, y, rel_tol=rel, abs_tol=abs_)):
                return False
    return True


def s2t_notes(runs: Sequence[RunData]) -> list[str]:
    """Plain sentences for the fairness box: runs whose S2T mask never fired, and pairs of runs whose
    metrics are identical (the method changed nothing the run measured)."""
    notes = []
    for r in runs:
        alg = (r.config or {}).get("algorithm") or {}
        if alg.get("token_weighting") == "s2t" and r.metrics and silenced_rate(r) == 0:
            tokens = sum(_finite(m.get("tokens/valid")) or 0.0 for m in r.metrics)
            notes.append(f"S2T never fired in {r.label}: 0 tokens silenced over {len(r.metrics)} steps "
                         f"({tokens:,.0f} response tokens), so its update is the same objective without the mask; "
                         "`stapo calibrate` measures the rate its thresholds give on this model.")
    for i, a in enumerate(runs):
        for b in runs[i + 1:]:
            if identical_metrics(a, b):
                notes.append(f"{a.label} and {b.label} logged identical metrics at every step (to 4 significant "
                             "digits, timings aside): here the methods did not differ in effect.")
    return notes


# ----------------------------------------------------------------------------- fairness


def config_check(runs: Sequence[RunData]) -> dict[str, Any]:
    """Each training run's config differences from the first training run's, and a warning if any is a confound.

    ``{"baseline": label, "runs": {label: {"method": [...], "execution": [...], "confounds": [...]}},
    "unchecked": [labels of training runs without config.yaml], "warning": str | None}``; each
    difference is ``{"key", "group", "base", "other"}``."""
    from stapo.core.fairness import config_differences

    train = [r for r in runs if "train" in r.kinds]
    with_cfg = [r for r in train if r.config is not None]
    out: dict[str, Any] = {"baseline": with_cfg[0].label if with_cfg else None, "runs": {},
                           "unchecked": [r.label for r in train if r.config is None], "warning": None,
                           "notes": s2t_notes(train)}
    if not with_cfg:
        return out
    base = with_cfg[0]
    for r in with_cfg[1:]:
        diffs = config_differences(base.config or {}, r.config or {})
        out["runs"][r.label] = {
            part: [{"key": d.key, "group": d.group, "base": d.base, "other": d.other} for d in diffs if pick(d)]
            for part, pick in (("method", lambda d: d.group == "method"),
                               ("execution", lambda d: d.group == "execution"),
                               ("confounds", lambda d: d.confound))
        }
    bad = {lab: v["confounds"] for lab, v in out["runs"].items() if v["confounds"]}
    if bad:
        groups = sorted({d["group"] for ds in bad.values() for d in ds})
        out["warning"] = (
            f"WARNING: the runs differ in more than the method ({', '.join(groups)}): "
            + "; ".join(f"{lab} vs {base.label}: " + ", ".join(f"{d['key']} {d['base']!r} -> {d['other']!r}" for d in ds)
                        for lab, ds in bad.items())
            + ". The comparison does not isolate the method; `stapo recipes matched A B` aligns two recipes."
        )
    return out


# ----------------------------------------------------------------------------- curves


def _series(run: RunData, key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of one metric; validation accuracy prefers val.jsonl (it holds step 0)."""
    rows = run.val if key == "val/accuracy" and run.val else run.metrics
    src_key = "accuracy" if key == "val/accuracy" and run.val else key
    xs, ys = [], []
    for r in rows:
        y = _finite(r.get(src_key))
        x = _finite(r.get("step"))
        if y is not None and x is not None:
            xs.append(x)
            ys.append(y)
    return xs, ys


def _ema(ys: Sequence[float], alpha: float) -> list[float]:
    out, acc = [], None
    for y in ys:
        acc = y if acc is None else alpha * y + (1 - alpha) * acc
        out.append(acc)
    return out


def plot_curves(runs: Sequence[RunData], out_dir: Path) -> dict[str, Path]:
    """One PNG per metric that at least one run has; returns {metric key: png path}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    written: dict[str, Path] = {}
    for key, title in CURVES:
        series = [(r, *_series(r, key)) for r in runs]
        if not any(xs for _, xs, _ in series):
            continue
        fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=110)
        for i, (r, xs, ys) in enumerate(series):
            if not xs:
                continue
            c = colors[i % len(colors)]
            if len(xs) > 20 and key != "val/accuracy":
                ax.plot(xs, ys, color=c, alpha=0.25, linewidth=0.8)
                ax.plot(xs, _ema(ys, 0.15), color=c, linewidth=1.8, label=r.label)
            else:
                ax.plot(xs, ys, color=c, linewidth=1.8, marker="o" if len(xs) <= 20 else None, markersize=3,
                        label=r.label)
        ax.set_title(title, fontsize=11)
        ax.set_xlabel("RL step")
        ax.set_ylabel(key)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, frameon=False)
        fig.tight_layout()
        path = out_dir / (key.replace("/", "_") + ".png")
        fig.savefig(path)
        plt.close(fig)
        written[key] = path
    return written


# ----------------------------------------------------------------------------- report


def compare_runs(paths: Sequence[Path], *, out_dir: Path, labels: Sequence[str] | None = None) -> dict[str, Any]:
    """Load the runs, write ``compare.json``, ``curves/*.png`` and ``report.html``; return the JSON object."""
    if not paths:
        raise ValueError("compare: give at least one run dir")
    labs = list(labels) if labels else _labels(paths)
    if len(labs) != len(paths):
        raise ValueError(f"compare: {len(labs)} labels for {len(paths)} runs")
    runs = [load_run(Path(p), lab) for p, lab in zip(paths, labs, strict=True)]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tables = accuracy_tables(runs)
    train_runs = [r for r in runs if "train" in r.kinds]
    training = {r.label: training_summary(r) for r in train_runs}
    pngs = plot_curves(train_runs, out_dir / "curves") if train_runs else {}
    report = {
        "baseline": runs[0].label,
        "runs": [
            {"label": r.label, "path": str(r.path), "kinds": r.kinds, "algorithm": r.algorithm,
             "model": (r.results or {}).get("model")}
            for r in runs
        ],
        "tables": tables,
        "training": training,
        "curves": {k: str(p.relative_to(out_dir)) for k, p in pngs.items()},
        "config_check": config_check(runs),
    }
    (out_dir / "compare.json").write_text(json.dumps(report, indent=2))
    (out_dir / "report.html").write_text(render_html(report, runs, pngs), encoding="utf-8")
    return report


def _delta_cell(d: float | None, *, colored: bool = True) -> str:
    """`` (+1.3)`` in green / red for accuracies (up is better); muted where up is not better."""
    if d is None:
        return ""
    cls = ("pos" if d > 0 else "neg" if d < 0 else "muted") if colored else "muted"
    return f' <span class="{cls}">({esc(fmt_delta(d))})</span>'


def _is_pct(key: str) -> bool:
    return "accuracy" in key or "frac" in key


def _train_fmt(key: str, v: float | None) -> str:
    """Accuracies in % (1 decimal), fractions in % (2 decimals: silenced shares are small), else 4 digits."""
    if v is None:
        return "–"
    if key == "silenced_rate":  # a rate near 1e-4: scientific, never a rounded 0.00%
        return f"{v:.2e}"
    if _is_pct(key):
        return fmt_pct(v, 2 if "frac" in key else 1)
    return fmt_num(v, 4)


def render_html(report: dict[str, Any], runs: Sequence[RunData], pngs: dict[str, Path]) -> str:
    """The report page: run list, accuracy tables (value and delta per cell), training table, curves."""
    base = report["baseline"]
    parts = []
    run_rows = [
        [esc(r["label"]) + (" <b>(baseline)</b>" if r["label"] == base else ""), esc(", ".join(r["kinds"])),
         esc(r["algorithm"] or ""), esc(r["model"] or ""), esc(r["path"])]
        for r in report["runs"]
    ]
    parts.append(section("Runs", html_table(["run", "kind", "algorithm", "model", "path"], run_rows, raw=True,
                                            left_cols=5)))
    parts.insert(0, _config_check_html(report["config_check"]))
    tables = report["tables"]
    if tables["avg"]["columns"]:
        names = {"avg": "avg@k (mean accuracy over k samples, %)", "pass": "pass@k (unbiased, %)",
                 "maj": "maj@k (majority vote, %)"}
        for kind in KINDS:
            t = tables[kind]
            rows = []
            for bench, vals in t["rows"].items():
                ks = {k for k in t["k"].get(bench, {}).values() if k}
                k_txt = f"{kind}@{ks.pop()}" if len(ks) == 1 else (f"{kind}@k (k differs)" if ks else "")
                cells = [f"{esc(bench)}" + (f' <span class="muted">{esc(k_txt)}</span>' if k_txt else "")]
                for lab in t["columns"]:
                    v = vals.get(lab)
                    d = t["delta"].get(bench, {}).get(lab)
                    cells.append(esc(fmt_pct(v)) + _delta_cell(d))
                rows.append(cells)
            note = (f'<p class="meta">Deltas in percentage points against <b>{esc(base)}</b>. '
                    f"Avg. = mean over the benchmarks every run has: {esc(', '.join(tables['common_benchmarks']))}.</p>")
            parts.append(section(names[kind], note + html_table(["benchmark", *t["columns"]], rows, raw=True,
                                                               table_id=f"table-{kind}")))
    if report["training"]:
        labels = list(report["training"])
        keys = list(next(iter(report["training"].values())))
        rows = []
        for key in keys:
            cells = [esc(key)]
            b = report["training"][labels[0]].get(key)
            for lab in labels:
                v = report["training"][lab].get(key)
                pct = _is_pct(key)
                txt = _train_fmt(key, v)
                d = (v - b) if (pct and v is not None and b is not None and lab != labels[0]) else None
                cells.append(esc(txt) + _delta_cell(d, colored="accuracy" in key))
            rows.append(cells)
        parts.append(section(
            "Training runs",
            f'<p class="meta">Accuracies and fractions in %, deltas against <b>{esc(labels[0])}</b> (the first '
            'training run); "final" = mean over the last 10% of steps.</p>'
            + html_table(["", *labels], rows, raw=True, table_id="table-training"),
        ))
    if pngs:
        figs = "".join(
            f"<figure>{img_tag(p, key)}<figcaption>{esc(key)}</figcaption></figure>" for key, p in pngs.items()
        )
        parts.append(section("Training curves", f'<div class="grid">{figs}</div>'))
    return html_page("stapo compare", parts, subtitle=f"{len(runs)} runs, baseline {base}")


def _config_check_html(check: dict[str, Any]) -> str:
    """The fairness section: a red warning box with the confounds, or a one-line all-clear; then every difference."""
    rows = [[esc(lab), esc(d["group"]) + (" <b>(confound)</b>" if part == "confounds" else ""), esc(d["key"]),
             esc(repr(d["base"])), esc(repr(d["other"]))]
            for lab, v in check["runs"].items() for part in ("confounds", "method", "execution") for d in v[part]]
    if check["warning"]:
        head = f'<p id="confound-warning" style="background:#fde7e7;border:2px solid #b3261e;color:#8c1d18;padding:8px"><b>{esc(check["warning"])}</b></p>'
    elif check["runs"]:
        head = (f'<p id="config-check" class="meta">The training runs differ from <b>{esc(check["baseline"])}</b> '
                "in method keys only (execution keys do not change the objective).</p>")
    else:
        head = '<p id="config-check" class="meta">One training run with a config.yaml: nothing to check.</p>'
    for note in check.get("notes", []):
        head += f'<p class="s2t-note" style="background:#fff4d6;border:1px solid #b58a00;padding:6px">{esc(note)}</p>'
    if check["unchecked"]:
        head += f'<p class="meta">Not checked (no config.yaml): {esc(", ".join(check["unchecked"]))}.</p>'
    table = (html_table(["run", "group", "key", f"{check['baseline']} (baseline)", "run's value"], rows, raw=True,
                        left_cols=5, table_id="table-config") if rows else "")
    return section("Is the comparison fair?", head + table)


def terminal_tables(report: dict[str, Any]) -> list[Any]:
    """Rich tables for the terminal: avg@k with deltas, and the training summary."""
    from rich.table import Table
    from rich.text import Text

    out = []
    check = report["config_check"]
    if check["warning"]:
        table = Table(title="[bold red]WARNING: the runs differ in more than the method[/]", title_justify="left")
        for col in ("run", "group", "key", "baseline", "run"):
            table.add_column(col, overflow="fold")
        for lab, v in check["runs"].items():
            for d in v["confounds"]:
                table.add_row(lab, d["group"], d["key"], repr(d["base"]), repr(d["other"]))
        out.append(table)
    for note in check.get("notes", []):
        out.append(Text("note: " + note, style="bold yellow"))
    base = report["baseline"]
    t = report["tables"]["avg"]
    if t["columns"]:
        deltas = f"deltas vs {base}" if base in t["columns"] else f"no deltas: the baseline {base} has no eval results"
        table = Table(title=f"avg@k (%) — {deltas}")
        table.add_column("benchmark")
        for lab in t["columns"]:
            table.add_column(lab, justify="right")
        for bench, vals in t["rows"].items():
            cells = [bench]
            for lab in t["columns"]:
                d = t["delta"].get(bench, {}).get(lab)
                color = "green" if (d or 0) > 0 else "red" if (d or 0) < 0 else "dim"
                cells.append(fmt_pct(vals.get(lab)) + (f" [{color}]({fmt_delta(d)})[/]" if d is not None else ""))
            table.add_row(*cells)
        out.append(table)
    if report["training"]:
        labels = list(report["training"])
        confounded = " [bold red](CONFOUNDED: see the warning above)[/]" if check["warning"] else ""
        table = Table(title=f"training runs (accuracies and fractions in %){confounded}")
        table.add_column("")
        for lab in labels:
            table.add_column(lab, justify="right")
        for key in next(iter(report["training"].values())):
            table.add_row(key, *[_train_fmt(key, report["training"][lab].get(key)) for lab in labels])
        out.append(table)
    return out
