"""The loop's hook registry: the order is the documented one, each stability layer is its own hook
switched on by its own config keys only, and old checkpoints' bundled state reaches the new hook.

What can fail here: a hook registered out of the documented order (the phases, and the collectives
under data parallelism, run in registry order), a layer built when another layer's keys are set, a
layer's phase answering for another, a resume that loses STARE's schedule from an older checkpoint.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hook_driver import HookRun

import stapo.core.train.hooks as hooks_mod
from stapo.configs import preset_path
from stapo.core.config import load_config
from stapo.core.train.checkpoint import legacy_hook_state
from stapo.core.train.extras import build_hooks
from stapo.core.train.hooks import HOOK_ORDER, HOOKS, Added, Hooks, LoopHook, StepState, register_hook

DOCUMENTED = [
    "async", "sampler", "deep_grpo", "overlong_filter", "kl_reference", "lp_reg", "stare", "kl_in_reward", "s2t_watch",
]
STABILITY_HOOKS = DOCUMENTED[3:-1]  # the stability layers, each switched on by its own config keys
DOCS = Path(__file__).resolve().parents[2] / "docs"


def _hooks(*overrides: str, sampler=None):
    cfg = load_config(preset_path("tiny"), list(overrides))
    return build_hooks(HookRun(cfg, sampler=sampler))


def test_hook_order_is_the_documented_one():
    assert HOOK_ORDER == tuple(DOCUMENTED) and set(HOOKS) == set(DOCUMENTED)
    # the module's table of hooks, in its order: the first column of each row
    doc = hooks_mod.__doc__.split("Registered, in this order")[1]
    assert re.findall(r"^``(\w+)``\s{2,}", doc, flags=re.M) == DOCUMENTED
    # docs/architecture.md states the order as a tuple literal
    line = next(x for x in (DOCS / "architecture.md").read_text().splitlines() if x.startswith("HOOK_ORDER = ("))
    assert re.findall(r'"(\w+)"', line) == DOCUMENTED


class _Named(LoopHook):
    def __init__(self, name, calls):
        self.name, self.calls = name, calls

    def on_batch(self, st):
        self.calls.append(self.name)
        return {f"{self.name}/seen": 1.0}


def test_phases_run_in_hook_order_not_registration_order(monkeypatch):
    """Two hooks registered last-first run first-last: the tuple decides, and so the phases' merges."""
    calls: list = []
    monkeypatch.setattr(hooks_mod, "HOOK_ORDER", (*HOOK_ORDER, "first", "second"))
    monkeypatch.setattr(hooks_mod, "HOOKS", dict(HOOKS))
    register_hook("second")(lambda run: _Named("second", calls))
    register_hook("first")(lambda run: _Named("first", calls))
    cfg = load_config(preset_path("tiny"), ["algorithm.token_weighting=none"])
    built = build_hooks(HookRun(cfg, sampler=SimpleNamespace(end_step=lambda step: {})))
    assert list(built.by_name) == ["sampler", "first", "second"]
    assert list(built.on_batch(StepState(1, [], [], {}))[1]) == ["first/seen", "second/seen"]
    assert calls == ["first", "second"]


def test_a_name_outside_the_order_is_refused(monkeypatch):
    with pytest.raises(ValueError, match="'mystery' has no place in HOOK_ORDER"):
        register_hook("mystery")
    with pytest.raises(ValueError, match="'stare' is already registered"):
        register_hook("stare")(lambda run: None)
    # a name of the order whose module registered nothing: building refuses, no hook silently dropped
    monkeypatch.setattr(hooks_mod, "HOOK_ORDER", (*HOOK_ORDER, "unimported"))
    with pytest.raises(ValueError, match=r"\['unimported'\] are in HOOK_ORDER but not registered"):
        build_hooks(HookRun(load_config(preset_path("tiny"))))


def test_plain_recipe_builds_only_the_always_on_hook():
    hooks = _hooks("algorithm.token_weighting=none")
    assert list(hooks.by_name) == ["sampler"]
    assert list(_hooks().by_name) == ["sampler", "s2t_watch"]  # S2T on: its rate is watched
    assert hooks.needs_old_stats(StepState(1, [], [], {})) is False and hooks.weighting_params() == {}
    assert not hooks.terms_read_stats


