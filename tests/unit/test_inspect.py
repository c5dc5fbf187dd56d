"""`stapo inspect` on a synthetic token dump in the exact `stapo train` format (docs/architecture.md)."""

from __future__ import annotations

import json
import math
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

from stapo.evals.inspect import CELLS, grad_norms, load_dump, phase_table, token_table

TAU_P, TAU_H = 0.01, 0.12


def _dist(p_tok: float, rest: int) -> tuple[list[float], float, float]:
    """A next-token distribution: the sampled token has p_tok, the rest share 1 - p_tok over `rest` tokens.

    Returns (probs with the sampled token first, entropy, sum of squares).
    """
    q = [p_tok] + [(1 - p_tok) / rest] * rest
    ent = -sum(x * math.log(x) for x in q if x > 0)
    return q, ent, sum(x * x for x in q)


def write_dump(run: Path, step: int = 3) -> dict:
    """Two sequences: seq 0 (A > 0) holds one silenced low-p low-H token, seq 1 has A < 0."""
    # Token list per sequence: (text, p of the sampled token, size of the rest of the support).
    # A low-p, low-H token: the policy is confident in ANOTHER token (0.995) and sampled a 0.004 one.
    seqs_spec = [
        (0.8, 1.0, [("The", 0.9, 3), (" answer", 0.6, 4), (" is", 0.95, 2), (" 8", None, None), ("\n", 0.7, 5)]),
        (-0.5, 0.0, [("I", 0.5, 5), (" think", 0.3, 9), (" 9", 0.2, 9)]),
    ]
    seqs = []
    for adv, reward, toks in seqs_spec:
        prob, ent, q2, top, weight = [], [], [], [], []
        for text, p, rest in toks:
            if p is None:  # the spurious token: q = [0.004 (sampled), 0.995 ("7"), 0.001]
                q = [0.004, 0.995, 0.001]
                prob.append(0.004)
                ent.append(-sum(x * math.log(x) for x in q))
                q2.append(sum(x * x for x in q))
                top.append([["7", 0.995], [" 8", 0.004]])
                weight.append(0.0 if adv > 0 else 1.0)
                continue
            q, h, s2 = _dist(p, rest)
            prob.append(p)
            ent.append(h)
            q2.append(s2)
            top.append([[text, p], ["x", q[1]]])
            weight.append(1.0)
        seqs.append({
            "prompt": "What is 3 + 4? <script>alert(1)</script>", "gold": "7", "reward": reward, "advantage": adv,
            "tokens": [t for t, _, _ in toks], "token_ids": list(range(len(toks))), "prob": prob, "entropy": ent,
            "sum_q2": q2, "weight": weight, "top": top,
        })
    dump = {"step": step, "tau_p": TAU_P, "tau_h": TAU_H, "token_weighting": "s2t", "sequences": seqs}
    (run / "dumps").mkdir(parents=True, exist_ok=True)
    (run / "dumps" / f"step_{step:06d}.json").write_text(json.dumps(dump))
    return dump


def test_grad_norms_by_hand() -> None:
    # p = 0.5 with the other 0.5 on one token: sum q^2 = 0.5, H = ln 2 -> e^{-H} = 0.5 (flat support: equal).
    m, t = grad_norms(np.array([0.5]), np.array([math.log(2)]), np.array([-2.0]), np.array([0.5]))
    assert m[0] == pytest.approx(2 * math.sqrt(1 - 1 + 0.5))
    assert t[0] == pytest.approx(m[0])
    # Confident-elsewhere token: p = 0.004, q = [0.004, 0.995, 0.001] -> norm close to sqrt(2) * |A|.
    q = np.array([0.004, 0.995, 0.001])
    h = float(-(q * np.log(q)).sum())
    m, t = grad_norms(np.array([0.004]), np.array([h]), np.array([1.0]), np.array([(q**2).sum()]))
    assert m[0] == pytest.approx(math.sqrt(1 - 0.008 + (q**2).sum()))
    assert m[0] > 1.39 and t[0] <= m[0]  # Jensen: sum q^2 >= e^{-H}


