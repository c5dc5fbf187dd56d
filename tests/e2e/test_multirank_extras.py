"""The per-step extras (KL, Lp-Reg, STARE, entropy bonus, overlong filter) on 2 CPU ranks (gloo,
torchrun, DeepSpeed): the same update as one process.

Each extra is run the way ``loop.train`` runs it (the hooks' ``on_batch`` -> global counts ->
``Actor.old_stats`` -> the hooks' ``before_update`` -> ``Actor.update``) on
one fixed 6-sequence batch (3 groups of 2), split over 2 ranks unevenly ([2, 4]: both ranks hold
rows, so every global reduction matters) and with rank 1 empty ([6, 0]: it joins every collective
and forward with its zero-weight padding row). The final parameters must equal the one-process
update of the same batch to 1e-5, and each extra's own logged metrics must be the global ones:

* ``kl_ref`` - KL to a frozen reference (``kl.reference=initial``) under ZeRO-3: the reference is
  its own ZeRO-3 engine, partitioned like the policy, and rank 1 with nothing still makes every
  reference forward. The reference copy is perturbed after it is made (seeded, identically in both
  runs; test-only) so that the KL and its gradient are not zero at the first update. Its logged
  ``actor/kl`` is also checked against a hand computation (plain HF forwards, k3 by its formula).
* ``kl_in_reward`` - the same reference at ZeRO-2 (a plain replica on each rank), KL charged in the
  reward (group advantages recomputed).
* ``lp_reg`` - Lp-Reg under ZeRO-3 with parameters partitioned: its min-p proxy pass makes one
  forward per micro-batch, padded to the busiest rank's count (rank 1 with nothing still makes 3).
* ``stare`` - STARE with the adaptive (W, M) schedule, fed the GLOBAL mean entropy of the step.
* ``entropy`` - the entropy bonus (unfused path: ``trainer.entropy_grad``).
* ``overlong`` - DAPO's overlong filter: truncated rows leave the batch BEFORE the global counts.

One torchrun launch runs every case (~1 minute on 2 busy cores). Skipped without deepspeed.
"""

from __future__ import annotations

import math
import os
import sys
import textwrap

import pytest
import torch

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.long  # one torchrun bounded at 300 s, plus the references

sys.path.insert(0, os.path.dirname(__file__))
from test_multirank_loop import torchrun  # noqa: E402  (same launcher, same timeout)

SPLITS = [[2, 4], [6, 0]]

# adam_eps 1e-5 (default 1e-8): Adam's first step moves a weight by lr * g / (|g| + eps), so a float
# rounding difference in g (other forward shapes and summation order on 2 ranks) is multiplied by
# up to lr / eps where |g| is near eps. With 1e-8, one weight whose gradient happened to be 2e-8
# (median |g| 2e-3) moved 1.5e-5 apart on 2 ranks, over the 1e-5 tolerance, and as far in one
# process (micro-batches of 1 vs 2 rows: 5e-5), with or without the extra. A real divergence (a
# normalizer, threshold or selection that is not global) changes the gradients at O(1): still caught.
BASE = {
    "trainer": {"lr": 1e-3, "adam_eps": 1e-5, "micro_batch_size": 2, "logits_chunk_size": 7, "zero_stage": 3,
                "zero3_param_persistence_threshold": 0},
    "rollout": {"prompts_per_step": 3, "n": 2},
    "algorithm": {"token_weighting": "s2t", "mini_batches": 2,
                  "s2t": {"tau_p": 0.5, "q": 0.6}},
}

