"""`stapo inspect`: the tokens a mask silenced, in context, and the token phase diagram of a step.

Reads the bounded token dumps that `stapo train` writes (``RUN/dumps/step_NNNNNN.json``; format in
docs/architecture.md) and shows

1. **silenced tokens in context** (the paper's Figure 2(c) view): every token whose weight is 0,
   with the text around it, its probability p, entropy H, the sequence's advantage A and the
   policy's top alternatives at that position — in the terminal (rich) and in ``inspect.html``;
2. **the phase diagram**: each valid token falls in one of 8 cells (p < tau_p or not) x
   (H < tau_h or not) x (A > 0 or A <= 0; the same convention as the ``phase/*`` training metrics),
   with the cell's share of tokens and share of the gradient norm w.r.t. the logits;
3. **Theorem 3.1's bound against the measured norm**: with ratio w = 1 at dump time the per-token
   gradient norm of the loss w.r.t. the logits is exactly ``|A| * sqrt(1 - 2p + sum_q q^2)``
   (``sum_q2`` in the dump); Theorem 3.1 writes it with ``e^{-H}`` in place of ``sum_q q^2``. By
   Jensen ``sum_q q^2 >= e^{-H}``, so the theorem's form never exceeds the measured value and is
   tight when the distribution is flat on its support; the scatter (``grad_norm_scatter.png``)
   shows how close the two are on real tokens, and the summary reports their ratio.

Thresholds come from the dump (``tau_p``, ``tau_h``); a dump without ``tau_h`` uses the paper's rule
on the dump's own candidates (the dump is a subset of the batch, so this is approximate).

Usage::

    report = inspect_run(Path("runs/stapo"), step=None, out_dir=Path("runs/stapo/inspect"))
    report["phase"]["lowp_lowh_pos"]["token_share"]
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from stapo.core.algos.metrics import grad_norms  # (public here too: stapo.evals.inspect.grad_norms)
from stapo.core.train.rundir import describe_config_changes
from stapo.evals.report import esc, fmt_num, html_page, html_table, img_tag, section

__all__ = [
    "CELLS",
    "TokenTable",
    "list_dumps",
    "load_dump",
    "token_table",
    "grad_norms",
    "phase_table",
    "silenced_tokens",
    "inspect_run",
    "terminal_tables",
]

CELLS = tuple(f"{p}_{h}_{a}" for p in ("lowp", "highp") for h in ("lowh", "highh") for a in ("pos", "neg"))
"""The 8 phase cells, in the order of the ``phase/*`` training metrics."""

_DUMP_RE = re.compile(r"^step_(\d+)\.json$")
_SEQ_KEYS = ("advantage", "tokens", "prob", "entropy", "weight")


def list_dumps(run_dir: Path) -> dict[int, Path]:
    """{step: dump path} of a run, sorted by step."""
    d = Path(run_dir) / "dumps"
    if not d.is_dir():
        return {}
    found = {int(m.group(1)): p for p in d.iterdir() if (m := _DUMP_RE.match(p.name))}
    return dict(sorted(found.items()))


def is_run_dir(path: Path) -> bool:
    """Whether ``path`` holds a training run (what `stapo train` writes first)."""
    return any((Path(path) / name).exists() for name in ("config.yaml", "metrics.jsonl", "dumps"))


def load_dump(run_dir: Path, step: int | None = None) -> dict[str, Any]:
    """The dump of ``step`` (default: the newest), validated: an error names the missing field."""
    run_dir = Path(run_dir)
    if run_dir.is_file():
        path = run_dir
    else:
        dumps = list_dumps(run_dir)
        if not dumps and not is_run_dir(run_dir):
            raise FileNotFoundError(
                f"inspect: {run_dir} is not a training run dir (no config.yaml, metrics.jsonl or dumps/); "
                "give the folder `stapo train --run-dir` wrote, or one dump file"
            )
        if not dumps:
            raise FileNotFoundError(
                f"inspect: no token dumps in {run_dir / 'dumps'}; this run was trained with "
                "logging.dump_tokens_every=0 (a run with it > 0 writes one every N steps)"
            )
        if step is None:
            step = max(dumps)
        if step not in dumps:
            raise FileNotFoundError(f"inspect: no dump for --step {step}; steps with dumps: {sorted(dumps)}")
        path = dumps[step]
    dump = json.loads(path.read_text())
    for key in ("step", "tau_p", "sequences"):
        if key not in dump:
            raise ValueError(f"{path}: token dump lacks field {key!r}")
    for i, seq in enumerate(dump["sequences"]):
        for key in _SEQ_KEYS:
            if key not in seq:
                raise ValueError(f"{path}: sequences[{i}] lacks field {key!r}")
        n = len(seq["tokens"])
        for key in ("prob", "entropy", "weight", "sum_q2", "dist_prob", "dist_entropy"):
            if key in seq and len(seq[key]) != n:
                raise ValueError(f"{path}: sequences[{i}].{key} has {len(seq[key])} entries for {n} tokens")
    dump["_path"] = str(path)
    return dump


@dataclass(frozen=True)
class TokenTable:
    """All dumped tokens flattened: one entry per token, arrays of shape [N]."""

    seq: np.ndarray  # [N] int, index of the sequence in the dump
    pos: np.ndarray  # [N] int, position in the response
    prob: np.ndarray  # [N] float
    entropy: np.ndarray  # [N] float
    advantage: np.ndarray  # [N] float (the sequence's advantage, shared by its tokens)
    sum_q2: np.ndarray  # [N] float (nan when the dump has none)
    weight: np.ndarray  # [N] float
    cell: np.ndarray | None = None  # [N] int, the update's own phase cell (-1 = not in the dump)
    dist_prob: np.ndarray | None = None  # [N] float, p of the forward that gave sum_q2
    dist_entropy: np.ndarray | None = None  # [N] float, H of that forward

    def norm_terms(self) -> tuple[np.ndarray, np.ndarray]:
        """(p, H) to pair with ``sum_q2`` in a gradient norm: the same forward's, when the dump has them
        (with several mini-batches the mask's p and H are the updated policy's, sum_q2 the sampled one's);
        a dump without them gives the mask's."""
        if self.dist_prob is None or self.dist_entropy is None:
            return self.prob, self.entropy
        return self.dist_prob, self.dist_entropy


def token_table(dump: dict[str, Any]) -> TokenTable:
    """Flatten the dump's sequences into per-token arrays."""
    seq, pos, prob, ent, adv, q2, w, cell = [], [], [], [], [], [], [], []
    dprob, dent = [], []
    paired = all("dist_prob" in s and "dist_entropy" in s for s in dump["sequences"])
    for i, s in enumerate(dump["sequences"]):
        n = len(s["tokens"])
        seq += [i] * n
        pos += list(range(n))
        prob += s["prob"]
        ent += s["entropy"]
        adv += [float(s["advantage"])] * n
        q2 += s.get("sum_q2") or [math.nan] * n
        w += s["weight"]
        cell += s.get("cell") or [-1] * n
        if paired:
            dprob += s["dist_prob"]
            dent += s["dist_entropy"]
    f = np.float64
    return TokenTable(
        np.asarray(seq, dtype=np.int64), np.asarray(pos, dtype=np.int64), np.asarray(prob, dtype=f),
        np.asarray(ent, dtype=f), np.asarray(adv, dtype=f), np.asarray(q2, dtype=f), np.asarray(w, dtype=f),
        np.asarray(cell, dtype=np.int64),
        np.asarray(dprob, dtype=f) if paired else None, np.asarray(dent, dtype=f) if paired else None,
    )


def resolve_tau_h(dump: dict[str, Any], table: TokenTable) -> tuple[float, str]:
    """(tau_h, where it came from): the dump's value (the mean of its mini-batches' tau_h^(q)), else the
    paper's rule on the dump itself: the q-th quantile of the dumped candidates' entropies (A > 0,
    p < tau_p; q from the dump, else the paper's 0.75)."""
    tau_h = dump.get("tau_h")
    if isinstance(tau_h, (int, float)) and math.isfinite(tau_h):
        return float(tau_h), "dump"
    q = float(dump.get("q", 0.75))
    cand = (table.advantage > 0) & (table.prob < float(dump["tau_p"]))
    if not cand.any():
        return float("nan"), "no candidate in the dump (A > 0, p < tau_p): nothing below tau_h"
    return float(np.quantile(table.entropy[cand], q)), f"the q={q:g} quantile of the dumped candidates' entropies"


def cell_index(table: TokenTable, tau_p: float, tau_h: float) -> np.ndarray:
    """[N] index into :data:`CELLS` of every token.

    Tokens whose dump carries the update's own cell (``cell``, written by the training loop from the
    p, H and tau_h its token weighting used at that mini-batch) keep it, so the phase table agrees
    with the ``phase/*`` metrics by construction; older dumps are classified from the thresholds.
    """
    highp = (table.prob >= tau_p).astype(np.int64)
    highh = (table.entropy >= tau_h).astype(np.int64)
    neg = (table.advantage <= 0).astype(np.int64)
    idx = highp * 4 + highh * 2 + neg
    if table.cell is not None and table.cell.shape == idx.shape:
        idx = np.where(table.cell >= 0, table.cell, idx)
    return idx


def phase_table(table: TokenTable, tau_p: float, tau_h: float) -> dict[str, dict[str, float]]:
    """Per cell: token count and share, measured and theorem gradient-norm shares, silenced share.

    Shares of gradient norm are sum of per-token norms in the cell over the sum over all tokens
    (the L1 split of where the update's magnitude comes from, before any mask).
    """
    measured, theorem = grad_norms(*table.norm_terms(), table.advantage, table.sum_q2)
    idx = cell_index(table, tau_p, tau_h)
    n = max(len(idx), 1)
    tot_m = float(np.nansum(measured)) or 1.0
    tot_t = float(np.nansum(theorem)) or 1.0
    out: dict[str, dict[str, float]] = {}
    for c, name in enumerate(CELLS):
        sel = idx == c
        cnt = int(sel.sum())
        out[name] = {
            "tokens": cnt,
            "token_share": cnt / n,
            "grad_share": float(np.nansum(measured[sel])) / tot_m,
            "grad_share_theorem": float(np.nansum(theorem[sel])) / tot_t,
            "mean_grad": float(np.nanmean(measured[sel])) if cnt else 0.0,
            "silenced": int((table.weight[sel] == 0).sum()),
        }
    return out


def silenced_tokens(dump: dict[str, Any], *, context_chars: int = 60, right_chars: int = 24) -> list[dict[str, Any]]:
    """Every zero-weight token with its left/right context text, p, H, A and top alternatives."""
    out = []
    for i, s in enumerate(dump["sequences"]):
        toks = [str(t) for t in s["tokens"]]
        top = s.get("top") or []
        q2 = s.get("sum_q2")
        for t, w in enumerate(s["weight"]):
            if w != 0:
                continue
            left = "".join(toks[:t])[-context_chars:]
            right = "".join(toks[t + 1 :])[:right_chars]
            p, h, a = float(s["prob"][t]), float(s["entropy"][t]), float(s["advantage"])
            dp, dh = (s["dist_prob"][t], s["dist_entropy"][t]) if "dist_prob" in s and "dist_entropy" in s else (p, h)
            m, th = grad_norms(np.array([dp]), np.array([dh]), np.array([a]),
                               np.array([q2[t] if q2 else math.nan]))
            out.append({
                "seq": i, "pos": t, "token": toks[t], "left": left, "right": right,
                "prob": p, "entropy": h, "advantage": a, "reward": s.get("reward"),
                "grad_norm": float(m[0]), "grad_norm_theorem": float(th[0]),
                "top": [[str(a_), float(b_)] for a_, b_ in (top[t] if t < len(top) else [])],
            })
    return out


# ----------------------------------------------------------------------------- plots


def _plots(table: TokenTable, tau_p: float, tau_h: float, out_dir: Path) -> dict[str, Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    measured, _ = grad_norms(*table.norm_terms(), table.advantage, table.sum_q2)
    # Per unit |A|: the token-level factor sqrt(1 - 2p + .) that the theorem is about (|A| is shared
    # by a whole sequence and would only stretch the cloud along y = x).
    fac_m, fac_t = grad_norms(*table.norm_terms(), np.ones_like(table.prob), table.sum_q2)
    idx = cell_index(table, tau_p, tau_h)
    ok = np.isfinite(fac_m) & (fac_m > 0) & (fac_t > 0)

    # Scatter: theorem form vs measured, colored by cell; silenced tokens ringed.
    if ok.any():
        fig, ax = plt.subplots(figsize=(6.4, 5.2), dpi=110)
        cmap = plt.get_cmap("tab10")
        for c, name in enumerate(CELLS):
            sel = ok & (idx == c)
            if sel.any():
                ax.scatter(fac_t[sel], fac_m[sel], s=10, alpha=0.6, color=cmap(c), label=name)
        sil = ok & (table.weight == 0)
        if sil.any():
            ax.scatter(fac_t[sil], fac_m[sil], s=40, facecolors="none", edgecolors="black",
                       linewidths=0.8, label="silenced (weight 0)")
        lo = float(min(fac_t[ok].min(), fac_m[ok].min()))
        hi = float(max(fac_t[ok].max(), fac_m[ok].max()))
        ax.plot([lo, hi], [lo, hi], color="gray", linestyle="--", linewidth=1, label="y = x")
        hidden = int((np.isfinite(fac_m) & (fac_t == 0)).sum())
        if hidden:
            ax.text(0.99, 0.01, f"{hidden} tokens with 1 - 2p + e^-H < 0 not shown", transform=ax.transAxes,
                    ha="right", va="bottom", fontsize=7, color="gray")
        ax.set_xlabel("Theorem 3.1 form  sqrt(1 - 2p + e^-H)")
        ax.set_ylabel("measured  sqrt(1 - 2p + sum q^2)")
        ax.set_title("per-token gradient norm w.r.t. logits per unit |A| (ratio = 1)", fontsize=10)
        ax.grid(True, alpha=0.3, which="both")
        ax.legend(fontsize=7, frameon=False, loc="upper left")
        fig.tight_layout()
        written["scatter"] = out_dir / "grad_norm_scatter.png"
        fig.savefig(written["scatter"])
        plt.close(fig)

    # Phase plane: probability vs entropy, thresholds drawn, pos / neg advantage side by side.
    if len(table.prob):
        fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), dpi=110, sharey=True)
        for ax, (title, sel) in zip(axes, (("A > 0", table.advantage > 0), ("A <= 0", table.advantage <= 0)),
                                    strict=True):
            norm = measured[sel]
            sc = ax.scatter(np.clip(table.prob[sel], 1e-8, 1.0), table.entropy[sel], c=norm, s=8, cmap="viridis",
                            alpha=0.7)
            silsel = sel & (table.weight == 0)
            if silsel.any():
                ax.scatter(np.clip(table.prob[silsel], 1e-8, 1.0), table.entropy[silsel], s=36,
                           facecolors="none", edgecolors="red", linewidths=0.9, label="silenced")
                ax.legend(fontsize=8, frameon=False, loc="upper right")
            ax.axvline(tau_p, color="red", linestyle="--", linewidth=1)
            ax.axhline(tau_h, color="red", linestyle=":", linewidth=1)
            ax.set_xscale("log")
            ax.set_xlabel("token probability p")
            ax.set_title(f"{title}  (tau_p={tau_p:g}, tau_h={tau_h:.3g})", fontsize=10)
            ax.grid(True, alpha=0.3)
            fig.colorbar(sc, ax=ax, label="measured grad norm")
        axes[0].set_ylabel("entropy H (nats)")
        fig.tight_layout()
        written["phase"] = out_dir / "phase_plane.png"
        fig.savefig(written["phase"])
        plt.close(fig)
    return written


# ----------------------------------------------------------------------------- report


def inspect_run(run: Path, *, step: int | None = None, out_dir: Path | None = None,
                max_rows: int = 200) -> dict[str, Any]:
    """Analyse one dump; write ``inspect.json``, PNGs and ``inspect.html`` under ``out_dir`` if given."""
    dump = load_dump(run, step)
    table = token_table(dump)
    tau_p = float(dump["tau_p"])
    tau_h, tau_h_src = resolve_tau_h(dump, table)
    measured, theorem = grad_norms(*table.norm_terms(), table.advantage, table.sum_q2)
    ok = np.isfinite(measured) & (measured > 0)
    ratio = theorem[ok] / measured[ok]
    sil = silenced_tokens(dump)
    report: dict[str, Any] = {
        "dump": dump["_path"],
        "step": int(dump["step"]),
        "token_weighting": dump.get("token_weighting"),
        "tau_p": tau_p,
        "tau_h": tau_h,
        "tau_h_source": tau_h_src,
        "sequences": len(dump["sequences"]),
        "tokens": int(table.prob.size),
        "silenced": len(sil),
        "silenced_frac": len(sil) / max(int(table.prob.size), 1),
        "phase": phase_table(table, tau_p, tau_h),
        "bound": {
            "tokens_compared": int(ok.sum()),
            "theorem_over_measured_mean": float(ratio.mean()) if ratio.size else None,
            "theorem_over_measured_min": float(ratio.min()) if ratio.size else None,
            "theorem_over_measured_max": float(ratio.max()) if ratio.size else None,
            "theorem_le_measured_frac": float((ratio <= 1 + 1e-9).mean()) if ratio.size else None,
            # 1 - 2p + e^{-H} can be < 0 (e^{-H} < p^2 when the sampled token dominates): the
            # theorem's form is then no norm at all and is clamped to 0 above.
            "theorem_radicand_negative_frac": float(
                np.mean(1.0 - 2.0 * table.prob + np.exp(-table.entropy) < 0)
            ) if table.prob.size else None,
            "mean_measured_silenced": float(np.mean([s["grad_norm"] for s in sil])) if sil else None,
            "mean_measured_all": float(np.nanmean(measured)) if measured.size else None,
        },
        "silenced_tokens": sil,
        # resumes that changed the config, up to this step (stapo.core.train.rundir's record)
        "config_changes": describe_config_changes(_run_of(dump), up_to=int(dump["step"])),
    }
    if out_dir is not None:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        pngs = _plots(table, tau_p, tau_h, out_dir)
        report["plots"] = {k: p.name for k, p in pngs.items()}
        (out_dir / "inspect.json").write_text(json.dumps(report, indent=2, ensure_ascii=False))
        (out_dir / "inspect.html").write_text(render_html(report, dump, pngs, max_rows=max_rows), encoding="utf-8")
    return report


def _run_of(dump: dict[str, Any]) -> Path:
    """The run dir of a dump file (``RUN/dumps/step_N.json``)."""
    return Path(dump["_path"]).parent.parent


def fmt_p(p: float, tau_p: float) -> str:
    """``p`` with the fewest significant digits (4 or more) that keep it on its side of ``tau_p``:
    0.0099996 under tau_p 0.01 prints 0.0099996, not 0.0100, so a listed silenced token never reads
    as p >= tau_p."""
    for digits in range(4, 18):
        txt = f"{p:.{digits}g}"
        if (float(txt) < tau_p) == (p < tau_p):
            return txt
    return repr(p)


def _top_txt(top: list[list[Any]]) -> str:
    return "  ".join(f"{tok!r} {p:.3g}" for tok, p in top)


def _phase_rows(report: dict[str, Any]) -> list[list[str]]:
    rows = []
    for name, c in report["phase"].items():
        rows.append([name, str(c["tokens"]), f"{100 * c['token_share']:.2f}", f"{100 * c['grad_share']:.2f}",
                     f"{100 * c['grad_share_theorem']:.2f}", fmt_num(c["mean_grad"], 3), str(c["silenced"])])
    return rows


_PHASE_HEADER = ["cell (p x H x A)", "tokens", "token share %", "grad-norm share %", "theorem share %",
                 "mean grad norm", "silenced"]


def render_html(report: dict[str, Any], dump: dict[str, Any], pngs: dict[str, Path], *, max_rows: int = 200) -> str:
    """Summary, phase table, plots, silenced tokens in context, and each sequence with silenced tokens marked."""
    b = report["bound"]
    parts = []
    summary = [
        ["step", str(report["step"])], ["token weighting", str(report["token_weighting"])],
        ["tau_p", f"{report['tau_p']:g}"], ["tau_h", f"{report['tau_h']:.4g} ({report['tau_h_source']})"],
        ["sequences / tokens", f"{report['sequences']} / {report['tokens']}"],
        ["silenced tokens", f"{report['silenced']} ({100 * report['silenced_frac']:.2f}%)"],
        ["theorem / measured grad norm (mean, min, max)",
         f"{fmt_num(b['theorem_over_measured_mean'])}, {fmt_num(b['theorem_over_measured_min'])}, "
         f"{fmt_num(b['theorem_over_measured_max'])}"],
        ["tokens where 1 - 2p + e^{-H} < 0 (theorem form clamped to 0)",
         f"{100 * (b['theorem_radicand_negative_frac'] or 0):.1f}%"],
        ["mean measured grad norm: silenced vs all",
         f"{fmt_num(b['mean_measured_silenced'])} vs {fmt_num(b['mean_measured_all'])}"],
        *(["config changed by a resume (config.yaml holds the first config)", line]
          for line in report.get("config_changes") or []),
    ]
    parts.append(section("Summary", html_table(None, summary, left_cols=2)))
    parts.append(section(
        "Token phase diagram",
        '<p class="meta">Cells: p &lt; tau_p (lowp) or not, H &lt; tau_h (lowh) or not, A &gt; 0 (pos) or A &lt;= 0 '
        "(neg). Grad-norm share = sum of per-token norms |A|·sqrt(1 - 2p + Σq²) in the cell over the total; "
        "theorem share uses e^{-H} in place of Σq² (Theorem 3.1). S2T silences lowp_lowh_pos.</p>"
        + html_table(_PHASE_HEADER, _phase_rows(report), table_id="table-phase"),
    ))
    if pngs:
        figs = "".join(f"<figure>{img_tag(p, k)}<figcaption>{esc(p.name)}</figcaption></figure>"
                       for k, p in pngs.items())
        parts.append(section("Plots", f'<div class="grid">{figs}</div>'))
    sil = report["silenced_tokens"]
    rows = []
    for s in sil[:max_rows]:
        ctx = (f'<span class="ctx">{esc(s["left"])}<span class="sil">{esc(s["token"])}</span>'
               f'{esc(s["right"])}</span>')
        rows.append([str(s["seq"]), str(s["pos"]), ctx, fmt_p(s["prob"], report["tau_p"]), f"{s['entropy']:.4g}",
                     f"{s['advantage']:+.3f}", fmt_num(s["grad_norm"]), esc(_top_txt(s["top"]))])
    more = f'<p class="meta">showing {min(len(sil), max_rows)} of {len(sil)}</p>' if len(sil) > max_rows else ""
    parts.append(section(
        f"Silenced tokens in context ({len(sil)})",
        (html_table(["seq", "pos", "context (silenced token marked)", "p", "H", "A", "grad norm",
                     "top alternatives (token, prob)"], rows, raw=True, left_cols=3, left_also=(7,),
                    table_id="table-silenced")
         if rows else "<p>No token has weight 0 in this dump.</p>") + more,
    ))
    seq_html = []
    for i, s in enumerate(dump["sequences"]):
        spans = []
        top = s.get("top") or []
        for t, tok in enumerate(s["tokens"]):
            tip = f"p={fmt_p(s['prob'][t], report['tau_p'])} H={s['entropy'][t]:.4g} w={s['weight'][t]:g}"
            if t < len(top) and top[t]:
                tip += " | top: " + _top_txt(top[t])
            cls = ' class="sil"' if s["weight"][t] == 0 else ""
            spans.append(f'<span{cls} title="{esc(tip)}">{esc(tok)}</span>')
        n_sil = sum(1 for w in s["weight"] if w == 0)
        head = (f"seq {i}: reward {s.get('reward')}, advantage {float(s['advantage']):+.3f}, gold {s.get('gold')!s}, "
                f"{len(s['tokens'])} tokens, {n_sil} silenced")
        seq_html.append(
            f"<details{' open' if n_sil and i < 3 else ''}><summary>{esc(head)}</summary>"
            f'<div class="meta">prompt (tail): </div><div class="tok">{esc(s.get("prompt", ""))}</div>'
            f'<div class="meta">response (hover a token for p, H, weight, top alternatives):</div>'
            f'<div class="tok">{"".join(spans)}</div></details>'
        )
    parts.append(section("Sequences", "".join(seq_html)))
    return html_page(f"stapo inspect — step {report['step']}", parts, subtitle=report["dump"])


def terminal_tables(report: dict[str, Any], *, max_rows: int = 20) -> list[Any]:
    """Rich renderables: silenced tokens in context, then the phase table and the bound summary."""
    from rich.table import Table
    from rich.text import Text

    out: list[Any] = []
    for line in report.get("config_changes") or []:
        out.append(Text(f"config changed by a resume, {line} (config.yaml holds the first config)", style="yellow"))
    sil = report["silenced_tokens"]
    t = Table(title=f"silenced tokens at step {report['step']} ({len(sil)} of {report['tokens']} tokens)",
              show_lines=False)
    for col, just in (("seq", "right"), ("context", "left"), ("p", "right"), ("H", "right"), ("A", "right"),
                      ("top alternatives", "left")):
        t.add_column(col, justify=just, overflow="fold")  # type: ignore[arg-type]
    for s in sil[:max_rows]:
        ctx = Text(s["left"][-40:].replace("\n", "⏎"), style="dim")
        ctx.append("⟦" + s["token"].replace("\n", "⏎") + "⟧", style="bold red reverse")
        ctx.append(s["right"].replace("\n", "⏎"), style="dim")
        t.add_row(f"{s['seq']}:{s['pos']}", ctx, fmt_p(s["prob"], report["tau_p"]), f"{s['entropy']:.4g}",
                  f"{s['advantage']:+.2f}",
                  _top_txt(s["top"][:3]))
    out.append(t if sil else Text(f"no silenced tokens at step {report['step']} ({report['tokens']} tokens dumped)"))
    pt = Table(title=f"phase diagram (tau_p={report['tau_p']:g}, tau_h={report['tau_h']:.3g})")
    for i, col in enumerate(_PHASE_HEADER):
        # the cell name never folds: the numbers wrap first on a narrow terminal
        pt.add_column(col, justify="left" if i == 0 else "right", no_wrap=i == 0, min_width=18 if i == 0 else None)
    for row in _phase_rows(report):
        pt.add_row(*row)
    out.append(pt)
    b = report["bound"]
    out.append(Text(
        f"Theorem 3.1 form / measured grad norm over {b['tokens_compared']} tokens: mean "
        f"{fmt_num(b['theorem_over_measured_mean'])}, min {fmt_num(b['theorem_over_measured_min'])}, "
        f"max {fmt_num(b['theorem_over_measured_max'])} (<= 1 by Jensen); 1 - 2p + e^-H < 0 on "
        f"{100 * (b['theorem_radicand_negative_frac'] or 0):.1f}% of tokens"
    ))
    return out