# one layer's keys -> exactly the hooks it builds (beside the always-on sampler), whether the step then
# needs the old pass, whether the additive terms read p, whether the weighting gets live keywords
LAYERS = {
    "overlong_filter": (["algorithm.overlong.filter=true"], ["overlong_filter"], False, False, False),
    "kl_reference": (["algorithm.kl_coef=0.1"], ["kl_reference"], True, False, False),
    "lp_reg": (["algorithm.lp_reg.enabled=true"], ["lp_reg"], True, True, False),
    "stare": (["algorithm.token_weighting=stare"], ["stare"], True, False, True),
    # the KL charged to the reward needs its target: kl_coef > 0 (the config refuses in_reward without it)
    "kl_in_reward": (["algorithm.kl_coef=0.1", "algorithm.kl.in_reward=true"], ["kl_reference", "kl_in_reward"],
                     True, False, False),
}


@pytest.mark.parametrize("layer", list(LAYERS))
def test_one_layer_config_activates_only_that_hook(layer):
    overrides, built, old_stats, read_stats, live_params = LAYERS[layer]
    hooks = _hooks("algorithm.token_weighting=none", *overrides)
    assert list(hooks.by_name) == ["sampler", *built]
    assert all(type(hooks.get(n)).name == n for n in built)
    assert hooks.needs_old_stats(StepState(1, [], [], {})) is old_stats
    assert hooks.terms_read_stats is read_stats
    assert bool(hooks.weighting_params()) is live_params


def test_every_layer_at_once_keeps_the_registry_order():
    hooks = _hooks("algorithm.overlong.filter=true", "algorithm.kl_coef=0.1", "algorithm.kl.in_reward=true",
                   "algorithm.lp_reg.enabled=true", "algorithm.token_weighting=stare")
    assert list(hooks.by_name) == ["sampler", *STABILITY_HOOKS]


def test_kl_terms_come_before_lp_reg_terms():
    """The update sums the additive terms in registry order: KL, then Lp-Reg (floating-point sums
    depend on the order, so it is pinned)."""
    hooks = _hooks("algorithm.token_weighting=none", "algorithm.kl_coef=0.1", "algorithm.lp_reg.enabled=true",
                   "algorithm.lp_reg.rho=1.0")
    hooks.get("lp_reg").proxy_lp = torch.zeros(2, 3)
    lp = torch.log(torch.tensor([[0.5, 0.2, 0.1], [0.3, 0.3, 0.3]]))
    ctx = SimpleNamespace(logprobs=lp, advantages=torch.tensor([-1.0, -1.0]), mask=torch.ones(2, 3, dtype=torch.bool),
                          gather=None)
    assert [t.name for t in hooks.terms(ctx, torch.tensor([0, 1]), lp)] == ["kl", "lp_reg"]


def test_kl_in_reward_reads_the_target_the_reference_hook_published():
    """``kl_reference`` (kl.reference=none: the sampler itself) returns ``ref_lp``; ``kl_in_reward``,
    later in the same phase, charges k1(old, ref) = 0: the rewards stay, the group advantages are computed
    again from them (GRPO's z-score of [1, 0]: +-0.7071) and written into the batch."""
    hooks = _hooks("algorithm.kl_coef=0.5", "algorithm.kl.in_reward=true", "algorithm.kl.reference=none",
                   "algorithm.kl.estimator=k1")
    seqs = [SimpleNamespace(reward=1.0, group=0, advantage=0.7), SimpleNamespace(reward=0.0, group=0, advantage=-0.7)]
    mask = torch.tensor([[False, True], [False, True]])
    batch = SimpleNamespace(response_mask=mask, advantages=torch.tensor([[0.0, 0.7], [0.0, -0.7]]))
    old = torch.tensor([[0.0, -1.0], [0.0, -2.0]])
    st = StepState(1, seqs, seqs, {}, batch=batch, old_lp=old, old_ent=torch.zeros(2, 2))
    after, metrics = hooks.before_update(st)
    assert metrics == {"actor/kl_reward_penalty": 0.0}  # the phase's metrics, returned
    assert after.ref_lp is old and st.ref_lp is None and st.metrics == {}  # (the loop merges them)
    assert [s.reward for s in seqs] == [1.0, 0.0]
    assert [s.advantage for s in seqs] == pytest.approx([0.7071, -0.7071], abs=1e-4)
    assert batch.advantages[:, 1].tolist() == pytest.approx([0.7071, -0.7071], abs=1e-4)
    assert batch.advantages[:, 0].tolist() == [0.0, 0.0]


