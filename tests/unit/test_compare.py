"""`stapo compare` on synthetic run dirs written in the exact `stapo train` / `stapo eval` formats."""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest
import yaml

from stapo.evals.compare import CURVES, compare_runs, load_run

PHASE = [f"phase/{p}_{h}_{a}" for p in ("lowp", "highp") for h in ("lowh", "highh") for a in ("pos", "neg")]


def write_train_run(root: Path, name: str, *, steps: int, reward_slope: float, entropy0: float,
                    val: list[float], algorithm: str) -> Path:
    """A run dir as `stapo train` writes it: config.yaml, metrics.jsonl, val.jsonl, summary.json."""
    run = root / name
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump({"algorithm": {"name": algorithm, "token_weighting": "s2t"}}))
    rows = []
    for s in range(1, steps + 1):
        row = {
            "step": s, "reward/mean": 0.2 + reward_slope * s, "reward/std": 0.3, "entropy/mean": entropy0 - 0.01 * s,
            "stapo/silenced_frac": 0.001 * (s % 3), "actor/loss": 0.01, "actor/grad_norm": 1.0 + 0.1 * s,
            "actor/lr": 1e-6, "actor/clip_frac_low": 0.01, "actor/clip_frac_high": 0.02,
            "response_length/mean": 100.0 + s, "response_length/clip_ratio": 0.0, "time/rollout_s": 1.0,
            "time/reward_s": 0.1, "time/train_s": 1.0, "time/step_s": 2.1, "perf/tokens_per_s": 500.0,
        }
        row.update({k: 1 / 8 for k in PHASE})
        rows.append(row)
    rows[3]["actor/grad_norm"] = None  # NaN written as null by the tracker: must be skipped, not crash
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 99, "rew')  # torn
    val_rows = [{"step": i * (steps // (len(val) - 1)), "accuracy": a, "n": 40, "mean_length": 90.0}
                for i, a in enumerate(val)]
    (run / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in val_rows))
    (run / "summary.json").write_text(json.dumps(
        {"steps": steps, "val_accuracy_before": val[0], "val_accuracy_after": val[-1], "wall_s": 12.5}))
    return run


def write_eval_dir(root: Path, name: str, accs: dict[str, tuple[int, float, float, float]]) -> Path:
    """An eval output dir as `stapo eval` writes it (results.json only is read by compare)."""
    d = root / name
    d.mkdir(parents=True)
    benches = {b: {f"avg@{k}": a, f"pass@{k}": p, f"maj@{k}": m, "n": 30, "k": k} for b, (k, a, p, m) in accs.items()}
    (d / "results.json").write_text(json.dumps({"benchmarks": benches, "model": f"runs/{name}/final", "config": {}}))
    return d


class _Tables(HTMLParser):
    """Collects every table (by id) as rows of cell texts, and every <img> src."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: dict[str, list[list[str]]] = {}
        self.imgs: list[str] = []
        self.links: list[str] = []
        self._cur: list[list[str]] | None = None
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "table":
            self._cur = self.tables.setdefault(a.get("id") or f"t{len(self.tables)}", [])
        elif tag == "tr" and self._cur is not None:
            self._cur.append([])
        elif tag in ("td", "th"):
            self._cell = []
        elif tag == "img":
            self.imgs.append(a.get("src") or "")
        if "href" in a or (tag in ("script", "link")):
            self.links.append(tag)

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None and self._cur is not None:
            self._cur[-1].append("".join(self._cell).strip())
            self._cell = None
        elif tag == "table":
            self._cur = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    tmp_path = tmp_path_factory.mktemp("runs")
    grpo = write_train_run(tmp_path, "grpo", steps=30, reward_slope=0.005, entropy0=0.9, val=[0.3, 0.35, 0.4],
                           algorithm="grpo")
    stapo = write_train_run(tmp_path, "stapo", steps=30, reward_slope=0.01, entropy0=1.0, val=[0.3, 0.4, 0.5],
                            algorithm="stapo")
    ev_grpo = write_eval_dir(tmp_path, "eval_grpo", {"aime24": (32, 0.10, 0.40, 0.20), "math500": (4, 0.60, 0.75, 0.65)})
    ev_stapo = write_eval_dir(tmp_path, "eval_stapo", {"aime24": (32, 0.15, 0.45, 0.20), "math500": (4, 0.58, 0.80, 0.66),
                                                       "gsm8k": (4, 0.9, 0.95, 0.92)})
    return [ev_grpo, ev_stapo, grpo, stapo]


def test_compare_writes_tables_pngs_and_selfcontained_html(runs: list[Path], tmp_path: Path) -> None:
    out = tmp_path / "cmp"
    rep = compare_runs(runs, out_dir=out)
    assert rep["baseline"] == "eval_grpo"
    avg = rep["tables"]["avg"]
    assert avg["columns"] == ["eval_grpo", "eval_stapo"]
    assert avg["rows"]["aime24"] == pytest.approx({"eval_grpo": 10.0, "eval_stapo": 15.0})  # % everywhere
    assert avg["delta"]["aime24"]["eval_stapo"] == pytest.approx(5.0)  # percentage points
    assert avg["delta"]["math500"]["eval_stapo"] == pytest.approx(-2.0)
    assert avg["rows"]["gsm8k"] == {"eval_grpo": None, "eval_stapo": pytest.approx(90.0)}
    assert avg["delta"]["gsm8k"]["eval_stapo"] is None  # no baseline value, no delta
    # Avg. over the benchmarks both runs have (aime24, math500), not gsm8k.
    assert rep["tables"]["common_benchmarks"] == ["aime24", "math500"]
    assert avg["rows"]["Avg."]["eval_stapo"] == pytest.approx((15 + 58) / 2)
    assert rep["tables"]["pass"]["rows"]["math500"]["eval_stapo"] == pytest.approx(80.0)
    assert rep["tables"]["avg"]["k"]["aime24"]["eval_grpo"] == 32

    tr = rep["training"]
    assert set(tr) == {"grpo", "stapo"}
    assert tr["stapo"]["val_accuracy_after"] == 50.0 and tr["stapo"]["val_accuracy_best"] == 50.0
    assert tr["grpo"]["steps"] == 30
    # "final" = mean of the last 10% of steps (3 steps: 28, 29, 30).
    assert tr["stapo"]["final reward/mean"] == pytest.approx(0.2 + 0.01 * 29)

    assert json.loads((out / "compare.json").read_text())["tables"]["avg"]["rows"]["aime24"]["eval_stapo"] == pytest.approx(15.0)
    assert set(rep["curves"]) == {k for k, _ in CURVES}
    for rel in rep["curves"].values():
        png = (out / rel).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000

    html = (out / "report.html").read_text()
    p = _Tables()
    p.feed(html)
    assert p.links == []  # no external stylesheet, script or link: opens offline
    assert len(p.imgs) == len(CURVES) and all(s.startswith("data:image/png;base64,") for s in p.imgs)
    table = {row[0]: row[1:] for row in p.tables["table-avg"]}
    assert re.sub(r"\s+", " ", table["aime24 avg@32"][1]) == "15.0 (+5.0)"
    assert table["math500 avg@4"][1].startswith("58.0 (-2.0)")
    assert table["Avg."][0] == "35.0"
    train = {row[0]: row[1:] for row in p.tables["table-training"]}
    assert train["val_accuracy_after (%)"][1].startswith("50.0 (+10.0)")


def test_compare_rejects_dirs_that_are_not_runs(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="results.json"):
        load_run(tmp_path / "empty")
    with pytest.raises(FileNotFoundError):
        load_run(tmp_path / "missing")


def test_compare_cli(runs: list[Path], tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from stapo.cli.main import app

    out = tmp_path / "cli_cmp"
    # Eval dirs only (no curves to draw): the CLI wiring, labels and the terminal table.
    res = CliRunner().invoke(app, ["compare", *map(str, runs[:2]), "--out", str(out), "-l", "GRPO", "-l", "STAPO"],
                             env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "aime24" in res.output and "15.0 (+5.0)" in res.output and "STAPO" in res.output
    assert (out / "report.html").is_file() and (out / "compare.json").is_file()


# ----------------------------------------------------------------------------- the confound check


def write_demo_run(root: Path, name: str, *overrides: str) -> Path:
    """A run dir with the full config.yaml `stapo train` saves (the demo preset + overrides) and a few metric rows."""
    from stapo.configs import preset_path
    from stapo.core.config import load_config, save_config

    run = root / name
    run.mkdir(parents=True)
    save_config(load_config(preset_path("demo"), list(overrides)), run / "config.yaml")
    rows = [{"step": s, "reward/mean": 0.1 * s, "entropy/mean": 1.0} for s in (1, 2, 3)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def _compare_cli(runs: list[Path], out: Path) -> str:
    from typer.testing import CliRunner

    from stapo.cli.main import app

    res = CliRunner().invoke(app, ["compare", *map(str, runs), "--out", str(out)], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    return res.output


def test_compare_runs_that_differ_in_one_method_key_show_no_warning(tmp_path: Path) -> None:
    a = write_demo_run(tmp_path, "grpo", "algorithm.token_weighting=none", "algorithm.name=grpo")
    b = write_demo_run(tmp_path, "stapo", "logging.dump_tokens_every=0")  # an execution key: not a confound
    output = _compare_cli([a, b], tmp_path / "cmp")
    assert "WARNING" not in output and "CONFOUNDED" not in output
    rep = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    check = rep["config_check"]
    assert check["warning"] is None and check["baseline"] == "grpo"
    assert [d["key"] for d in check["runs"]["stapo"]["method"]] == ["algorithm.name", "algorithm.token_weighting"]
    assert [d["key"] for d in check["runs"]["stapo"]["execution"]] == ["logging.dump_tokens_every"]
    assert check["runs"]["stapo"]["confounds"] == []
    html = (tmp_path / "cmp" / "report.html").read_text()
    assert "confound-warning" not in html and "differ from <b>grpo</b> in method keys only" in html


def test_compare_runs_that_also_differ_in_batch_size_warn(tmp_path: Path) -> None:
    a = write_demo_run(tmp_path, "grpo", "algorithm.token_weighting=none", "algorithm.name=grpo")
    b = write_demo_run(tmp_path, "stapo", "rollout.prompts_per_step=8", "trainer.seed=3")
    output = _compare_cli([a, b], tmp_path / "cmp")
    flat = re.sub(r"\s+", " ", output)
    assert "WARNING: the runs differ in more than the method" in flat
    assert "rollout.prompts_per_step" in flat and "trainer.seed" in flat and "CONFOUNDED" in flat
    assert "WARNING" in output.split("report:", 1)[1]  # repeated after the tables, where a reader looks last
    check = json.loads((tmp_path / "cmp" / "compare.json").read_text())["config_check"]
    conf = {d["key"]: (d["group"], d["base"], d["other"]) for d in check["runs"]["stapo"]["confounds"]}
    assert conf == {"rollout.prompts_per_step": ("batch", 4, 8), "trainer.seed": ("seed", 0, 3)}
    html = (tmp_path / "cmp" / "report.html").read_text()
    p = _Tables()
    p.feed(html)
    assert 'id="confound-warning"' in html
    warning = re.search(r'id="confound-warning"[^>]*><b>(.*?)</b>', html, re.S)
    assert warning and "(batch, seed)" in warning.group(1) and "rollout.prompts_per_step 4 -&gt; 8" in warning.group(1)
    rows = {(r[0], r[2]): r for r in p.tables["table-config"][1:]}
    assert rows[("stapo", "rollout.prompts_per_step")][1:] == ["batch (confound)", "rollout.prompts_per_step", "4", "8"]
    assert rows[("stapo", "algorithm.token_weighting")][1] == "method"


def test_config_differences_group_every_key():
    from stapo.core.config import Config
    from stapo.core.fairness import KEY_GROUPS, classify, config_differences, flatten, matched_overrides

    keys = flatten(Config().model_dump(mode="json", by_alias=True))
    groups = {classify(k) for k in keys}
    assert "other" not in groups, [k for k in keys if classify(k) == "other"]  # every shipped field is classified
    assert {g for g, _ in KEY_GROUPS} <= groups
    assert classify("rollout.n") == "batch" and classify("rollout.new_field") == "other"
    assert classify("algorithm.mini_batches") == "batch" and classify("algorithm.eps_high") == "method"
    assert classify("data.goldilocks.seed") == "seed" and classify("data.goldilocks.lr") == "method"
    d = config_differences({"a": {"b": (1, 2)}, "rollout": {"n": 8}}, {"a": {"b": [1, 2]}, "rollout": {"n": 16}})
    assert [(x.key, x.group, x.base, x.other, x.confound) for x in d] == [("rollout.n", "batch", 8, 16, True)]
    assert matched_overrides({"rollout": {"n": 8}, "algorithm": {"name": "x"}},
                             {"rollout": {"n": 16}, "algorithm": {"name": "y"}}) == ["rollout.n=8"]


# ----------------------------------------------------------------------------- one unit per metric


def test_every_fraction_is_a_labelled_percentage_in_json_tables_html_and_axes(tmp_path: Path, monkeypatch) -> None:
    import matplotlib.axes

    run = write_demo_run(tmp_path, "stapo")
    # 3 steps x 1200 valid tokens, 25 silenced a step: the run's rate 75 / 3600 = 0.020833 -> 2.08 %;
    # the per-step fraction 0.0156 -> 1.56 %: the same unit side by side, never 2.08e-02 beside 1.56.
    rows = [{"step": s, "stapo/silenced_count": 25, "tokens/valid": 1200, "stapo/silenced_frac": 0.0156,
             "entropy/mean": 0.8} for s in (1, 2, 3)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ylabels: list[str] = []
    real = matplotlib.axes.Axes.set_ylabel
    monkeypatch.setattr(matplotlib.axes.Axes, "set_ylabel", lambda ax, text, *a, **k: (ylabels.append(text), real(ax, text, *a, **k))[1])
    output = _compare_cli([run], tmp_path / "cmp")
    rep = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    tr = rep["training"]["stapo"]
    assert tr["silenced_rate"] == pytest.approx(100 * 75 / 3600) and tr["final stapo/silenced_frac"] == pytest.approx(1.56)
    assert rep["units"]["silenced_rate"] == rep["units"]["final stapo/silenced_frac"] == "%"
    assert rep["units"]["final entropy/mean"] == "nats" and rep["units"]["accuracy tables"] == "%"
    flat = re.sub(r"\s+", " ", output)
    assert "silenced_rate (%) │ 2.08" in flat and "final stapo/silenced_frac (%) │ 1.56" in flat
    assert "e-0" not in output
    p = _Tables()
    p.feed((tmp_path / "cmp" / "report.html").read_text())
    train = {row[0]: row[1:] for row in p.tables["table-training"]}
    assert train["silenced_rate (%)"] == ["2.08"] and train["final stapo/silenced_frac (%)"] == ["1.56"]
    assert "stapo/silenced_frac (%)" in ylabels and "entropy/mean (nats)" in ylabels


# ----------------------------------------------------------------------------- seeds


def write_seeded_run(root: Path, name: str, seed: int, val_after: float, *method: str) -> Path:
    """One seed of one method: the demo config with ``trainer.seed``, 3 metric rows, validation at start and end."""
    run = write_demo_run(root, name, *method, f"trainer.seed={seed}")
    rows = [{"step": s, "reward/mean": 0.1 * s + 0.01 * seed + val_after, "entropy/mean": 1.0} for s in (1, 2, 3)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))  # each seed its own curve
    (run / "val.jsonl").write_text("".join(json.dumps({"step": s, "accuracy": a, "n": 40}) + "\n"
                                           for s, a in ((0, 0.3), (3, val_after))))
    (run / "summary.json").write_text(json.dumps(
        {"steps": 3, "val_accuracy_before": 0.3, "val_accuracy_after": val_after, "wall_s": 10.0}))
    return run


GRPO = ("algorithm.token_weighting=none", "algorithm.name=grpo")


@pytest.fixture()
def seeded_runs(tmp_path: Path) -> list[Path]:
    # GRPO seeds 0, 1, 2 end at 40, 50, 45 %; STAPO's end at 46, 52, 50 % (given in another order: 2, 0, 1).
    grpo = [write_seeded_run(tmp_path, f"grpo-s{s}", s, v, *GRPO) for s, v in ((0, 0.40), (1, 0.50), (2, 0.45))]
    stapo = [write_seeded_run(tmp_path, f"stapo-s{s}", s, v) for s, v in ((2, 0.50), (0, 0.46), (1, 0.52))]
    return grpo + stapo


def test_seeds_of_a_recipe_group_with_t_intervals_and_paired_differences(seeded_runs: list[Path], tmp_path: Path) -> None:
    output = _compare_cli(seeded_runs, tmp_path / "cmp")
    rep = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    seeded = rep["seeded"]
    assert seeded["groups"] == {"grpo": {"runs": ["grpo-s0", "grpo-s1", "grpo-s2"], "seeds": [0, 1, 2]},
                                "stapo": {"runs": ["stapo-s2", "stapo-s0", "stapo-s1"], "seeds": [2, 0, 1]}}
    assert seeded["pairing"] == {"training": "seed"} and seeded["baseline"] == "grpo"
    after = seeded["training"]["val_accuracy_after"]
    # GRPO: mean 45, sd 5, half width t(0.975, 2) x 5 / sqrt(3) = 4.303 x 2.88675 = 12.4217
    g = after["groups"]["grpo"]
    assert g["mean"] == pytest.approx(45.0) and g["sd"] == pytest.approx(5.0) and g["n"] == 3
    assert (g["low"], g["high"]) == (pytest.approx(45 - 12.4217, abs=1e-3), pytest.approx(45 + 12.4217, abs=1e-3))
    # Paired by seed: 46-40 = 6, 52-50 = 2, 50-45 = 5; mean 13/3, sd sqrt(13/3) = 2.08167,
    # half width 4.303 x 2.08167 / sqrt(3) = 5.1716
    d = after["paired"]["stapo"]
    assert d["diffs"] == {"0": pytest.approx(6.0), "1": pytest.approx(2.0), "2": pytest.approx(5.0)}
    assert d["mean"] == pytest.approx(13 / 3) and d["sd"] == pytest.approx(2.08167, abs=1e-5)
    assert (d["low"], d["high"]) == (pytest.approx(13 / 3 - 5.1716, abs=1e-3), pytest.approx(13 / 3 + 5.1716, abs=1e-3))
    assert (d["n"], d["n_higher"], d["n_lower"]) == (3, 3, 0)
    assert "grpo" not in after["paired"]  # the baseline is not paired with itself
    # Seeds of one group are replicates, not confounds; across groups each run is checked against its seed's pair.
    check = rep["config_check"]
    assert check["warning"] is None and "WARNING" not in output
    assert check["runs"]["grpo-s1"]["replicate"][0]["key"] == "trainer.seed"
    assert check["runs"]["stapo-s2"]["reference"] == "grpo-s2" and check["runs"]["stapo-s2"]["confounds"] == []
    flat = re.sub(r"\s+", " ", output)
    assert "45.0 [32.6, 57.4] n=3" in flat and "Δ +4.3 [-0.8, +9.5], wins 3/3" in flat
    assert "silenced_rate" not in flat.split("over seeds")[1].split("training runs")[0]  # rows no run has are left out
    p = _Tables()
    p.feed((tmp_path / "cmp" / "report.html").read_text())
    row = {r[0]: r[1:] for r in p.tables["table-seeded"]}["val_accuracy_after (%)"]
    assert row == ["45.0 [32.6, 57.4] n=3", "49.3 [41.7, 56.9] n=3Δ +4.3 [-0.8, +9.5], wins 3/3"]


def test_group_labels_pair_eval_dirs_and_one_run_groups_behave_as_before(tmp_path: Path) -> None:
    a = [write_eval_dir(tmp_path, f"a{i}", {"aime24": (4, v, 0.5, 0.3)}) for i, v in enumerate((0.10, 0.20))]
    b = [write_eval_dir(tmp_path, f"b{i}", {"aime24": (4, v, 0.5, 0.3)}) for i, v in enumerate((0.25, 0.15))]
    rep = compare_runs([*a, *b], out_dir=tmp_path / "cmp", groups=["A", "A", "B", "B"])
    s = rep["seeded"]
    assert s["pairing"] == {"eval": "order"}  # no seeds in these results.json: paired by position in the group
    aime = s["tables"]["avg"]["aime24"]
    # A: 10, 20 -> mean 15, sd 7.0711, half 12.706 x 7.0711 / sqrt(2) = 63.53; B - A: 15, -5 -> mean 5, 1 win of 2
    assert aime["groups"]["A"]["mean"] == pytest.approx(15.0)
    assert aime["groups"]["A"]["high"] == pytest.approx(15 + 63.53, abs=1e-2)
    assert aime["paired"]["B"]["mean"] == pytest.approx(5.0) and aime["paired"]["B"]["n_higher"] == 1
    assert aime["paired"]["B"]["low"] == pytest.approx(5 - 12.706 * 10, abs=1e-2)  # sd of (15, -5) = 14.142
    with pytest.raises(ValueError, match="2 --group labels for 4 runs"):
        compare_runs([*a, *b], out_dir=tmp_path / "x", groups=["A", "B"])
    mixed = [write_seeded_run(tmp_path / "m", f"r{s}", s, 0.5, *(GRPO if s else ())) for s in (0, 1)]
    notes = compare_runs(mixed, out_dir=tmp_path / "mixed", groups=["A", "A"])["config_check"]["notes"]
    assert any(n.startswith("r1 is in group A but differs from r0 in method keys (algorithm.name") for n in notes)
    one = compare_runs([a[0], b[0]], out_dir=tmp_path / "one", groups=["A", "B"])
    assert one["seeded"] is None  # every group has one run: the per-run tables alone, as without groups


def test_t_table_and_the_curve_band() -> None:
    from stapo.evals.compare import band
    from stapo.evals.compare_stats import mean_interval, t975

    assert (t975(1), t975(2), t975(30), t975(35), t975(1000)) == (12.706, 4.303, 2.042, 2.042, 1.960)
    assert mean_interval([7.0]) == {"mean": 7.0, "low": None, "high": None, "n": 1, "sd": None}
    # step 1: runs at 1 and 3 -> mean 2, sd sqrt(2), half 12.706 x sqrt(2) / sqrt(2); step 2: one run, no band
    steps, mean, low, high = band([([1, 2], [1.0, 4.0]), ([1], [3.0])])
    assert steps == [1, 2] and mean == [2.0, 4.0]
    assert low == [pytest.approx(2 - 12.706), 4.0] and high == [pytest.approx(2 + 12.706), 4.0]


DOC = Path(__file__).resolve().parents[2] / "docs" / "evaluation.md"


def _doc_compare_lines() -> list[str]:
    """The `stapo compare` lines of docs/evaluation.md's fenced blocks (the synopsis with DIR... aside)."""
    lines, fenced = [], False
    for line in DOC.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif fenced and line.startswith("stapo compare ") and "DIR..." not in line:
            lines.append(line.split("  #")[0])
    return lines


def test_documented_compare_lines_run(tmp_path: Path, monkeypatch) -> None:
    import shlex

    from typer.testing import CliRunner

    from stapo.cli.main import app

    lines = _doc_compare_lines()
    assert len(lines) == 3, lines
    monkeypatch.chdir(tmp_path)
    for i, (method, seeds) in enumerate(((GRPO, "grpo"), ((), "stapo"), (GRPO, "a"), ((), "b"))):
        for s in range(3):
            write_seeded_run(tmp_path / "runs", f"{seeds}-s{s}", s, 0.4 + 0.01 * i + 0.02 * s, *method)
    write_demo_run(tmp_path / "runs", "grpo", *GRPO)
    write_demo_run(tmp_path / "runs", "stapo")
    write_eval_dir(tmp_path / "evals", "grpo", {"aime24": (32, 0.10, 0.40, 0.20)})
    write_eval_dir(tmp_path / "evals", "stapo", {"aime24": (32, 0.15, 0.45, 0.20)})
    for line in lines:
        res = CliRunner().invoke(app, shlex.split(line)[1:], env={"COLUMNS": "200"})
        assert res.exit_code == 0, (line, res.output)
        out = Path(shlex.split(line)[shlex.split(line).index("--out") + 1])
        rep = json.loads((out / "compare.json").read_text())
        if "seeds" in line or "--group" in line:
            assert len(rep["seeded"]["groups"]) == 2 and "over seeds" in res.output, line
        else:
            assert rep["seeded"] is None and "GRPO-train" in rep["training"]


def test_a_resume_that_changed_settings_is_named_in_the_fairness_box(tmp_path: Path) -> None:
    a = write_demo_run(tmp_path, "grpo", *GRPO)
    b = write_demo_run(tmp_path, "stapo")
    (b / "config_changes.jsonl").write_text(
        json.dumps({"step": 3, "time": 0, "changes": [
            {"key": "trainer.lr", "old": 2e-5, "new": 0.5, "bookkeeping": False},
            {"key": "trainer.max_steps", "old": 3, "new": 6, "bookkeeping": True}]}) + "\n"
        + '{"step": 9, "changes": "not a list"}\n{"torn')  # rows it does not know are skipped
    output = _compare_cli([a, b], tmp_path / "cmp")
    rep = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert rep["runs"][1]["config_changes"] == ["from step 3: trainer.lr 2e-05 -> 0.5",
                                                "from step 3: trainer.max_steps 3 -> 6 (bookkeeping)"]
    (note,) = [n for n in rep["config_check"]["notes"] if "resumed" in n]
    assert note.startswith("stapo was resumed with other settings than its config.yaml: from step 3: trainer.lr "
                           "2e-05 -> 0.5. ")
    assert "max_steps" not in note  # a bookkeeping change does not make the run unfair
    assert "trainer.lr 2e-05 -> 0.5" in re.sub(r"\s+", " ", output)
    assert "trainer.lr 2e-05 -&gt; 0.5" in (tmp_path / "cmp" / "report.html").read_text()


def test_two_runs_of_one_config_and_seed_are_not_grouped(tmp_path: Path) -> None:
    a = write_seeded_run(tmp_path, "first", 0, 0.4)
    b = write_seeded_run(tmp_path, "rerun", 0, 0.5)
    c = write_seeded_run(tmp_path, "other-seed", 1, 0.5, *GRPO)
    rep = compare_runs([a, b, c], out_dir=tmp_path / "cmp")
    assert rep["seeded"] is None and [r["group"] for r in rep["runs"]] == ["first", "rerun", "other-seed"]


# ----------------------------------------------------------------------------- the conclusion


def _seeded(tmp_path: Path, grpo: tuple[float, ...], stapo: tuple[float, ...], names: tuple[str, str] = ("grpo", "stapo"),
            ) -> list[Path]:
    """Seeds 0, 1, 2 of GRPO and of STAPO ending at the given validation accuracies (run dirs NAME-sSEED)."""
    g = [write_seeded_run(tmp_path, f"{names[0]}-s{s}", s, v, *GRPO) for s, v in enumerate(grpo)]
    st = [write_seeded_run(tmp_path, f"{names[1]}-s{s}", s, v) for s, v in enumerate(stapo)]
    return g + st


def _cli80(args: list[str]) -> str:
    from typer.testing import CliRunner

    from stapo.cli.main import app

    res = CliRunner().invoke(app, ["compare", *args], env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    return res.output


def test_conclusion_states_an_interval_that_includes_zero(tmp_path: Path) -> None:
    # Paired by seed: 46-40, 52-50, 50-45 = 6, 2, 5: mean 4.33, sd 2.0817, half 4.303 x 2.0817 / sqrt(3) = 5.17
    runs = _seeded(tmp_path, (0.40, 0.50, 0.45), (0.46, 0.52, 0.50))
    output = _cli80([*map(str, runs), "--out", str(tmp_path / "cmp")])
    flat = re.sub(r"\s+", " ", output.split("conclusion:", 1)[1])
    assert ("- stapo vs grpo, val_accuracy_after (%): stapo ahead by 4.3 points, 95% CI [-0.8, +9.5] includes 0 "
            "over 3 paired seeds: no difference shown.") in flat
    items = json.loads((tmp_path / "cmp" / "compare.json").read_text())["conclusion"]
    (after,) = [it for it in items if it["metric"] == "val_accuracy_after (%)"]
    assert after["excludes_zero"] is False and after["mean"] == pytest.approx(13 / 3)
    # steps, the accuracy before training and the (hand-written) 10 s wall time agree in every pair:
    # one line, not a "+0.0" verdict each
    (same,) = [it for it in items if it["verdict"] == "identical"]
    assert same["metric"] == ["steps (steps)", "val_accuracy_before (%)", "wall_s (s)", "final entropy/mean (nats)"]
    html = (tmp_path / "cmp" / "report.html").read_text()
    assert 'id="conclusion"' in html and "includes 0 over 3 paired seeds: no difference shown." in html


def test_conclusion_states_an_interval_that_excludes_zero(tmp_path: Path) -> None:
    # Differences 4, 5, 6: mean 5, sd 1, half 4.303 / sqrt(3) = 2.484 -> [+2.5, +7.5], above 0
    runs = _seeded(tmp_path, (0.40, 0.50, 0.45), (0.44, 0.55, 0.51))
    output = _cli80([*map(str, runs), "--out", str(tmp_path / "cmp")])
    flat = re.sub(r"\s+", " ", output.split("conclusion:", 1)[1])
    assert ("stapo vs grpo, val_accuracy_after (%): stapo ahead by 5.0 points, 95% CI [+2.5, +7.5] excludes 0 "
            "over 3 paired seeds: stapo ahead.") in flat
    documented = DOC.read_text().split("### The conclusion", 1)[1].split("```text", 1)[1].split("```", 1)[0]
    assert re.sub(r"\s+", " ", documented).strip() in flat  # docs/evaluation.md shows this very line
    # the other way round, STAPO as the baseline: GRPO behind by the same amount
    rev = compare_runs(runs[3:] + runs[:3], out_dir=tmp_path / "rev")
    (after,) = [it for it in rev["conclusion"] if it["metric"] == "val_accuracy_after (%)"]
    assert after["text"].startswith("grpo vs stapo, val_accuracy_after (%): grpo behind by 5.0 points, 95% CI "
                                    "[-7.5, -2.5] excludes 0")
    assert after["verdict"] == "grpo behind" and after["excludes_zero"] is True


def test_without_seeds_the_conclusion_says_there_is_none(tmp_path: Path) -> None:
    a = write_demo_run(tmp_path, "grpo", *GRPO)
    b = write_demo_run(tmp_path, "stapo")
    (item,) = compare_runs([a, b], out_dir=tmp_path / "cmp")["conclusion"]
    assert item["text"].startswith("one run per method, so no interval and no conclusion")


def test_identical_groups_are_said_once_and_float_noise_is_identical(tmp_path: Path) -> None:
    runs = _seeded(tmp_path, (0.40, 0.50, 0.45), (0.40, 0.50, 0.45))
    rnd = [write_seeded_run(tmp_path, f"random-s{s}", s, v, "algorithm.name=stapo-random")
           for s, v in enumerate((0.40, 0.50, 0.45))]
    # One seed of STAPO differs from GRPO's only past float rounding (1e-8 relative): still identical.
    m = runs[4] / "metrics.jsonl"
    rows = [json.loads(x) for x in m.read_text().splitlines()]
    rows[-1]["entropy/mean"] *= 1 + 1e-8
    m.write_text("".join(json.dumps(r) + "\n" for r in rows))
    output = _cli80([*map(str, runs + rnd), "--out", str(tmp_path / "cmp")])
    rep = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    notes = rep["config_check"]["notes"]
    assert [n for n in notes if "identical" in n] == [
        "grpo, stapo and stapo-random logged identical metrics at every step, run by run (3 runs each, paired by "
        "seed; to 4 significant digits, timings aside): here the methods did not differ in effect."]
    assert rep["seeded"]["identical_to_baseline"] == ["stapo", "stapo-random"]
    assert rep["seeded"]["training"]["final entropy/mean"]["paired"]["stapo"]["identical"] is True
    assert [it["text"].split(":")[0] for it in rep["conclusion"]] == ["stapo vs grpo", "stapo-random vs grpo"]
    assert rep["conclusion"][0]["text"].startswith("stapo vs grpo: identical runs in all 3 pairs")
    flat = re.sub(r"\s+", " ", output)
    assert "stapo, stapo-random: identical to grpo run by run (timings aside), shown once as grpo." in flat
    assert "0.0000000" not in output and "higher in 2/3" not in output


def test_tables_fit_80_columns_with_long_names(tmp_path: Path) -> None:
    long_g, long_s = "grpo-baseline-recipe-with-a-long-name", "stapo-recipe-with-a-much-longer-name-v2"
    runs = _seeded(tmp_path, (0.40, 0.50, 0.45), (0.44, 0.55, 0.51), (long_g, long_s))
    output = _cli80([*map(str, runs), "--out", str(tmp_path / "cmp"), *[x for g in [long_g] * 3 + [long_s] * 3
                                                                        for x in ("--group", g)]])
    lines = output.splitlines()
    assert max(len(x) for x in lines) <= 80 and "…" not in output
    assert f"groups: A = {long_g}, B = {long_s}" in re.sub(r"\s+", " ", output)  # keyed names, with a legend
    assert re.search(r"^  B  50\.0 \[", output, re.M) and "Δ +5.0 [+2.5, +7.5], wins 3/3" in output
    assert f"[1] {long_g}-s0" in re.sub(r"\s+", " ", output)  # run labels too long for a header: a legend
    assert "part 2 of" in output  # six run columns do not fit beside the row labels: the table continues
    flat = re.sub(r"\s+", " ", output.split("conclusion:", 1)[1])
    assert f"{long_s} vs {long_g}, val_accuracy_after (%): {long_s} ahead by 5.0 points" in flat


def test_wrap_name_and_fitted_tables() -> None:
    from rich.console import Console

    from stapo.evals.compare import fitted_tables, wrap_name

    assert wrap_name("stapo-random-0", 7) == ["stapo-", "random-", "0"]
    assert wrap_name("abcdefghij", 4) == ["abcd", "efgh", "ij"]
    rows = [("final response_length/mean (tokens)", ["1.000"] * 12)]
    console = Console(width=80, record=True)
    for part in fitted_tables("t", [f"run-{i}" for i in range(12)], rows, 80):
        console.print(part)
    text = console.export_text()
    assert max(len(x) for x in text.splitlines()) <= 80 and "…" not in text
    assert "final response_length/mean" in text and "run-11" in text


def test_non_negative_metrics_get_no_negative_interval_end(tmp_path: Path) -> None:
    from stapo.evals.compare import band

    runs = _seeded(tmp_path, (0.40, 0.50, 0.45), (0.44, 0.55, 0.51))
    for run, wall in zip(runs, (1.0, 1.0, 30.0, 5.0, 6.0, 7.0), strict=True):
        s = json.loads((run / "summary.json").read_text())
        (run / "summary.json").write_text(json.dumps(s | {"wall_s": wall}))
    rep = compare_runs(runs, out_dir=tmp_path / "cmp")
    wall = rep["seeded"]["training"]["wall_s"]
    # GRPO 1, 1, 30 s: mean 10.667, sd 16.743, half 4.303 x 16.743 / sqrt(3) = 41.596 -> [-30.9, 52.3] cut at 0
    g = wall["groups"]["grpo"]
    assert g["low"] == 0.0 and g["clipped"] is True and g["high"] == pytest.approx(10.667 + 41.596, abs=1e-2)
    assert wall["groups"]["stapo"]["low"] == pytest.approx(6 - 4.303 / 3 ** 0.5, abs=1e-3)  # not cut: 3.52
    # the paired difference of a non-negative metric keeps its sign: it can be negative
    assert wall["paired"]["stapo"]["low"] < 0
    # % values are also cut at 100; the curve band is cut the same way
    steps, mean, low, high = band([([1], [0.5]), ([1], [99.5])], (0.0, 100.0))
    assert (low, high) == ([0.0], [100.0]) and mean == [50.0]


def test_small_validation_set_warns(tmp_path: Path) -> None:
    from stapo.evals.compare import RunData, val_resolution

    def res(n: int) -> dict | None:
        return val_resolution([RunData("a", tmp_path, val=[{"step": 0, "accuracy": 0.5, "n": n}])])

    assert res(4)["warning"].startswith("validation set of 4 prompts: validation accuracy moves in steps of 25 "
                                        "points")
    assert res(20)["step_points"] == 5.0 and res(20)["warning"] is not None  # 5-point steps: still too coarse
    assert res(21)["warning"] is None and res(40)["step_points"] == 2.5
    assert val_resolution([RunData("a", tmp_path)]) is None
    runs = _seeded(tmp_path, (0.40, 0.50, 0.45), (0.44, 0.55, 0.51))
    for run in runs:
        (run / "val.jsonl").write_text(json.dumps({"step": 0, "accuracy": 0.25, "n": 4}) + "\n")
    output = _cli80([*map(str, runs), "--out", str(tmp_path / "cmp")])
    assert "warning: validation set of 4 prompts" in output.split("conclusion:", 1)[1]


def test_curves_have_integer_step_ticks(tmp_path: Path, monkeypatch) -> None:
    import matplotlib.figure

    ticks: list[list[float]] = []
    real = matplotlib.figure.Figure.savefig

    def savefig(fig, *a, **k):
        for ax in fig.axes:
            lo, hi = ax.get_xlim()
            ticks.append([t for t in ax.get_xticks() if lo <= t <= hi])
        return real(fig, *a, **k)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    compare_runs(_seeded(tmp_path, (0.40, 0.50, 0.45), (0.44, 0.55, 0.51)), out_dir=tmp_path / "cmp")
    assert ticks and all(t and all(float(x).is_integer() for x in t) for t in ticks), ticks
