"""The real RL loop on 2 CPU ranks (gloo, launched with torchrun) under DeepSpeed ZeRO-3.

What each test checks:

* ``test_two_rank_loop_completes_resumes_and_logs_global_metrics`` - ``train(Run.build(...))`` with parameters
  actually partitioned (persistence threshold 0), dynamic sampling on, rewards that vary within
  groups (DAPO overlong shaping on a tiny random model: response lengths differ), 2 mini-batches of
  micro-batches, token dumps and validation every step, a checkpoint every step. It must finish
  under a timeout (ranks whose kept batches differ must still run the same collectives in
  lockstep, or they hang), log the GLOBAL reward mean (not rank 0's shard) and ``batch/sequences``, and a run
  resumed from the step-2 checkpoint must reproduce step 3 and the final parameters exactly. The
  run carries a KL to the frozen initial policy, itself partitioned under ZeRO-3 (``actor/kl`` is 0
  at step 1, positive after, and reproduced by the resumed run).
* ``test_two_rank_update_equals_one_process_update`` - the update made by 2 ranks on a fixed batch
  split unevenly (rank 1 holds NO sequence: it joins every collective with its zero-weight padding
  row) equals the one-process update of the same batch (1e-5), token diagnostics included, for the
  paper's rule and its high-entropy and silence-all ablations (tau_h^(q) from each mini-batch's GLOBAL
  candidates: a rank that took the quantile of its own candidates would log another ``stapo/tau_h``
  and silence other tokens).
  Exact identity of whole runs across rank counts is out of reach: each rank samples its share of
  the prompts with its own seed, so the sampled batches differ (documented in
  docs/training-backends.md).

Kept small for CI (tiny model, 3 steps; ~1 minute on 2 busy cores). Skipped without deepspeed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.long  # torchrun runs, each bounded at TIMEOUT_S

TIMEOUT_S = 300

LOOP_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, torch
    from stapo.configs import preset_path
    from stapo.core.config import load_config
    import stapo.core.train.hooks as hooks
    from stapo.core.train.hooks import LoopHook, register_hook
    from stapo.core.train.loop import train
    from stapo.core.train.run import Run


    class StepSequences(LoopHook):
        # every sequence a step sampled, all rounds (round 0 and dynamic sampling's refills), graded
        # and shaped: what the logged reward/mean is over
        name = "step_sequences"

        def __init__(self, out):
            self.out = out

        def on_batch(self, st):
            self.out.append((st.step, list(st.seqs)))
            return {}


    if __name__ == "__main__":  # the grader's workers (spawn/forkserver) import __main__ again

        rank = int(os.environ["RANK"])
        # PRELUDE: other checks sharing this launch run here, before the loop (one torchrun start)
        run_dir, out, resume = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
        cfg = load_config(preset_path("tiny"), json.loads(sys.argv[4]))
        seen, steps = {}, []
        hooks.HOOK_ORDER = (*hooks.HOOK_ORDER, StepSequences.name)  # last in every phase
        register_hook(StepSequences.name)(lambda run: StepSequences(steps))
        run = Run.build(cfg, run_dir, log=lambda m: None)
        ps = list(run.backend.model.parameters())
        seen["partitioned"] = sum(int(p.ds_tensor.numel() < p.ds_numel) for p in ps if hasattr(p, "ds_tensor"))
        seen["n_params"] = len(ps)
        train(run, resume=resume)
        rewards = {}
        for step, seqs in steps:
            rewards.setdefault(str(step), []).extend(s.reward for s in seqs)
        seen["rewards"] = rewards
        params = {n: t.detach().cpu().clone() for n, t in run.backend.named_parameters_for_sync()}
        if rank == 0:
            torch.save(params, out + ".pt")
        with open(f"{out}.rank{rank}.json", "w") as f:
            json.dump(seen, f)
        torch.distributed.barrier()
        sys.stdout.flush()
        os._exit(0)  # skip the interpreter teardown: gloo's threads can abort a normal exit
    """
)

