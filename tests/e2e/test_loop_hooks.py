"""The loop's hook interface on the real tiny loop: a hook registered by name sees every phase in
the documented order with the step's state, a contribution it adds is asked for its rows before each
optimizer step, its metrics are logged, and its state is saved under its name and given back on resume.

What can fail here: a phase called out of order or not at all, a phase run on a step without an
update, a state that does not reach the checkpoint or does not come back.
"""

from __future__ import annotations

import json

import stapo.core.train.hooks as hooks_mod
from stapo.configs import preset_path
from stapo.core.config import load_config
from stapo.core.tracking import read_jsonl
from stapo.core.train.hooks import HOOK_ORDER, HOOKS, Added, LoopHook, StepState
from stapo.core.train.loop import train
from stapo.core.train.run import Run

# 2 mini-batches: two optimizer steps per training step; a checkpoint after every step
CFG = ["model.tiny.vocab=chars", "data.arithmetic.answer_range=null", "rollout.prompts_per_step=2", "rollout.n=4",
       "rollout.max_new_tokens=8", "trainer.micro_batch_size=4", "logging.live=false", "logging.tensorboard=false",
       "algorithm.overlong.enabled=true", "algorithm.overlong.buffer=7", "algorithm.mini_batches=2",
       "checkpoint.every=1", "eval.every=0", "data.val_size=0"]


class Recorder(LoopHook):
    name = "recorder"

    def __init__(self, calls: list, loaded: list) -> None:
        self.calls, self.loaded = calls, loaded

    def sample(self, step):
        self.calls.append(("sample", step))

    def on_batch(self, st: StepState):
        self.calls.append(("on_batch", st.step, st.batch is None and bool(st.seqs)))

    def needs_old_stats(self, st):
        self.calls.append(("needs_old_stats", st.step, st.batch is not None))
        return False

    def before_update(self, st):
        self.calls.append(("before_update", st.step, st.old_lp is not None))  # 2 mini-batches: old pass ran
        return Added(contributions=(self,))  # the update asks it before each optimizer step

    def rows(self, update):  # a contribution: asked before each optimizer step, it adds no row
        self.calls.append(("rows", update))

    def done(self, update, loss, tokens):
        raise AssertionError("a contribution without rows has no cost to report")

    def after_update(self, st):
        self.calls.append(("after_update", st.step))
        return {"recorder/steps": float(st.step)}

    def after_sync(self, st):
        self.calls.append(("after_sync", st.step))

    def state_dict(self):
        return {"seen": sum(c[0] == "after_sync" for c in self.calls)}

    def load_state_dict(self, state):
        self.loaded.append(state)

    def close(self):
        self.calls.append(("close",))


def test_registered_hook_sees_every_phase_in_order_and_resumes(tmp_path, monkeypatch):
    calls: list = []
    loaded: list = []
    monkeypatch.setattr(hooks_mod, "HOOK_ORDER", (*HOOK_ORDER, "recorder"))  # last in every phase
    monkeypatch.setitem(HOOKS, "recorder", lambda run: Recorder(calls, loaded))
    cfg = load_config(preset_path("tiny"), [*CFG, "trainer.max_steps=1"])
    train(Run.build(cfg, tmp_path, log=lambda m: None))
    step_phases = [("sample", 1), ("on_batch", 1, True), ("needs_old_stats", 1, True), ("before_update", 1, True),
                   ("rows", 0), ("rows", 1), ("after_update", 1), ("after_sync", 1)]
    row = read_jsonl(tmp_path / "metrics.jsonl")[0]
    assert row["batch/sequences"] > 0  # overlong shaping gives the random model's groups an advantage
    assert calls == [*step_phases, ("close",)]
    assert loaded == []  # a fresh run loads nothing
    assert row["recorder/steps"] == 1.0
    meta = json.loads(next(tmp_path.glob("checkpoints/*/meta.json")).read_text())
    assert meta["extra"]["hooks"]["recorder"] == {"seen": 1}
    calls.clear()
    train(Run.build(load_config(preset_path("tiny"), [*CFG, "trainer.max_steps=2"]), tmp_path, log=lambda m: None),
          resume=True)
    assert loaded == [{"seen": 1}]  # given back under its name before step 2
    assert calls[0] == ("sample", 2) and calls[-1] == ("close",)

