"""Config of asynchronous rollouts and VCPO: the `async` key (a Python keyword) round-trips, bad values
and unsupported combinations are refused naming the field, and `stapo-async` is `stapo` plus exactly
the fleet (`vllm_server`), async and off-policy keys."""

from __future__ import annotations

import pytest

from stapo.cli.recipes import resolved_diff
from stapo.configs import preset_path
from stapo.core.config import ConfigError, config_from_dict, load_config, save_config


def test_async_key_round_trips(tmp_path) -> None:
    cfg = config_from_dict({"rollout": {"async": {"enabled": True, "max_staleness": 3}}})
    assert cfg.rollout.async_.enabled and cfg.rollout.async_.max_staleness == 3
    save_config(cfg, tmp_path / "c.yaml")
    text = (tmp_path / "c.yaml").read_text()
    assert "  async:\n    enabled: true\n    max_staleness: 3" in text and "async_" not in text
    assert load_config(tmp_path / "c.yaml") == cfg
    assert config_from_dict(cfg.model_dump()) == cfg  # python-side name accepted too
    assert load_config(None, ["rollout.async.enabled=true"]).rollout.async_.enabled


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["rollout.async.max_staleness=-1"], "rollout.async.max_staleness"),
        (["rollout.async.enabled=true", "rollout.async.lag=2"], "rollout.async.lag: unknown field"),
        (["algorithm.off_policy.ess_lr_scaling=true"], "algorithm.off_policy.* acts on stale rollouts only: set rollout.async.enabled=true"),
        (["rollout.async.enabled=true", "algorithm.off_policy.ess_base_ratio=0"], "ess_base_ratio"),
        (["rollout.async.enabled=true", "algorithm.off_policy.behaviour_weight_cap=1.0"], "behaviour_weight_cap"),
        (["rollout.async.enabled=true", "algorithm.off_policy.min_variance_baseline=true",
          "algorithm.advantage=rloo"], "not rloo"),
        (["rollout.async.enabled=true", "data.sampler=goldilocks"], "data.sampler=uniform (got goldilocks)"),
    ],
)
def test_bad_async_configs_are_refused_naming_the_field(overrides, needle) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert needle in str(err.value)


def test_async_combines_with_deep_grpo() -> None:
    # branches are sampled by the learner at its current weights: on-policy continuations of stale prefixes
    cfg = load_config(None, ["rollout.async.enabled=true", "algorithm.deep_grpo.enabled=true"])
    assert cfg.rollout.async_.enabled and cfg.algorithm.deep_grpo.enabled


def test_stapo_async_is_stapo_plus_async_and_vcpo_keys_only() -> None:
    diff = {k: (a, b) for k, a, b in resolved_diff(preset_path("stapo"), preset_path("stapo-async"))}
    assert diff.pop("algorithm.name") == ("stapo", "stapo-async")
    assert set(diff) == {
        "rollout.async.enabled",
        "rollout.engine",  # an engine apart from the learners' GPUs: the fleet
        "rollout.server.urls",
        "rollout.server.weights_dir",
        "algorithm.off_policy.ess_lr_scaling",
    }
    c = load_config(preset_path("stapo-async"))
    assert c.rollout.async_.max_staleness == 1 and c.algorithm.off_policy.ess_rule == "sqrt"
    assert c.rollout.engine == "vllm_server" and not c.algorithm.off_policy.min_variance_baseline