# Runs on each rank before the loop of run ``a`` below, in the same torchrun launch (one start for both
# tests): the fixed-batch updates of UPDATE_RUNS, saved by rank 0.
UPDATE_PRELUDE = """
    sys.path.insert(0, {test_dir!r})
    from test_multirank_loop import fixed_update
    results = [fixed_update("deepspeed", split=split, silence=silence, tokens=tokens)
               for split, silence, tokens in {runs!r}]
    if rank == 0:
        torch.save([{{"metrics": m, "params": p}} for m, p in results], {out!r})
    torch.distributed.barrier()
"""


SEED_PRELUDE = """
    sys.path.insert(0, {test_dir!r})
    from test_multirank_loop import same_prompt_samples
    same_prompt_samples({out!r})
"""


def same_prompt_samples(out: str) -> None:
    """Step 1's rollout of this rank through the loop's own path (``rollout_and_grade``, hf engine,
    real grader) on a data set whose every prompt is the first one: both ranks sample the same prompt
    with nothing but the seed the loop gives each rank to tell them apart. Writes ``<out>.rank<r>.json``."""
    from types import SimpleNamespace

    from stapo.configs import preset_path
    from stapo.core.config import load_config
    from stapo.core.rollout import build_rollout_engine
    from stapo.core.rollout.rollouts import rollout_and_grade
    from stapo.core.task.data import encode_prompt, load_prompts
    from stapo.core.task.rewards import RewardFunction
    from stapo.core.task.sampler import build_sampler
    from stapo.core.trainer.models import load_policy

    cfg = load_config(preset_path("tiny"), TINY_SHAPE)
    model, tok = load_policy(cfg.model)
    same = [load_prompts(cfg.data, tok)[0][0]] * 8

    def encode(rec):
        return encode_prompt(tok, rec.prompt, chat_template=cfg.data.chat_template)

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    rewards = RewardFunction(cfg.reward)
    run = SimpleNamespace(cfg=cfg, engine=build_rollout_engine(cfg, model=model, tokenizer=tok), rewards=rewards,
                          sampler=build_sampler(cfg, same, encode=encode, model=model), train_prompts=same,
                          encode=encode, rank=rank, world_size=world)
    try:
        seqs, _ = rollout_and_grade(run, 1, 0)
    finally:
        rewards.close()
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump({"prompts": [s.prompt_ids for s in seqs], "responses": [s.response_ids for s in seqs]}, f)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun(args: list[str], tmp_path: Path) -> None:
    """``python -m torch.distributed.run --nproc_per_node 2 ...`` (torchrun), with a timeout."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), *args]
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        _, err = p.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        # SIGTERM: torchrun then kills its ranks (each in its own session; a SIGKILL of the launcher
        # alone would leave them behind, blocked in a collective); SIGKILL if it does not exit
        p.terminate()
        try:
            _, err = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            _, err = p.communicate()
        pytest.fail(f"2-rank run did not finish in {TIMEOUT_S}s (ranks out of lockstep?): {err[-3000:]}")
    assert p.returncode == 0, err[-4000:]


# ----------------------------------------------------------------------------- the real loop

# The shape this test is calibrated on: a character vocabulary, 2 prompts x 4 responses of up to 8
# tokens (the tiny preset itself answers with one token from a digits-only vocabulary).
TINY_SHAPE = ["model.tiny.vocab=chars", "data.arithmetic.answer_range=null", "rollout.prompts_per_step=2",
              "rollout.n=4", "rollout.max_new_tokens=8", "trainer.micro_batch_size=4"]


OVERRIDES = [
    *TINY_SHAPE,
    "trainer.backend=deepspeed", "trainer.device=auto", "trainer.zero_stage=3",
    "trainer.zero3_param_persistence_threshold=0", "trainer.micro_batch_size=2",
    "algorithm.mini_batches=2", "algorithm.dynamic_sampling=true",
    "algorithm.overlong.enabled=true", "algorithm.overlong.buffer=7",
    # a random tiny model is never correct: filter groups on the shaped reward, not on accuracy (DAPO's)
    "algorithm.dynamic_sampling_metric=reward",
    "algorithm.s2t.tau_p=0.5", "algorithm.s2t.q=0.9",
    "rollout.prompts_per_step=4", "logging.dump_tokens_every=1", "logging.live=false",
    "logging.tensorboard=false", "eval.every=1", "checkpoint.every=1", "checkpoint.keep_last=3",
    "checkpoint.export_hf=false",
    # a generous grading deadline: on a loaded machine a 5 s item deadline can expire, and a reward
    # that needed a retry (or failed) makes two runs differ for reasons that are not training's
    "reward.deadline_s=60",
]

# Keys that measure the machine, not training: timings, and grading retries (a loaded machine retries
# items whose deadline expired; the verdicts after the retry are the same).
TIMING = ("time/", "perf/", "reward/retried")


def _rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows]


def run_loop_two_ranks(tmp_path: Path, run_dir: Path, overrides: list[str], *, resume: bool = False,
                       prelude: str = "") -> list[dict]:
    """``LOOP_SCRIPT`` on 2 ranks into ``run_dir``; returns what each rank saw. Rank 0 saves the final
    parameters to ``<tmp_path>/<run_dir.name>_out.pt``. ``prelude``: code each rank runs first, in the
    same processes (another check sharing the launch: starting torchrun costs seconds of CPU per rank)."""
    script = tmp_path / "run_loop.py"
    marker = "    # PRELUDE"
    script.write_text(LOOP_SCRIPT.replace(marker, textwrap.indent(textwrap.dedent(prelude), " " * 4) + marker))
    out = tmp_path / f"{run_dir.name}_out"
    torchrun([str(script), str(run_dir), str(out), "1" if resume else "0", json.dumps(overrides)], tmp_path)
    return [json.loads((tmp_path / f"{out.name}.rank{r}.json").read_text()) for r in range(2)]


# The same run also carries the KL to the frozen initial policy, partitioned under ZeRO-3 like the
# policy (its own engine): its forwards must stay in lockstep although the ranks keep different
# numbers of rows, and the resume below must rebuild it from the initial weights, not the checkpoint's.
KL_REF = ["algorithm.kl_coef=0.04", "algorithm.kl.reference=initial", "algorithm.kl.dtype=float32"]


@pytest.fixture(scope="module")
def loop_runs(tmp_path_factory):
    """Run ``a`` (3 steps; its launch first makes the fixed updates of UPDATE_RUNS) and run ``b``,
    resumed from a copy of ``a`` without its step-3 checkpoint: two torchrun launches for both tests.
    The resume runs in a fresh launch, as a user's would."""
    tmp = tmp_path_factory.mktemp("loop")
    a, b, updates = tmp / "a", tmp / "b", tmp / "two.pt"
    here = os.path.dirname(__file__)
    prelude = UPDATE_PRELUDE.format(test_dir=here, runs=UPDATE_RUNS, out=str(updates))
    seen = run_loop_two_ranks(tmp, a, OVERRIDES + KL_REF,
                              prelude=prelude + SEED_PRELUDE.format(test_dir=here, out=str(tmp / "seeds_a")))
    shutil.copytree(a, b)
    shutil.rmtree(b / "checkpoints" / "step_000003")
    run_loop_two_ranks(tmp, b, OVERRIDES + KL_REF, resume=True,
                       prelude=SEED_PRELUDE.format(test_dir=here, out=str(tmp / "seeds_b")))
    return {"a": a, "b": b, "seen": seen, "updates": updates, "tmp": tmp}


