"""DEEP-GRPO in the real loop on 2 CPU ranks (gloo, torchrun) under DeepSpeed ZeRO-3.

What can fail here: branch rollouts and the local loss must keep the ranks in lockstep although
each rank picks its own pivots (different counts per rank: ZeRO-3 gathers parameters in every
generate step and forward, so a rank that made fewer calls would hang the other), the
recoverability model must learn from every rank's outcomes, and the logged DEEP-GRPO metrics must
be global. The run must finish under the timeout with branches trained on at least one step.
Whole runs cannot equal a one-process run (each rank samples its pivots and branches with its own
seed), so the local term's arithmetic is checked on FIXED root and branch rows instead: split
unevenly over 2 ranks (both holding branch rows, or rank 1 none; row or packed token-budget
micro-batches), the update equals the one-process one (1e-5).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.long

from test_multirank_loop import OVERRIDES, _rows, run_loop_two_ranks  # noqa: E402

# Runs on each rank before the loop of the lockstep test, in the same torchrun launch (one start for
# both tests): the fixed updates, saved by rank 0.
FIXED_PRELUDE = """
    sys.path.insert(0, {test_dir!r})
    from test_multirank_deep import fixed_deep_update
    res = [fixed_deep_update("deepspeed", root_split=r, branch_split=b, micro_tokens=t) for r, b, t in {runs!r}]
    if rank == 0:
        torch.save([{{"metrics": m, "params": p}} for m, p in res], {out!r})
    torch.distributed.barrier()