# variant -> (config overrides merged into BASE, metrics that must be the global ones and nonzero)
VARIANTS: dict[str, tuple[dict, tuple[str, ...]]] = {
    "kl_ref": ({"algorithm": {"kl_coef": 0.5, "kl": {"reference": "initial", "dtype": "float32"}}},
               ("actor/kl",)),
    "kl_in_reward": ({"trainer": {"zero_stage": 2},
                      "algorithm": {"kl_coef": 0.5, "kl": {"reference": "initial", "dtype": "float32",
                                                           "in_reward": True}}},
                     ("actor/kl", "actor/kl_reward_penalty")),
    "lp_reg": ({"algorithm": {"lp_reg": {"enabled": True, "rho": 0.9, "min_p": 0.02, "coef": 1.0}}},
               ("lp_reg/below_floor_frac", "lp_reg/regularized_frac")),
    "stare": ({"algorithm": {"token_weighting": "stare",
                             "stare": {"adaptive": True, "alpha": 0.05, "target_entropy": 10.0, "top_ratio": 0.3,
                                       "w": 1.3}}},
              ("stare/batch_entropy", "stare/reweight_w", "stare/gate_on")),
    "entropy": ({"trainer": {"entropy_grad": True}, "algorithm": {"entropy_coef": 0.5}}, ("entropy/mean",)),
    "overlong": ({"algorithm": {"overlong": {"filter": True}}}, ("batch/sequences",)),
}

ADVANTAGES = [1.0, -0.5, 0.5, -0.8, 0.8, 0.0]  # per sequence (kl_in_reward recomputes them from REWARDS)
REWARDS = [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]
TRUNCATED = {1, 4}  # finish_reason "length": dropped by the overlong filter

SCRIPT = textwrap.dedent(
    """
    import os, sys, torch
    sys.path.insert(0, {test_dir!r})
    sys.path.insert(0, os.path.dirname({test_dir!r}))  # tests/: conftest's helpers
    from test_multirank_extras import extras_update
    rank = int(os.environ["RANK"])
    results = {{(v, tuple(s)): extras_update("deepspeed", v, split=s) for v in {variants!r} for s in {splits!r}}}
    if rank == 0:
        torch.save(results, {out!r})
    torch.distributed.barrier()
    sys.stdout.flush()
    os._exit(0)  # skip the interpreter teardown: gloo's threads can abort a normal exit
    """
)


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(a[k], v) if isinstance(v, dict) and isinstance(a.get(k), dict) else v
    return out


def tiny_model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=48, hidden_size=32, num_hidden_layers=2,
                                        num_attention_heads=4, intermediate_size=64,
                                        initializer_range=0.2))  # peaked enough for a min-p floor to bite


def fixed_seqs() -> list:
    """The fixed 6-sequence batch (3 groups of 2)."""
    from stapo.core.train import loop

    g = torch.Generator().manual_seed(3)
    seqs = []
    for i in range(6):
        prompt = torch.randint(1, 48, (3 + i % 2,), generator=g).tolist()
        resp = torch.randint(1, 48, (4 + i % 3,), generator=g).tolist()
        finish = "length" if i in TRUNCATED else "stop"
        seqs.append(loop.Sequence_(prompt, resp, finish, "", "", group=i // 2, reward=REWARDS[i],
                                   advantage=ADVANTAGES[i]))
    return seqs


def perturb(model: torch.nn.Module, *, partitioned: bool) -> None:
    """Seeded noise on every weight, the same whatever the partitioning (ZeRO-3: each parameter is
    gathered, changed, and rank 0's values are scattered back into the partitions)."""
    import contextlib

    g = torch.Generator().manual_seed(7)
    for p in model.parameters():
        if partitioned:
            import deepspeed

            ctx = deepspeed.zero.GatheredParameters([p], modifier_rank=0)
        else:
            ctx = contextlib.nullcontext()
        with ctx, torch.no_grad():
            p.add_(0.1 * torch.randn(p.shape, generator=g).to(p.dtype))


def hand_kl_mean() -> float:
    """``actor/kl`` of the ``kl_ref`` variant computed independently of stapo's passes: one plain HF
    forward per sequence (no padding, no chunking, no micro-batches) for the policy and the perturbed
    reference, k3 = exp(d) - d - 1 with d = log ref - log pi (|d| is far below verl's clamp here),
    averaged over every response token."""
    import copy

    policy = tiny_model()
    ref = copy.deepcopy(policy)
    perturb(ref, partitioned=False)
    total, n = 0.0, 0
    with torch.no_grad():
        for s in fixed_seqs():
            ids = torch.tensor([s.prompt_ids + s.response_ids])
            lp_pi, lp_ref = (m(ids).logits[0, :-1].double().log_softmax(-1).gather(1, ids[0, 1:, None])[:, 0]
                             for m in (policy, ref))
            r = len(s.response_ids)
            d = lp_ref[-r:] - lp_pi[-r:]
            assert d.abs().max() < 10  # inside the clamp: the formula is the whole estimator
            total += float((d.exp() - d - 1).sum())
            n += r
    return total / n


