"""`stapo train --config <recipe>` runs 2 steps on CPU for every shipped recipe, with tiny overrides.

The overrides swap the production frame (Qwen3 on vLLM + DeepSpeed, 8k tokens) for a tiny random
model on the hf engine and the torch backend, and shrink the batch; the recipe's algorithm stays.
A random model never answers right, so three overrides give the update something to learn from:
DAPO's overlong shaping over the whole 32-token budget (rewards then vary with length), dynamic
sampling on that reward instead of on accuracy (all-wrong groups would all be dropped), and a
larger Lp-Reg fraction (1% of a tiny batch is below the authors' k > 1 threshold). What is checked:
the run finishes, every step's metrics are finite, at least one update ran, and the recipe's own
mechanism reports (actor/kl, STARE's schedule, Lp-Reg's proxy).
"""

from __future__ import annotations

import math

import pytest
from typer.testing import CliRunner

from stapo.cli.main import app
from stapo.core.tracking import read_jsonl

TINY = [
    "model.name_or_path=tiny-random", "model.dtype=float32", "model.gradient_checkpointing=false",
    "model.tiny.hidden_size=32", "model.tiny.intermediate_size=64",
    "data.source=arithmetic", "data.template=short", "data.val_size=0", "data.arithmetic.num_problems=32",
    "rollout.engine=hf", "rollout.prompts_per_step=2", "rollout.n=4", "rollout.max_new_tokens=32",
    "algorithm.mini_batches=2", "algorithm.max_gen_rounds=2", "algorithm.gen_batch_multiplier=1",
    "algorithm.gen_rounds_exhausted=train",  # a random model: an under-filled batch must not stop the smoke run
    "algorithm.overlong.enabled=true", "algorithm.overlong.buffer=31", "algorithm.dynamic_sampling_metric=reward",
    "algorithm.lp_reg.rho=0.3",
    "trainer.backend=torch", "trainer.device=cpu", "trainer.max_steps=2", "trainer.micro_batch_size=4",
    "trainer.lr=1e-3", "trainer.warmup_steps=0",
    "reward.urls=[]", "reward.workers=1", "eval.every=0", "checkpoint.every=0", "checkpoint.export_hf=false",
    "logging.tensorboard=false", "logging.live=false", "logging.dump_tokens_every=0",
]

CASES = {
    "stapo": [], "dapo": [], "grpo": [], "20-entropy": [], "justrl": [], "stare": [], "lp-reg": [], "gspo": [],
    "entropy-bonus": [],
    # vanilla GRPO with its optional KL to the frozen initial policy switched on; STARE's schedule on
    "grpo+kl": ["algorithm.kl_coef=0.04"],
    "stare+adaptive": ["algorithm.stare.adaptive=true", "algorithm.name=stare-adaptive"],  # another method: its name
}
EXPECT = {"grpo+kl": ["actor/kl"], "stare": ["stare/reweight_w", "stare/gate_on"], "lp-reg": ["lp_reg/below_floor_frac"],
          "stare+adaptive": ["stare/reweight_w"]}


@pytest.mark.parametrize("case", list(CASES))
def test_recipe_trains_two_steps_on_cpu(case, tmp_path):
    recipe = case.split("+")[0]
    args = ["train", "--config", recipe, "--run-dir", str(tmp_path / case)]
    for o in TINY + CASES[case]:
        args += ["--set", o]
    out = CliRunner().invoke(app, args)
    assert out.exit_code == 0, out.output + repr(out.exception)
    rows = read_jsonl(tmp_path / case / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        bad = {k: v for k, v in r.items() if isinstance(v, float) and not math.isfinite(v) and k != "stare/batch_entropy"}
        assert not bad, bad
    assert any("actor/loss" in r for r in rows), "no update ran in 2 steps"
    for key in EXPECT.get(case, []):
        assert all(key in r for r in rows if "actor/loss" in r), key
    if case == "stare+adaptive":  # tiny-model entropy (~4.6) is above H_tgt 0.3: W steps down 0.01 per step
        assert [r["stare/reweight_w"] for r in rows] == pytest.approx([1.09, 1.08])


def test_stare_schedule_survives_resume(tmp_path):
    """W, M live in the checkpoint: 2 steps + resume to 3 continue the schedule (1.09, 1.08 -> 1.07)."""
    base = []
    for o in [*TINY, "algorithm.stare.adaptive=true", "algorithm.name=stare-adaptive"]:
        base += ["--set", o]
    runner, run_dir = CliRunner(), tmp_path / "stare"
    out = runner.invoke(app, ["train", "--config", "stare", "--run-dir", str(run_dir), *base])
    assert out.exit_code == 0, out.output + repr(out.exception)
    out = runner.invoke(app, ["train", "--run-dir", str(run_dir), "--resume", "--set", "trainer.max_steps=3"])
    assert out.exit_code == 0, out.output + repr(out.exception)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["stare/reweight_w"] for r in rows] == pytest.approx([1.09, 1.08, 1.07])
    assert [r["stare/reweight_m"] for r in rows] == pytest.approx([0.91, 0.92, 0.93])