def test_each_rank_reports_its_own_place(loop_runs):
    """Each rank of the launch wrote where it landed (stapo.core.placement): its own rank and local
    rank, on the CPU here (cuda:LOCAL_RANK on a GPU node), and the trainer backend agrees."""
    for r in range(2):
        row = json.loads((loop_runs["a"] / "ranks" / f"rank{r}.json").read_text())
        assert (row["rank"], row["local_rank"], row["world_size"]) == (r, r, 2)
        assert row["device"] == "cpu" and row["backend_device"] == "cpu"


def test_ranks_sample_one_prompt_differently_and_a_rerun_reproduces_both(loop_runs):
    """Rank 0 and rank 1 sample the same prompt in step 1 (SEED_PRELUDE, both launches): the loop's
    per-rank seed makes their groups differ, and the second launch draws exactly what the first did."""
    seeds = [[json.loads((loop_runs["tmp"] / f"seeds_{run}.rank{r}.json").read_text()) for r in range(2)]
             for run in ("a", "b")]
    (r0, r1), rerun = seeds
    assert r0["prompts"] == r1["prompts"] and len(r0["responses"]) == 4  # one prompt x n = 4 on each rank
    assert r0["responses"] != r1["responses"]
    assert len({tuple(x) for x in r0["responses"]}) > 1  # a group's samples differ too
    assert rerun == [r0, r1]


