"""Config: YAML + --set overrides, validation errors that name the field, frozen, saved round trip."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from stapo.configs import preset_names, preset_path
from stapo.core.config import Config, ConfigError, field_docs, load_config, save_config

REPO = Path(__file__).resolve().parents[2]


def test_defaults_validate_and_are_frozen():
    cfg = load_config()
    assert cfg.algorithm.token_weighting == "s2t"
    assert (cfg.algorithm.s2t.tau_p, cfg.algorithm.s2t.q) == (0.002, 0.75)  # the paper's
    assert (cfg.algorithm.eps_low, cfg.algorithm.eps_high) == (0.2, 0.28)
    with pytest.raises(ValidationError):
        cfg.trainer.max_steps = 5  # frozen


def test_overrides_parse_yaml_values(tmp_path):
    cfg = load_config(
        None,
        [
            "trainer.max_steps=7",
            "algorithm.s2t.q=0.5",
            "algorithm.s2t.silence=random",
            "reward.urls=[http://a:1, http://b:2]",
            "data.arithmetic.ops=['+', '-']",
        ],
    )
    assert cfg.trainer.max_steps == 7
    assert cfg.algorithm.s2t.q == 0.5 and cfg.algorithm.s2t.silence == "random"
    assert cfg.reward.urls == ["http://a:1", "http://b:2"]
    assert cfg.data.arithmetic.ops == ["+", "-"]


@pytest.mark.parametrize(
    "override, needle",
    [
        ("algorithm.tau_hh=1", "algorithm.tau_hh: unknown field 'tau_hh'"),
        ("trainr.max_steps=1", "unknown field 'trainr'"),
        ("rollout.temperature=-1", "rollout.temperature"),
        ("algorithm.token_weighting=foo", "unknown token weighting 'foo'; valid names: none, s2t, stare, top_entropy"),
        ("algorithm.policy_loss=ppo", "unknown policy loss 'ppo'; valid names: gspo, maspo, ppo_clip"),
        ("algorithm.weighting_options.rho=0.5", "weighting_options: set algorithm.s2t.*"),
        ("algorithm.s2t.tau_h=0.5", "algorithm.s2t.tau_h is not an option: S2T's tau_h is the q-th quantile"),
        ("algorithm.s2t.q=1.5", "algorithm.s2t.q"),
        ("trainer.backend=jax", "trainer.backend"),
        ("trainer.max_steps", "expects key=value"),
        ("model.tiny.num_heads=3", "divisible by num_heads"),
    ],
)
def test_errors_name_the_field(override, needle):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert needle in str(err.value)


def test_unknown_yaml_key_is_an_error(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("rollout:\n  n: 4\n  temprature: 0.5\n")
    with pytest.raises(ConfigError, match=r"rollout.temprature: unknown field"):
        load_config(p)
    p.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(p)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")


def test_cross_field_check_names_both_fields():
    with pytest.raises(ConfigError, match=r"prompts_per_step \* rollout.n \(12\).*mini_batches \(5\)"):
        load_config(None, ["rollout.prompts_per_step=4", "rollout.n=3", "algorithm.mini_batches=5"])


def test_save_and_reload_round_trip(tmp_path):
    cfg = load_config(None, ["trainer.max_steps=11", "algorithm.token_weighting=top_entropy"])
    save_config(cfg, tmp_path / "config.yaml")
    again = load_config(tmp_path / "config.yaml")
    assert again == cfg
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["trainer"]["max_steps"] == 11


def test_every_field_has_a_description():
    rows = field_docs()
    missing = [name for name, _, desc in rows if not desc]
    assert not missing, missing
    assert len(rows) > 80


@pytest.mark.parametrize("name", ["demo", "tiny", "stapo", "grpo", "dapo", "20-entropy", "justrl"])
def test_presets_validate(name):
    assert name in preset_names()
    cfg = load_config(preset_path(name))
    assert isinstance(cfg, Config)


def test_recipes_differ_only_where_the_algorithm_does():
    """STAPO shares every line with its control but the token weighting (full checks: tests/unit/test_recipes.py)."""
    stapo, grpo = load_config(preset_path("stapo")), load_config(preset_path("grpo"))
    assert stapo.algorithm.token_weighting == "s2t" and grpo.algorithm.token_weighting == "none"
    base, dapo = load_config(preset_path("stapo-base")), load_config(preset_path("dapo"))
    assert stapo.trainer == base.trainer and stapo.rollout == base.rollout and stapo.data == base.data
    assert dapo.algorithm.dynamic_sampling and dapo.algorithm.overlong.enabled
    assert load_config(preset_path("justrl")).reward.mode == "dapo"
    assert load_config(preset_path("20-entropy")).algorithm.top_entropy.rho == 0.2


def test_config_names_are_the_registries():
    """The config accepts exactly the registries' names (it asks them; no copied list to drift)."""
    from stapo.core import algos

    for field, registry in [("advantage", algos.ADVANTAGES), ("token_weighting", algos.TOKEN_WEIGHTS),
                            ("policy_loss", algos.POLICY_LOSSES), ("aggregation", algos.AGGREGATIONS)]:
        for name in registry.names():
            assert getattr(load_config(None, [f"algorithm.{field}={name}"]).algorithm, field) == name
        with pytest.raises(ConfigError, match=f"algorithm.{field}: .*valid names: {', '.join(registry.names())}"):
            load_config(None, [f"algorithm.{field}=nope"])