def extras_update(backend_name: str, variant: str, split: list[int]) -> tuple[dict, dict]:
    """One step of the loop's update path on the fixed batch; this rank holds rows ``split[rank]``.

    Returns (metrics of rank 0's view, full parameters).
    """
    from hook_driver import before_update, run_hooks

    from stapo.core.config import config_from_dict
    from stapo.core.train import loop
    from stapo.core.train.hooks import Hooks, StepState
    from stapo.core.train.update import Actor, UpdateInputs
    from stapo.core.trainer import build_trainer_backend
    from stapo.core.trainer.distributed import DataParallel

    model = tiny_model()
    cfg_dict = _merge(BASE, VARIANTS[variant][0])
    cfg_dict["trainer"] = {**cfg_dict["trainer"], "backend": backend_name,
                           "device": "cpu" if backend_name == "torch" else "auto"}
    cfg = config_from_dict(cfg_dict)
    backend = build_trainer_backend(cfg, model, total_optimizer_steps=2)
    hooks = run_hooks(cfg, backend)
    kl = hooks.get("kl_reference")
    if kl is not None and kl.reference is not None:  # test-only: a reference that differs from the policy
        perturb(kl.reference.model, partitioned=kl.reference.partitioned)  # (same in every run)
    seqs = fixed_seqs()
    dp = DataParallel(backend)
    start = sum(split[: dp.rank])
    mine = seqs[start : start + split[dp.rank]]
    filt = hooks.get("overlong_filter")  # the only on_batch of these configs (the sampler's is the loop's)
    st = StepState(1, mine, list(mine), {})
    if filt is not None:
        st = Hooks({"overlong_filter": filt}).on_batch(st)[0]
    kept = st.kept
    counts = dp.counts(len(kept))
    batch = loop.collate_with_pad_row(kept, 0, pad=dp.multi)
    actor = Actor(cfg, backend, hooks)
    micros = actor.forwards(batch, counts)  # the busiest rank's number of forwards on every rank
    old_lp, old_ent = actor.old_stats(batch, micros=micros)
    metrics = {"batch/sequences": float(sum(counts))}
    metrics.update(before_update(hooks, batch, old_lp, old_ent, micros=micros, kept=kept)[1])
    metrics.update(actor.update(UpdateInputs(batch, old_lp, old_ent, step=1, counts=counts)))
    params = {n: t.detach().cpu().clone() for n, t in backend.named_parameters_for_sync()}
    return metrics, params


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("extras")
    out = tmp / "two.pt"
    (tmp / "two.py").write_text(SCRIPT.format(test_dir=os.path.dirname(__file__), variants=list(VARIANTS),
                                              splits=SPLITS, out=str(out)))
    torchrun([str(tmp / "two.py")], tmp)
    return torch.load(out)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_two_rank_extras_update_equals_one_process_update(two_rank_results, variant, one_thread):
    m1, p1 = extras_update("torch", variant, split=[6])  # the one-process reference, on one thread like the ranks
    for key in VARIANTS[variant][1]:
        assert m1[key] != 0 and math.isfinite(m1[key]), f"{variant}: {key} = {m1[key]} (extra not exercised)"
    if variant == "overlong":
        assert m1["batch/sequences"] == 6 - len(TRUNCATED)
    if variant == "kl_ref":  # the metric itself, by hand (float32 passes vs float64 formula)
        assert m1["actor/kl"] == pytest.approx(hand_kl_mean(), rel=1e-4)
    for split in SPLITS:
        m2, p2 = two_rank_results[(variant, tuple(split))]
        for n in p1:
            torch.testing.assert_close(p2[n], p1[n], atol=1e-5, rtol=0, msg=f"{variant} {split}: {n}")
        for key in (*VARIANTS[variant][1], "tokens/valid", "actor/grad_norm", "stapo/silenced_count"):
            assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-6), f"{variant} {split}: {key}"
