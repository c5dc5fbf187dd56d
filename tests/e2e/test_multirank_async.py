"""Asynchronous rollouts in the real RL loop on 2 CPU ranks (gloo, torchrun) under DeepSpeed ZeRO-3.

Each rank drives its own producer process (the hf engine on a copy of the policy), which samples
that rank's share of every step with the rank's seed; the ranks stay in lockstep because the version
that samples a step is fixed by the step. What can fail here:

* with max_staleness = 0 the 2-rank async run must make the 2-rank synchronous run's updates (same
  seeds) to 1e-6: each producer must sample exactly what its rank would have, from the weights its
  rank published (gathered under ZeRO-3 by both ranks);
* with max_staleness = 1 every step's batch lags by exactly min(1, t - 1) versions on both ranks,
  and the off-policy decisions (ESS, hence the LR multiplier) are global: a rank deciding alone
  would step its ZeRO partition with another LR, or skip a collective and hang (the timeout);
* when rank 0's producer dies, every rank raises ProducerDied (rank 1 through the step's all-gather
  of failures) instead of waiting forever in a collective.

The four runs share one torchrun launch (starting two ranks costs more than the runs).
Skipped without deepspeed.
"""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.long  # a torchrun launch, bounded at TIMEOUT_S

from test_multirank_loop import TINY_SHAPE, torchrun  # noqa: E402