def test_stare_state_from_an_older_checkpoint_reaches_the_stare_hook():
    state = {"w": 1.07, "m": 0.93, "current_entropy": 4.5}
    bundled = {"hooks": {"sampler": {}, "regularizers": {"stare": state}}}  # one hook held every layer
    oldest = {"extras": {"stare": state}, "layers": {"sampler": {}}}  # before hooks had names
    for extra in (bundled, oldest):
        loaded = legacy_hook_state(extra)
        assert "regularizers" not in loaded and loaded["stare"] == state
        sampler = SimpleNamespace(load_state_dict=lambda st: None, state_dict=lambda: {})  # (stateless)
        hooks = _hooks("algorithm.token_weighting=stare", "algorithm.stare.adaptive=true", sampler=sampler)
        hooks.load_state_dict(loaded)
        assert hooks.state_dict()["stare"] == state
        assert hooks.weighting_params()["w"] == 1.07 and hooks.weighting_params()["m"] == 0.93
    # today's layout passes through; a plain recipe's bundled {} adds nothing
    assert legacy_hook_state({"hooks": {"stare": state}}) == {"stare": state}
    assert legacy_hook_state({"hooks": {"sampler": {}, "regularizers": {}}}) == {"sampler": {}}


class _Adds(LoopHook):
    """A hook that returns fixed additions from both adding phases."""

    def __init__(self, on_batch=None, before_update=None):
        self.added = {"on_batch": on_batch, "before_update": before_update}

    def on_batch(self, st):
        return self.added["on_batch"] or {}

    def before_update(self, st):
        return self.added["before_update"] or {}


def test_the_container_applies_each_hooks_additions_in_order():
    """Hooks return what they add; the container writes it into the step, hook by hook: ``keep`` masks
    compose (the second hook's flags are over the rows the first kept), contributions queue in order,
    metrics merge with the later hook's value winning, and a later hook reads the KL target an earlier
    one returned."""
    seen = []

    class Reader(LoopHook):
        def before_update(self, st):
            seen.append(st.ref_lp)
            return Added(contributions=("c",))

    ref = torch.zeros(1, 1)
    hooks = Hooks({"a": _Adds(Added(keep=(True, False, True), metrics={"m": 1.0}),
                              Added(ref_lp=ref, contributions=("a",))),
                   "b": _Adds(Added(keep=(False, True), metrics={"m": 2.0})),
                   "r": Reader()})
    st, metrics = hooks.on_batch(StepState(1, ["x", "y", "z"], ["x", "y", "z"], {}))
    assert metrics == {"m": 2.0} and st.kept == ["z"]
    st, metrics = hooks.before_update(st)
    assert metrics == {} and st.ref_lp is ref and seen == [ref]
    assert st.contributions == ("a", "c")


def test_a_hook_cannot_write_the_step():
    """The step is the loop's: a hook that assigns a field of it fails loudly instead of changing what
    later hooks and the update read."""

    class Writer(LoopHook):
        def on_batch(self, st):
            st.kept = []
            return {}

    with pytest.raises(AttributeError):
        Hooks({"w": Writer()}).on_batch(StepState(1, ["x"], ["x"], {}))


def test_two_hooks_setting_one_target_is_an_error():
    both = Hooks({"a": _Adds(before_update=Added(off_policy="first")),
                  "b": _Adds(before_update=Added(off_policy="second"))})
    with pytest.raises(ValueError, match="hook 'b' sets the step's off_policy, which an earlier hook set"):
        both.before_update(StepState(1, [], [], {}))
    short = Hooks({"a": _Adds(Added(keep=(True,)))})
    with pytest.raises(ValueError, match="hook 'a' kept 1 flags for 2 rows"):
        short.on_batch(StepState(1, ["x", "y"], ["x", "y"], {}))