def test_config_reference_doc_is_current():
    from stapo.core.config import config_markdown

    assert (REPO / "docs" / "config.md").read_text() == config_markdown(), (
        "docs/config.md is stale: run `python -m stapo.core.config > docs/config.md`"
    )


@pytest.mark.parametrize("name", ["none", "s2t", "top_entropy", "stare"])
def test_weighting_sections_match_function_keywords(name):
    """Each token weighting receives its config section as keywords: names must line up."""
    import inspect

    from stapo.core import algos
    from stapo.core.train.update import weighting_params

    cfg = load_config(None, [f"algorithm.token_weighting={name}"])
    params = weighting_params(cfg)
    sig = inspect.signature(algos.get_token_weighting(name))
    sig.bind(None, **params)  # raises TypeError on a name the function does not take


def test_extends_merges_sections_over_the_base_and_refuses_a_cycle(tmp_path):
    (tmp_path / "base.yaml").write_text("rollout: {n: 4, temperature: 0.5}\ntrainer: {max_steps: 3}\n")
    (tmp_path / "mid.yaml").write_text("extends: base\nrollout: {n: 2}\n")
    (tmp_path / "top.yaml").write_text("extends: mid.yaml\ntrainer: {lr: 0.5}\n")
    cfg = load_config(tmp_path / "top.yaml", ["rollout.n=3"])
    assert (cfg.rollout.n, cfg.rollout.temperature, cfg.trainer.max_steps, cfg.trainer.lr) == (3, 0.5, 3, 0.5)
    ablation = load_config(preset_path("stapo-random"))  # a preset name resolves next to the file
    assert ablation.rollout == load_config(preset_path("stapo")).rollout
    (tmp_path / "a.yaml").write_text("extends: b\n")
    (tmp_path / "b.yaml").write_text("extends: a\n")
    with pytest.raises(ConfigError, match="makes a cycle"):
        load_config(tmp_path / "a.yaml")
    (tmp_path / "c.yaml").write_text("extends: nowhere\n")
    with pytest.raises(ConfigError, match="config file not found: .*nowhere.yaml"):
        load_config(tmp_path / "c.yaml")


def test_a_saved_config_with_per_request_seeds_still_loads() -> None:
    """Run dirs written before every request carried its own seed hold `rollout.vllm.per_request_seeds`
    in their config.yaml; resuming them must not fail on it (the key is dropped: always on now)."""
    from stapo.core.config import config_from_dict

    cfg = config_from_dict({"rollout": {"vllm": {"per_request_seeds": True, "enforce_eager": True}}})
    assert cfg.rollout.vllm.enforce_eager and "per_request_seeds" not in cfg.rollout.vllm.model_dump()