RUNS_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, torch
    from stapo.configs import preset_path
    from stapo.core.rollout import async_rollout
    from stapo.core.config import load_config
    from stapo.core.train.loop import train
    from stapo.core.rollout import process
    from stapo.core.train.off_policy import OffPolicyStep
    from stapo.core.train.run import Run

    if __name__ == "__main__":  # the producer (spawn) and the grader's workers import __main__ again
        out, runs = sys.argv[1], json.loads(sys.argv[2])
        rank = int(os.environ["RANK"])
        scales = []  # the LR multiplier of every optimizer step on this rank, in order
        orig_take = OffPolicyStep.take_lr_scale

        def take_spy(self):
            scale = orig_take(self)
            scales.append(scale)
            return scale

        orig_engine = process.ProcessRolloutEngine.__init__
        fault = {}

        def engine_spy(self, *a, **k):  # the "dies" run: rank 0's producer exits while producing step 1
            orig_engine(self, *a, **k, **(fault if rank == 0 else {}))

        OffPolicyStep.take_lr_scale = take_spy
        process.ProcessRolloutEngine.__init__ = engine_spy
        for name, overrides in runs.items():
            scales.clear()
            error = None
            if name == "dies":
                fault["fault"] = async_rollout.FaultInjection(die_at_step=1)
            run = Run.build(load_config(preset_path("tiny"), overrides), os.path.join(out, name), log=lambda m: None)
            try:
                train(run)
            except async_rollout.ProducerDied as err:
                error = str(err)
            if name == "dies":
                with open(os.path.join(out, f"{name}.rank{rank}.json"), "w") as f:
                    json.dump({"error": error}, f)
                continue
            # every rank joins the ZeRO-3 gathers; rank 0 saves
            params = {n: t.detach().cpu().clone() for n, t in run.backend.named_parameters_for_sync()}
            if rank == 0:
                torch.save(params, os.path.join(out, name + ".pt"))
            with open(os.path.join(out, f"{name}.rank{rank}.json"), "w") as f:
                json.dump({"scales": scales}, f)
        torch.distributed.barrier()
        sys.stdout.flush()
        os._exit(0)  # skip the interpreter teardown: gloo's threads can abort a normal exit
    """
)

BASE = [
    *TINY_SHAPE,
    "trainer.backend=deepspeed", "trainer.device=auto", "trainer.zero_stage=3",
    "trainer.zero3_param_persistence_threshold=0", "trainer.micro_batch_size=2", "trainer.max_steps=3",
    # as tests/e2e/test_async_loop.py: overlong shaping gives a random model's rewards some spread
    "algorithm.overlong.enabled=true", "rollout.max_new_tokens=16", "algorithm.overlong.buffer=15",
    "algorithm.s2t.tau_p=0.5", "algorithm.s2t.q=0.9", "trainer.lr=0.01", "data.val_size=0",
    "logging.live=false", "logging.tensorboard=false", "logging.dump_tokens_every=0",
    "checkpoint.export_hf=false", "reward.workers=1",
    # a generous grading deadline: on a loaded machine a 5 s item deadline can expire, and a retried
    # (or failed) reward makes two runs differ for reasons that are not training's
    "reward.deadline_s=60",
]
RUNS = {
    "sync": BASE,
    "k0": [*BASE, "rollout.async.enabled=true", "rollout.async.max_staleness=0", "algorithm.off_policy.ess_lr_scaling=true"],
    "k1": [*BASE, "rollout.async.enabled=true", "rollout.async.max_staleness=1", "algorithm.off_policy.ess_lr_scaling=true"],
    "dies": [*BASE, "rollout.async.enabled=true", "rollout.async.max_staleness=1", "trainer.max_steps=2"],  # last
}
SKIP = ("time/", "perf/", "async/", "offpolicy/", "reward/retried")  # the machine's load, not training


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _close(a: float | None, b: float | None, tol: float = 1e-6) -> bool:
    if a is None or b is None:  # a mean over no tokens (tau_h of a mini-batch without a candidate) is logged as null
        return a is b
    return (math.isnan(a) and math.isnan(b)) or abs(a - b) <= tol * max(1.0, abs(a))


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("async2")
    (tmp / "runs.py").write_text(RUNS_SCRIPT)
    torchrun([str(tmp / "runs.py"), str(tmp), json.dumps(RUNS)], tmp)
    return tmp


def test_two_rank_async_with_max_staleness_zero_is_the_two_rank_synchronous_loop(two_rank_runs):
    sync, k0 = _metrics(two_rank_runs / "sync"), _metrics(two_rank_runs / "k0")
    assert [r["step"] for r in k0] == [1, 2, 3]
    assert any(r["actor/grad_norm"] > 0 for r in sync)  # the updates compared are real ones
    for a, b in zip(sync, k0, strict=True):
        a = {k: v for k, v in a.items() if not k.startswith(SKIP)}
        b = {k: v for k, v in b.items() if not k.startswith(SKIP)}
        assert a.keys() == b.keys()
        assert all(_close(a[k], b[k]) for k in a), {k: (a[k], b[k]) for k in a if not _close(a[k], b[k])}
    pa, pb = torch.load(two_rank_runs / "sync.pt"), torch.load(two_rank_runs / "k0.pt")
    assert pa.keys() == pb.keys()
    for n in pa:
        assert (pa[n].double() - pb[n].double()).abs().max() <= 1e-6, n
    assert [r["async/staleness"] for r in k0] == [0.0, 0.0, 0.0]


def test_two_rank_one_step_off_policy_stays_within_the_bound_with_global_ess(two_rank_runs):
    k1 = _metrics(two_rank_runs / "k1")
    assert [r["async/staleness"] for r in k1] == [0.0, 1.0, 1.0]
    assert [r["async/version"] for r in k1] == [0.0, 0.0, 1.0]
    # every rank stepped its ZeRO partition with the same, global LR multiplier (a rank-local ESS
    # would differ: the ranks hold different rows), and the stale steps were damped
    seen = [json.loads((two_rank_runs / f"k1.rank{r}.json").read_text())["scales"] for r in range(2)]
    assert seen[0] == seen[1] and len(seen[0]) >= 2 and min(seen[0]) < 1.0
    stale = [r for r in k1 if r["async/staleness"] > 0 and "offpolicy/ess" in r]
    assert stale, "no stale step reached the update"
    for r in stale:
        assert r["offpolicy/stale_frac"] == 1.0
        assert 0 < r["offpolicy/ess_ratio"] <= 1 + 1e-12
        assert r["offpolicy/lr_scale"] == pytest.approx(math.sqrt(min(1.0, r["offpolicy/ess_ratio"])))
        assert r["offpolicy/lr_scale"] in seen[0]
        # both ranks' rows: 2 prompts x 4 responses over 2 ranks, ESS of at most all of them
        assert r["offpolicy/ess"] <= r["batch/sequences"] + 1e-9
        assert r["offpolicy/ratio_min"] <= r["offpolicy/ratio_mean"] <= r["offpolicy/ratio_max"]
        assert r["offpolicy/ratio_max"] != r["offpolicy/ratio_min"]  # version 0 and 1 differ
    # the k = 1 run is not the synchronous one: its steps 2 and 3 train on stale batches
    sync = _metrics(two_rank_runs / "sync")
    assert sync[0]["actor/loss"] == pytest.approx(k1[0]["actor/loss"], abs=1e-6)  # step 1 is on-policy


def test_a_dead_producer_stops_every_rank_with_the_reason(two_rank_runs):
    errors = [json.loads((two_rank_runs / f"dies.rank{r}.json").read_text())["error"] for r in range(2)]
    assert errors[0] is not None and "exited with code 3 before delivering step 1" in errors[0]
    assert errors[1] is not None and errors[1].startswith("rank 0's rollout producer failed at step 1: ProducerDied")
    assert "exited with code 3" in errors[1]