def test_phase_table_by_hand(tmp_path: Path) -> None:
    dump = write_dump(tmp_path)
    table = token_table(dump)
    phase = phase_table(table, TAU_P, TAU_H)
    assert list(phase) == list(CELLS)
    assert sum(c["tokens"] for c in phase.values()) == 8
    assert sum(c["token_share"] for c in phase.values()) == pytest.approx(1.0)
    assert sum(c["grad_share"] for c in phase.values()) == pytest.approx(1.0)
    # The spurious " 8" of the positive sequence is the only lowp_lowh_pos token, and it is silenced.
    assert phase["lowp_lowh_pos"]["tokens"] == 1 and phase["lowp_lowh_pos"]["silenced"] == 1
    # The 4 other tokens of seq 0 have high p; their entropies: "The" (p=.9 over 3) etc. are > 0.12.
    assert phase["highp_highh_pos"]["tokens"] == 4
    assert phase["highp_highh_neg"]["tokens"] == 3
    # Its share of gradient norm is far above its share of tokens (1/8): the paper's point.
    m, _ = grad_norms(table.prob, table.entropy, table.advantage, table.sum_q2)
    assert phase["lowp_lowh_pos"]["grad_share"] == pytest.approx(m[3] / m.sum())
    assert phase["lowp_lowh_pos"]["grad_share"] > 2 * phase["lowp_lowh_pos"]["token_share"]