"""


def fixed_deep_update(backend_name: str, root_split: list[int], branch_split: list[int],
                      micro_tokens: int | None = None) -> tuple[dict, dict]:
    """``Actor.update`` on 6 fixed root rows plus DEEP-GRPO's local term on 6 fixed branch rows (two
    pivots of K = 3, prefixes of 2 and 3 tokens); this rank holds ``root_split[rank]`` / ``branch_split[rank]``
    of them. 2 mini-batches, micro-batches of 2 rows (or packed into ``micro_tokens``), S2T, lambda 1."""
    from types import SimpleNamespace

    from transformers import LlamaConfig, LlamaForCausalLM

    from stapo.core.config import config_from_dict
    from stapo.core.train import loop
    from stapo.core.train.deep_grpo import DeepGRPO, collate_branches
    from stapo.core.train.extras import Hooks
    from stapo.core.train.update import Actor, UpdateInputs
    from stapo.core.trainer import build_trainer_backend

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=48, hidden_size=32, num_hidden_layers=2,
                                         num_attention_heads=4, intermediate_size=64))
    cfg = config_from_dict({
        "trainer": {"backend": backend_name, "device": "cpu" if backend_name == "torch" else "auto",
                    "zero_stage": 3, "zero3_param_persistence_threshold": 0, "lr": 1e-3,
                    "micro_batch_size": 2, "micro_batch_tokens": micro_tokens, "logits_chunk_size": 7},
        "rollout": {"prompts_per_step": 2, "n": 3},
        "algorithm": {"token_weighting": "s2t", "mini_batches": 2, "s2t": {"tau_p": 0.5, "q": 0.6},
                      "deep_grpo": {"enabled": True, "k_branches": 3, "lambda": 1.0}},
    })
    backend = build_trainer_backend(cfg, model, total_optimizer_steps=2)
    rank, world = backend.rank, backend.world_size
    g = torch.Generator().manual_seed(3)

    def rows(n: int, adv: list[float], prefix: list[int]) -> list:
        out = []
        for i in range(n):
            prompt = torch.randint(1, 48, (3 + i % 2,), generator=g).tolist()
            resp = torch.randint(1, 48, (5 + i % 3,), generator=g).tolist()
            s = loop.Sequence_(prompt, resp, "stop", "", "", group=i // 3)
            s.advantage, s.prefix_len = adv[i], prefix[i]
            out.append(s)
        return out

    def share(seqs: list, split: list[int]) -> list:
        start = sum(split[:rank])
        return seqs[start : start + split[rank]]

    roots = share(rows(6, [1.0, -0.5, -0.5, 0.8, 0.0, -0.8], [0] * 6), root_split)
    branches = share(rows(6, [2 / 3, -1 / 3, -1 / 3, -2 / 3, 4 / 3, -2 / 3], [2, 2, 2, 3, 3, 3]), branch_split)
    pad = world > 1

    def stats(seqs: list, split: list[int]):
        batch = loop.collate_with_pad_row(seqs, 0, pad=pad)
        pad_row = len(seqs) if pad else None
        lp, ent = Actor(cfg, backend).old_stats(batch, split)
        return batch, pad_row, lp, ent

    batch, _, old_lp, old_ent = stats(roots, root_split)
    run = SimpleNamespace(cfg=cfg, backend=backend, pad_id=0)
    br = collate_branches(run, branches, branch_split)  # the branch rows' old pass: micro-batched as configured
    deep = DeepGRPO(cfg)
    actor = Actor(cfg, backend, Hooks())  # DEEP-GRPO's local loss comes in as a contribution, as the hook gives it
    m = actor.update(UpdateInputs(batch, old_lp, old_ent, step=1, counts=root_split,
                                  contributions=[deep.local_loss(backend, br, step=1)]))
    m.update(deep.local_metrics(backend))
    params = {n: t.detach().cpu().clone() for n, t in backend.named_parameters_for_sync()}
    return m, params


# (root rows per rank, branch rows per rank, token budget): both ranks hold branch rows (a rank-local
# normalizer or weighting statistic would differ), and rank 1 holds none (it joins every forward with its
# padding row); packed into 20-token forwards (rows of 8-11 tokens, two to a forward where they fit)
FIXED_RUNS = [([6, 0], [2, 4], None), ([2, 4], [6, 0], None), ([2, 4], [4, 2], 20)]


def test_two_rank_local_term_equals_one_process(two_rank_launch, one_thread):
    out = two_rank_launch["fixed"]
    one = {t: fixed_deep_update("torch", root_split=[6], branch_split=[6], micro_tokens=t)
           for t in sorted({t for *_, t in FIXED_RUNS}, key=str)}
    assert all(m["deep/local_tokens"] > 0 for m, _ in one.values())
    for (roots, branches, tokens), two in zip(FIXED_RUNS, torch.load(out), strict=True):
        case = f"roots {roots}, branches {branches}, tokens {tokens}"
        m1, p1 = one[tokens]
        for k in ("deep/local_loss", "deep/local_tokens", "actor/grad_norm"):
            assert two["metrics"][k] == pytest.approx(m1[k], rel=1e-5, abs=1e-6), (case, k)
        for n in p1:
            torch.testing.assert_close(two["params"][n], p1[n], atol=1e-5, rtol=0, msg=f"{case}: {n}")


# ----------------------------------------------------------------------------- the real loop

DEEP = [o for o in OVERRIDES if not o.startswith(("logging.dump_tokens_every", "eval.every", "checkpoint.every"))] + [
    "logging.dump_tokens_every=0", "eval.every=0", "checkpoint.every=0", "trainer.max_steps=2",
    "algorithm.deep_grpo.enabled=true", "algorithm.deep_grpo.k_branches=4", "algorithm.deep_grpo.max_pivots=1",
    "algorithm.deep_grpo.lambda=1.0",
]


@pytest.fixture(scope="module")
def two_rank_launch(tmp_path_factory):
    """One torchrun launch for both tests: the fixed updates (FIXED_PRELUDE), then the DEEP-GRPO loop."""
    tmp = tmp_path_factory.mktemp("deep")
    fixed = tmp / "two.pt"
    prelude = FIXED_PRELUDE.format(test_dir=os.path.dirname(__file__), runs=FIXED_RUNS, out=str(fixed))
    seen = run_loop_two_ranks(tmp, tmp / "deep", DEEP, prelude=prelude)
    return {"fixed": fixed, "seen": seen, "run": tmp / "deep"}


def test_two_rank_deep_grpo_stays_in_lockstep(two_rank_launch):
    run, seen = two_rank_launch["run"], two_rank_launch["seen"]
    assert all(s["partitioned"] == s["n_params"] > 0 for s in seen), "ZeRO-3 must partition every parameter"
    rows = _rows(run)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["deep/pivots"] == 2.0  # one pivot on each rank: the global count
        assert r["deep/branches"] == 8.0 and r["deep/model_samples"] == 2.0  # any-of-K: one outcome per pivot
        assert math.isfinite(r["actor/loss"]) and math.isfinite(r["actor/grad_norm"])
    assert any(r.get("deep/local_tokens", 0.0) > 0 for r in rows), "the local loss never ran"