def test_two_rank_loop_completes_resumes_and_logs_global_metrics(loop_runs):
    a, seen = loop_runs["a"], loop_runs["seen"]
    assert all(s["partitioned"] == s["n_params"] > 0 for s in seen), "ZeRO-3 must partition every parameter"
    rows = _rows(a)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        # global reward mean: every sequence either rank sampled (rank 0's shard alone is not it)
        allr = seen[0]["rewards"][str(r["step"])] + seen[1]["rewards"][str(r["step"])]
        assert r["reward/mean"] == pytest.approx(sum(allr) / len(allr), abs=1e-6)
        assert r["batch/sequences"] == pytest.approx(r["dapo/kept_groups"] * 4)
        assert 0 < r["batch/sequences"] <= 16 and r["batch/sequences"] % 4 == 0
        assert r["stapo/silenced_count"] == pytest.approx(r["stapo/silenced_frac"] * r["tokens/valid"], abs=1e-6)
    # step 1 samples from the initial policy, which the reference copies: KL 0 (same fp32 weights and
    # computation); once the policy has moved it is positive (k3 >= 0 with equality only at ref == pi)
    assert rows[0]["actor/kl"] == pytest.approx(0.0, abs=1e-6)
    assert all(r["actor/kl"] > 1e-9 for r in rows[1:])
    assert sorted(p.name for p in (a / "dumps").glob("step_*.json")) == [f"step_00000{i}.json" for i in (1, 2, 3)]
    val = [json.loads(line) for line in (a / "val.jsonl").read_text().splitlines()]
    assert [v["step"] for v in val] == [0, 1, 2, 3] and all(v["n"] == 4 for v in val)

    # Resume from the step-2 checkpoint: step 3 and the final parameters are reproduced exactly.
    b, tmp = loop_runs["b"], loop_runs["tmp"]
    assert _rows(b) == rows
    pa, pb = torch.load(tmp / "a_out.pt"), torch.load(tmp / "b_out.pt")
    for n in pa:
        torch.testing.assert_close(pb[n], pa[n], atol=0, rtol=0, msg=n)


# ----------------------------------------------------------------------------- a fixed batch


