"""A token weighting registered from outside stapo trains by config alone.

The registration states everything the trainer needs (its options model, whether it reads p / H);
nothing else in stapo names it. Here a weighting that scales every valid token's weight by
``scale`` while keeping every token in the denominator: with token-mean aggregation its step-1 loss
is exactly ``scale`` times the `none` weighting's on the same rollouts (same seed, same model).
"""

from __future__ import annotations

import math

import pytest
from pydantic import Field

from stapo.configs import preset_path
from stapo.core.algos import TOKEN_WEIGHTS, TokenContext, TokenWeights, register_token_weighting
from stapo.core.config import ConfigError, load_config
from stapo.core.tracking import read_jsonl
from stapo.core.train.loop import train
from stapo.core.train.run import Run
from stapo.core.weighting_options import WeightingOptions

NAME = "scaled_test"


class ScaledOptions(WeightingOptions):
    scale: float = Field(1.0, gt=0, description="Weight of every valid token.")


@pytest.fixture
def scaled():
    @register_token_weighting(NAME, options=ScaledOptions, reads_stats=False)
    def scaled_weighting(ctx: TokenContext, *, scale: float) -> TokenWeights:
        return TokenWeights(weights=ctx.mask.to(ctx.weight_dtype) * scale, denom_mask=ctx.mask.clone())

    yield
    TOKEN_WEIGHTS.unregister(NAME)


def _cfg(*overrides: str):
    base = ["logging.live=false", "logging.tensorboard=false", "trainer.max_steps=1"]
    return load_config(preset_path("tiny"), [*base, *overrides])


def _step1_loss(cfg, run_dir) -> float:
    train(Run.build(cfg, run_dir, log=lambda m: None))
    return read_jsonl(run_dir / "metrics.jsonl")[0]["actor/loss"]


def test_registered_weighting_trains_by_config(scaled, tmp_path):
    plain = _step1_loss(_cfg("algorithm.token_weighting=none"), tmp_path / "none")
    cfg = _cfg(f"algorithm.token_weighting={NAME}", "algorithm.weighting_options.scale=0.25")
    assert cfg.algorithm.token_weighting_options() == ScaledOptions(scale=0.25)
    ours = _step1_loss(cfg, tmp_path / "scaled")
    assert plain != 0.0 and math.isclose(ours, 0.25 * plain, rel_tol=1e-5), (ours, plain)


def test_registered_weighting_options_are_checked(scaled):
    with pytest.raises(ConfigError, match=f"weighting_options for '{NAME}': scale"):
        _cfg(f"algorithm.token_weighting={NAME}", "algorithm.weighting_options.scale=-1")
    with pytest.raises(ConfigError, match=f"valid names: .*{NAME}"):
        _cfg("algorithm.token_weighting=scaled_tset")
