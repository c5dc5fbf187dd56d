"""The shipped recipes are what their names say: each recipe's defining differences, checked on the
resolved (validated) configs, and the `stapo recipes` command that lists and diffs them."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from stapo.cli.main import app
from stapo.cli.recipes import LAYER_KEYS, LAYER_RECIPES, layer_drift, owned_by, recipe_header, resolved_diff
from stapo.configs import preset_names, preset_path
from stapo.core.config import load_config

RECIPES = ["stapo", "stapo-base", "stapo-random", "stapo-high-entropy", "stapo-complement", "justrl-fullmask", "dapo", "grpo",
           "20-entropy", "justrl", "stare", "lp-reg", "gspo", "entropy-bonus"]
ABLATIONS = {"stapo-random": "random", "stapo-high-entropy": "highest_entropy", "stapo-complement": "complement",
             "justrl-fullmask": "all"}


def cfg(name: str):
    return load_config(preset_path(name))


def diff(a: str, b: str) -> dict[str, tuple]:
    return {k: (va, vb) for k, va, vb in resolved_diff(preset_path(a), preset_path(b))}


def test_every_recipe_is_shipped_with_a_header_and_sources():
    assert set(RECIPES) <= set(preset_names())
    for name in RECIPES:
        path = preset_path(name)
        h = recipe_header(path)
        assert h["recipe"] and h["source"], name
        # every algorithm / trainer / rollout value line carries a provenance tag
        body = path.read_text().split("\nalgorithm:", 1)[1].split("\nreward:", 1)[0]
        for line in body.splitlines():
            if re.match(r"^\s+\w+: \S", line) and not line.strip().startswith(("name:", "backend:", "logits_chunk_size:")):
                assert re.search(r"#.*\[", line), f"{name}: no source tag on {line.strip()!r}"


def test_stapo_is_the_papers_appendix_table():
    """arXiv 2602.15620v1, appendix "Full Training Hyperparameters" and "Training Details"."""
    c = cfg("stapo")
    a, t, ro, d = c.algorithm, c.trainer, c.rollout, c.data
    assert (a.token_weighting, a.s2t.tau_p, a.s2t.q, a.s2t.silence) == ("s2t", 0.002, 0.75, "lowest_entropy")
    assert (ro.prompts_per_step, ro.n, a.mini_batches, a.ppo_epochs) == (256, 8, 4, 1)  # mini-batch 64 of 256
    assert (ro.max_new_tokens, d.max_prompt_tokens, ro.temperature, ro.top_p) == (15360, 1024, 1.0, 1.0)
    assert not a.dynamic_sampling and not a.overlong.enabled and (a.kl_coef, a.entropy_coef) == (0.0, 0.0)
    assert (a.eps_low, a.eps_high, a.aggregation, a.advantage) == (0.2, 0.28, "token-mean", "grpo")
    assert (t.lr, t.lr_schedule, t.warmup_steps, t.max_grad_norm, t.micro_batch_size) == (1e-6, "constant", 10, 1.0, 1)
    assert (d.source, d.template, c.reward.scale.correct, c.reward.scale.wrong) == ("dapo_math_17k", "boxed", 1.0, -1.0)
    assert c.eval.benchmarks == ["aime24", "aime25", "amc23", "math500", "minerva_math", "olympiadbench"]
    text = preset_path("stapo").read_text()
    assert "[unconfirmed]" not in text and "[paper]" not in text  # every paper value names the version


def test_stapo_base_and_the_ablations_differ_from_stapo_in_the_weighting_only():
    assert diff("stapo-base", "stapo") == {
        "algorithm.name": ("stapo-base", "stapo"),
        "algorithm.token_weighting": ("none", "s2t"),
    }
    for name, silence in ABLATIONS.items():
        assert diff("stapo", name) == {"algorithm.name": ("stapo", name),
                                       "algorithm.s2t.silence": ("lowest_entropy", silence)}


def test_dapo_is_dapo():
    a, r = cfg("dapo").algorithm, cfg("dapo").reward
    assert (a.eps_low, a.eps_high, a.aggregation, a.kl_coef) == (0.2, 0.28, "token-mean", 0.0)
    assert a.dynamic_sampling and a.dynamic_sampling_metric == "acc"
    assert a.overlong.enabled and a.overlong.filter and a.overlong.penalty == 1.0
    assert (r.scale.correct, r.scale.wrong) == (1.0, -1.0)
    assert a.token_weighting == "none" and a.advantage == "grpo"


def test_grpo_is_vanilla():
    c = cfg("grpo")
    a = c.algorithm
    assert (a.eps_low, a.eps_high) == (0.2, 0.2)  # symmetric clip
    assert a.aggregation == "seq-mean-token-mean" and a.advantage == "grpo"
    assert not a.dynamic_sampling and not a.overlong.enabled and not a.overlong.filter
    assert a.dual_clip_c is None and a.token_weighting == "none" and a.policy_loss == "ppo_clip"
    assert a.kl.reference == "initial" and a.kl.estimator == "k3" and not a.kl.in_reward  # optional KL
    assert (c.reward.scale.correct, c.reward.scale.wrong) == (1.0, 0.0)
    assert diff("grpo", "justrl") != {}  # GRPO and JustRL are distinct recipes


def test_twenty_entropy_is_dapo_setup_plus_top_entropy():
    d = diff("dapo", "20-entropy")
    assert d.pop("algorithm.token_weighting") == ("none", "top_entropy")
    assert d.pop("algorithm.name") == ("dapo", "20-entropy")
    # the authors' DAPO setup: their n, batch, budget and overlong buffer; nothing else changes
    assert set(d) == {"rollout.n", "rollout.prompts_per_step", "rollout.max_new_tokens", "algorithm.overlong.buffer"}
    c = cfg("20-entropy")
    assert (c.rollout.n, c.rollout.prompts_per_step, c.algorithm.overlong.buffer) == (16, 512, 4096)
    assert c.algorithm.top_entropy.rho == 0.2 and c.algorithm.top_entropy.denominator == "kept"


def test_justrl_is_plain_grpo_with_clip_higher():
    a, c = cfg("justrl").algorithm, cfg("justrl")
    assert (a.eps_low, a.eps_high, a.kl_coef, a.entropy_coef) == (0.2, 0.28, 0.0, 0.0)
    assert not a.dynamic_sampling and not a.overlong.enabled and a.token_weighting == "none"
    assert c.reward.mode == "dapo" and c.reward.scale.wrong == 0.0 and c.trainer.warmup_steps == 0


def test_stare_lp_reg_gspo_entropy_bonus():
    s = cfg("stare").algorithm
    assert s.token_weighting == "stare" and not s.stare.adaptive and (s.stare.w, s.stare.m) == (1.1, 0.9)
    assert (s.stare.top_ratio, s.stare.target_entropy, s.stare.alpha) == (0.1, 0.3, 0.01)
    assert (s.stare.w_max, s.stare.m_min, s.stare.variant) == (1.5, 0.5, "O1")
    lp = cfg("lp-reg").algorithm
    assert lp.lp_reg.enabled and lp.token_weighting == "none"  # the PG term stays on every token
    assert (lp.lp_reg.rho, lp.lp_reg.min_p, lp.lp_reg.coef, lp.lp_reg.estimator) == (0.01, 0.02, 1.0, "k3")
    g = cfg("gspo").algorithm
    assert g.policy_loss == "gspo" and (g.eps_low, g.eps_high) == (3e-4, 4e-4) and g.aggregation == "seq-mean-token-mean"
    d = diff("dapo", "entropy-bonus")
    assert d == {"algorithm.name": ("dapo", "entropy-bonus"), "algorithm.entropy_coef": (0.0, 0.001),
                 "trainer.entropy_grad": (False, True)}


def test_recipes_cli_lists_and_diffs():
    runner = CliRunner()
    out = runner.invoke(app, ["recipes"])
    assert out.exit_code == 0, out.output
    for name in RECIPES:
        assert re.search(rf"^{re.escape(name)}\s", out.output, re.M), name
    assert "arXiv 2602.15620" in out.output and "Lp-Reg-dev" in out.output
    out = runner.invoke(app, ["recipes", "diff", "stapo-base", "stapo"])
    assert out.exit_code == 0, out.output
    lines = [ln for ln in out.output.splitlines()[1:] if ln.strip()]
    assert len(lines) == 2 and "algorithm.token_weighting  'none' -> 's2t'" in out.output
    out = runner.invoke(app, ["recipes", "diff", "dapo", "dapo"])
    assert "resolve to the same config" in out.output
    out = runner.invoke(app, ["recipes", "diff", "stapo-base", "stapo", "--set", "algorithm.s2t.tau_p=0.02"])
    assert "algorithm.s2t.tau_p" in out.output


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_batch_divides_into_mini_batches(name):
    c = cfg(name)
    assert (c.rollout.prompts_per_step * c.rollout.n) % c.algorithm.mini_batches == 0


LAYER_RECIPES_SHIPPED = [n for n in preset_names() if n.startswith("stapo-") or n == "justrl-fullmask"]


def test_every_stapo_layer_recipe_is_declared():
    assert set(LAYER_RECIPES_SHIPPED) == set(LAYER_RECIPES), (
        "every shipped stapo-* recipe must declare its layers in stapo.cli.recipes.LAYER_RECIPES"
    )


@pytest.mark.parametrize("name", LAYER_RECIPES_SHIPPED)
def test_layer_recipe_is_stapo_plus_its_layer_keys_only(name):
    assert layer_drift(name, preset_path("stapo"), preset_path(name)) == []
    d = diff("stapo", name)
    assert d["algorithm.name"] == ("stapo", name)
    for layer in LAYER_RECIPES[name]:  # and each of its layers is actually switched on
        switched = [k for k in d if owned_by(k, LAYER_KEYS[layer])]
        assert switched, (name, layer)


def test_layer_drift_catches_a_key_the_layer_does_not_own(tmp_path):
    bad = tmp_path / "stapo-maspo.yaml"
    bad.write_text(preset_path("stapo-maspo").read_text() + "  mini_batches: 16\n")  # under its algorithm:
    drift = layer_drift("stapo-maspo", preset_path("stapo"), bad)
    assert drift == [("algorithm.mini_batches", 4, 16)]
    assert owned_by("data.goldilocks.lr", LAYER_KEYS["goldilocks"])
    assert not owned_by("data.goldilocks_x", LAYER_KEYS["goldilocks"]) and not owned_by("data.samplerx", ("data.sampler",))


def test_recipes_matched_gives_both_the_same_budget_and_grader(tmp_path):
    from stapo.core.fairness import config_differences

    runner = CliRunner()
    out = runner.invoke(app, ["recipes", "matched", "justrl", "20-entropy", "--out", str(tmp_path)])
    assert out.exit_code == 0, out.output
    # 20-Entropy's own budget (512 x 16 x 20,480) and strictness give way to JustRL's reference values
    assert "--set rollout.prompts_per_step=256" in out.output and "--set reward.mode=dapo" in out.output
    assert out.output.count("256 x 8 x 8192 x 500 = 8,388,608,000; grader dapo, reward 1/0") == 2
    a, b = load_config(tmp_path / "justrl.yaml"), load_config(tmp_path / "20-entropy.yaml")
    da, db = a.model_dump(mode="json", by_alias=True), b.model_dump(mode="json", by_alias=True)
    diffs = config_differences(da, db)
    assert diffs and all(d.group in ("method", "execution") for d in diffs), [d for d in diffs if d.confound]
    assert b.algorithm.token_weighting == "top_entropy"  # the method itself is untouched
    assert a == cfg("justrl")  # the reference keeps its source's values
    c = cfg("20-entropy")  # and the shipped recipe is unchanged
    assert (c.rollout.prompts_per_step, c.rollout.n, c.rollout.max_new_tokens) == (512, 16, 20480)
    # --match-to b: the other way round; --set applies to both
    out = runner.invoke(app, ["recipes", "matched", "justrl", "20-entropy", "--match-to", "b",
                              "--set", "trainer.max_steps=7"])
    assert out.exit_code == 0, out.output
    assert out.output.count("512 x 16 x 20480 x 7 = ") == 2
    out = runner.invoke(app, ["recipes", "matched", "justrl", "stapo", "--match-to", "c"])
    assert out.exit_code != 0 and "--match-to must be" in str(out.exception)


def test_recipes_matched_shows_every_frame_and_names_the_differences(monkeypatch):
    """`stapo recipes matched` (no recipes): a row per shipped recipe with stapo's frame keys, the
    recipes meant to share stapo's frame do, the others are named with the keys that differ; a
    shared-frame recipe that drifts makes the command fail, naming it."""
    from stapo.core import fairness

    runner = CliRunner()
    out = runner.invoke(app, ["recipes", "matched"], env={"COLUMNS": "250"})
    assert out.exit_code == 0, out.output
    rows = {line.split()[0]: line for line in out.output.splitlines() if line.split()}
    for name in fairness.SHARED_FRAME:
        assert "differs" not in rows[name] and "shared" in rows[name], rows[name]
    assert "differs: algorithm.mini_batches" in rows["grpo"]
    assert "differs: rollout.prompts_per_step, rollout.n, algorithm.mini_batches, rollout.max_new_tokens" in rows["20-entropy"]
    assert "tiny" not in rows and "demo" not in rows
    monkeypatch.setattr(fairness, "SHARED_FRAME", (*fairness.SHARED_FRAME, "justrl"))
    out = runner.invoke(app, ["recipes", "matched"], env={"COLUMNS": "250"})
    assert out.exit_code != 0 and "differ: justrl" in str(out.exception)
    one = runner.invoke(app, ["recipes", "matched", "stapo"])
    assert one.exit_code != 0 and "give two recipes" in str(one.exception)


@pytest.mark.parametrize("name", sorted(__import__("stapo.core.fairness", fromlist=["x"]).SHARED_FRAME))
def test_shared_frame_is_the_papers_and_stated_once(name):
    """Every shared-frame recipe takes the frame from configs/stapo.yaml (`extends: stapo`), where each
    frame value carries the paper's tag: no copy can drift, no value rests on an untagged line."""
    if name != "stapo":
        text = preset_path(name).read_text()
        assert re.search(r"^extends: stapo$", text, re.M), name
        assert not re.search(r"^\s+(mini_batches|max_new_tokens|prompts_per_step|n):", text, re.M), name
    text = preset_path("stapo").read_text()
    for key in ("mini_batches: 4", "max_new_tokens: 15360", "prompts_per_step: 256", "n: 8"):
        line = re.search(rf"^  {key} .*$", text, re.M).group(0)
        assert "[paper v1]" in line, line