class _Parse(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[str, list[list[str]]] = {}
        self.imgs: list[str] = []
        self.scripts = 0
        self._t: str | None = None
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "table":
            self._t = a.get("id") or "anon"
            self.rows.setdefault(self._t, [])
        elif tag == "tr" and self._t:
            self.rows[self._t].append([])
        elif tag in ("td", "th"):
            self._cell = []
        elif tag == "img":
            self.imgs.append(a.get("src") or "")
        elif tag == "script":
            self.scripts += 1

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None and self._t:
            self.rows[self._t][-1].append("".join(self._cell))
            self._cell = None
        elif tag == "table":
            self._t = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


def test_inspect_cli_prints_and_renders_report(tmp_path: Path) -> None:
    """One render (plots are the slow part): the CLI's terminal output, then every file it wrote."""
    from typer.testing import CliRunner

    from stapo.cli.main import app

    run = tmp_path / "run"
    write_dump(run, step=3)
    write_dump(run, step=7)
    assert load_dump(run)["step"] == 7
    out = tmp_path / "insp"
    res = CliRunner().invoke(app, ["inspect", str(run), "--step", "3", "--out", str(out)], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "lowp_lowh_pos" in res.output and "0.004" in res.output and "The answer is⟦ 8⟧" in res.output

    rep = json.loads((out / "inspect.json").read_text())
    assert rep["step"] == 3 and rep["tokens"] == 8 and rep["silenced"] == 1
    s = rep["silenced_tokens"][0]
    assert (s["seq"], s["pos"], s["token"]) == (0, 3, " 8")
    assert s["left"] == "The answer is" and s["right"] == "\n"
    assert s["top"][0] == ["7", 0.995]
    assert rep["bound"]["theorem_le_measured_frac"] == 1.0
    for name in ("grad_norm_scatter.png", "phase_plane.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    p = _Parse()
    p.feed((out / "inspect.html").read_text())
    assert p.scripts == 0  # the prompt's <script> is escaped text, not a tag
    assert len(p.imgs) == 2 and all(i.startswith("data:image/png;base64,") for i in p.imgs)
    sil_rows = p.rows["table-silenced"][1:]
    assert len(sil_rows) == 1 and sil_rows[0][2] == "The answer is 8\n" and sil_rows[0][3] == "0.004"
    phase = {r[0]: r for r in p.rows["table-phase"][1:]}
    assert phase["lowp_lowh_pos"][1] == "1" and phase["lowp_lowh_pos"][2] == "12.50"


def test_inspect_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="is not a training run dir .* give the folder `stapo train --run-dir`"):
        load_dump(tmp_path)  # an empty folder is not told to retrain
    (tmp_path / "config.yaml").write_text("{}\n")
    with pytest.raises(FileNotFoundError, match="logging.dump_tokens_every=0"):
        load_dump(tmp_path)
    write_dump(tmp_path, step=2)
    with pytest.raises(FileNotFoundError, match=r"steps with dumps: \[2\]"):
        load_dump(tmp_path, step=5)
    bad = json.loads((tmp_path / "dumps" / "step_000002.json").read_text())
    del bad["sequences"][1]["entropy"]
    (tmp_path / "dumps" / "step_000002.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=r"sequences\[1\] lacks field 'entropy'"):
        load_dump(tmp_path)


def test_phase_table_uses_the_updates_own_cells(tmp_path: Path) -> None:
    """A dump that carries the update's per-token ``cell`` is classified by it, not re-thresholded:
    here the training mini-batch's tau_h put seq 1's first token in lowp_lowh_neg although the
    dump-level thresholds would say highp_highh_neg."""
    dump = write_dump(tmp_path)
    before = phase_table(token_table(dump), TAU_P, TAU_H)
    for s in dump["sequences"]:
        s["cell"] = [-1] * len(s["tokens"])  # -1: not recorded, fall back to the thresholds
    dump["sequences"][1]["cell"][0] = CELLS.index("lowp_lowh_neg")
    after = phase_table(token_table(dump), TAU_P, TAU_H)
    assert after["lowp_lowh_neg"]["tokens"] == before["lowp_lowh_neg"]["tokens"] + 1
    assert sum(c["tokens"] for c in after.values()) == sum(c["tokens"] for c in before.values())


def test_inspect_shows_the_config_changes_of_resumes_up_to_its_step(tmp_path: Path) -> None:
    """A resume that changed trainer.lr from step 5 shows at step 7 and not at step 3; the table is
    not cut at 80 columns when stdout is not a terminal (no COLUMNS given)."""
    from typer.testing import CliRunner

    from stapo.cli.main import app

    run = tmp_path / "run"
    write_dump(run, step=3)
    write_dump(run, step=7)
    (run / "config.yaml").write_text("trainer:\n  lr: 1.0e-06\n")
    (run / "config_changes.jsonl").write_text(json.dumps(
        {"step": 5, "time": 0, "changes": [{"key": "trainer.lr", "old": 1e-6, "new": 0.5, "bookkeeping": False}]}) + "\n")
    res = CliRunner().invoke(app, ["inspect", str(run), "--out", str(tmp_path / "a")], env={"COLUMNS": ""})
    assert res.exit_code == 0, res.output
    assert "config changed by a resume, from step 5: trainer.lr 1e-06 -> 0.5" in res.output
    assert max(len(line) for line in res.output.splitlines()) > 80  # the tables keep their columns
    assert "grad-norm share %" in res.output  # a header not folded over lines
    report = json.loads((tmp_path / "a" / "inspect.json").read_text())
    assert report["config_changes"] == ["from step 5: trainer.lr 1e-06 -> 0.5"]
    assert "from step 5: trainer.lr 1e-06 -&gt; 0.5" in (tmp_path / "a" / "inspect.html").read_text()
    early = CliRunner().invoke(app, ["inspect", str(run), "--step", "3", "--out", str(tmp_path / "b")])
    assert early.exit_code == 0 and "config changed" not in early.output


def test_gradient_norms_pair_sum_q2_with_p_and_h_of_its_own_forward(tmp_path: Path) -> None:
    # The mask's p (0.3, the updated policy of a later mini-batch) differs from the sampled policy's
    # (0.5, whose next-token distribution is [0.5, 0.5]: sum q^2 = 0.5, H = ln 2). The norm takes the
    # sampled forward's p: |A| sqrt(1 - 2 * 0.5 + 0.5) = sqrt(0.5); with the mask's p it would be sqrt(0.9).
    seq = {"prompt": "q", "gold": "1", "reward": 1.0, "advantage": 1.0, "tokens": ["1"], "token_ids": [0],
           "prob": [0.3], "entropy": [0.2], "sum_q2": [0.5], "weight": [1.0],
           "dist_prob": [0.5], "dist_entropy": [math.log(2)]}
    table = token_table({"sequences": [seq]})
    m, t = grad_norms(*table.norm_terms(), table.advantage, table.sum_q2)
    assert m[0] == pytest.approx(math.sqrt(0.5)) and t[0] == pytest.approx(math.sqrt(0.5))
    older = {k: v for k, v in seq.items() if not k.startswith("dist_")}  # a dump without them: the mask's
    m_old, _ = grad_norms(*token_table({"sequences": [older]}).norm_terms(), np.array([1.0]), np.array([0.5]))
    assert m_old[0] == pytest.approx(math.sqrt(0.9))