def fixed_update(backend_name: str, split: list[int], silence: str = "lowest_entropy",
                 tokens: int | None = None) -> tuple[dict, dict]:
    """``Actor.update`` on one fixed 6-sequence batch; this rank holds rows ``split[rank]``.
    ``tokens``: packed micro-batches of that token budget (else rows of 2, padded).

    2 mini-batches x micro-batches of 2, S2T (tau_p 0.5, q 0.6) with ``silence`` (every collective of
    the weighting runs: the candidates' gather, the counts' all-reduce), fused loss. Returns (metrics, full parameters). lr 1e-3: Adam's first step is
    ~lr * sign(g), so a gradient entry at float-noise level can move by up to lr either way; a
    small lr keeps such entries under the 1e-5 comparison (a wrong mini-batch split moves ~lr).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    from stapo.core.config import config_from_dict
    from stapo.core.train import loop
    from stapo.core.train.extras import Hooks
    from stapo.core.trainer import build_trainer_backend

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=48, hidden_size=32, num_hidden_layers=2,
                                         num_attention_heads=4, intermediate_size=64))
    cfg = config_from_dict({
        "trainer": {"backend": backend_name, "device": "cpu" if backend_name == "torch" else "auto",
                    "zero_stage": 3, "zero3_param_persistence_threshold": 0, "lr": 1e-3,
                    "micro_batch_size": 2, "micro_batch_tokens": tokens, "logits_chunk_size": 7},
        "rollout": {"prompts_per_step": 2, "n": 3},
        "algorithm": {"token_weighting": "s2t", "mini_batches": 2,
                      "s2t": {"tau_p": 0.5, "q": 0.6, "silence": silence}},
    })
    backend = build_trainer_backend(cfg, model, total_optimizer_steps=2)
    g = torch.Generator().manual_seed(3)
    seqs = []
    for i in range(6):
        prompt = torch.randint(1, 48, (3 + i % 2,), generator=g).tolist()
        resp = torch.randint(1, 48, (4 + i % 3,), generator=g).tolist()
        s = loop.Sequence_(prompt, resp, "stop", "", "", group=i // 3)
        s.advantage = [1.0, -0.5, -0.5, 0.8, 0.0, -0.8][i]
        seqs.append(s)
    rank, world = backend.rank, backend.world_size
    start = sum(split[:rank])
    mine = seqs[start : start + split[rank]]
    batch = loop.collate_with_pad_row(mine, 0, pad=world > 1)
    from stapo.core.train import update

    actor = update.Actor(cfg, backend, Hooks())  # (no layer of this config acts inside the update)
    old_lp, old_ent = actor.old_stats(batch, split)
    m = actor.update(update.UpdateInputs(batch, old_lp, old_ent, step=1, counts=split))
    params = {n: t.detach().cpu().clone() for n, t in backend.named_parameters_for_sync()}
    return m, params


# (split, silence, packed token budget): both ranks hold rows, unevenly / rank 1 holds none; the ablations on the
# uneven split, where a rank-local quantile differs most from the global one. The same launch as run ``a``.
UPDATE_RUNS = [([2, 4], "lowest_entropy", None), ([6, 0], "lowest_entropy", None), ([2, 4], "highest_entropy", None),
               ([2, 4], "lowest_entropy", 12), ([6, 0], "lowest_entropy", 12),  # tokens 12: packed micro-batches
               ([2, 4], "all", None)]


def test_two_rank_update_equals_one_process_update(loop_runs, one_thread):  # reference reduces like the ranks
    """Every run of UPDATE_RUNS on 2 ranks equals the one-process update with the same ``silence``."""
    out2 = loop_runs["updates"]
    ref = {}
    for silence in dict.fromkeys(s for _, s, _ in UPDATE_RUNS):  # the one-process references, in this process
        m1, p1 = fixed_update("torch", split=[6], silence=silence)
        ref[silence] = {"metrics": m1, "params": p1}
    sil = {k: v["metrics"]["stapo/silenced_count"] for k, v in ref.items()}
    assert 0 < sil["lowest_entropy"] < sil["all"] and sil["highest_entropy"] > 0  # the rule is active
    for (split, silence, tokens), r2 in zip(UPDATE_RUNS, torch.load(out2), strict=True):
        _assert_same_update(ref[silence], r2, f"split {split}, silence {silence}, tokens {tokens}")


def _assert_same_update(r1: dict, r2: dict, case: str = "") -> None:
    # thresholds and counts first: a wrong tau_h is the cause, a parameter difference its effect
    for k in ("stapo/tau_h", "entropy/p05", "stapo/silenced_count", "stapo/silenced_frac", "tokens/valid",
              "phase/lowp_lowh_pos", "entropy/mean", "actor/grad_norm"):
        assert r2["metrics"][k] == pytest.approx(r1["metrics"][k], rel=1e-5, abs=1e-6), (case, k)
    for n in r1["params"]:
        torch.testing.assert_close(r2["params"][n], r1["params"][n], atol=1e-5, rtol=0, msg=f"{case}: {n}")
    assert r1["metrics"]["stapo/silenced_count"] > 0
