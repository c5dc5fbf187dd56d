"""The stability layers in the real loop on a tiny random model (real generate, forward/backward, grader).

What can fail here: each recipe (stapo-goldilocks / -deep / -maspo / -stack) must run 2 steps and log
its layer's metrics; DEEP-GRPO with lambda = 0 must give plain GRPO's parameters bit for bit (and
lambda = 1 must not); branches must share exactly their pivot's prefix; the local loss must put no
gradient on the positions that predict prefix tokens; a Goldilocks run resumed from a checkpoint
must replay the uninterrupted run's prompts and metrics.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from stapo.configs import preset_path
from stapo.core.config import load_config
from stapo.core.tracking import read_jsonl
from stapo.core.train import deep_grpo as deep_mod
from stapo.core.train.loop import train
from stapo.core.train.run import Run

# The recipes are GPU recipes; these overrides shrink them to the tiny random model on CPU and keep
# every layer switch as the recipe sets it. Overlong shaping over the whole budget gives rewards
# that vary with length (a random model never answers right), so advantages are not all zero.
TINY = [
    "model.name_or_path=tiny-random", "model.dtype=float32", "model.gradient_checkpointing=false",
    "data.source=arithmetic", "data.template=short", "data.val_size=2", "data.arithmetic.num_problems=48",
    # the character vocabulary and multi-digit answers these tests were written for (tiny now answers
    # one digit from a digits-only vocabulary: no failed rollout would be long enough to branch from)
    "model.tiny.vocab=chars", "data.arithmetic.answer_range=null",
    "rollout.engine=hf", "rollout.prompts_per_step=2", "rollout.n=4", "rollout.max_new_tokens=16",
    "trainer.backend=torch", "trainer.device=cpu", "trainer.max_steps=2", "trainer.lr=1e-3",
    "trainer.micro_batch_size=4", "trainer.warmup_steps=0", "reward.urls=[]", "reward.workers=1",
    "eval.every=0", "checkpoint.every=0", "checkpoint.export_hf=false", "logging.live=false",
    "logging.tensorboard=false", "logging.dump_tokens_every=0", "algorithm.overlong.enabled=true",
    "algorithm.overlong.buffer=15", "algorithm.mini_batches=2",
    # a random model is never right and always truncated: DAPO's accuracy filter and overlong filter
    # (on in every stapo-* recipe, as in stapo) would leave nothing to train on
    "algorithm.dynamic_sampling=false", "algorithm.overlong.filter=false",
    "data.goldilocks.pool_factor=4", "data.goldilocks.train_batch_size=8", "data.goldilocks.num_features=256",
    "algorithm.deep_grpo.k_branches=4", "algorithm.deep_grpo.max_pivots=2",
    # a random model's p ~ 1/vocab: loose S2T thresholds so the mask acts on both streams
    "algorithm.s2t.tau_p=0.5", "algorithm.s2t.q=0.9",
]
LAYER_KEYS = {
    "stapo-goldilocks": ["goldilocks/teacher_loss", "sampler/zero_variance_share", "time/sampler_s"],
    "stapo-deep": ["deep/pivots", "deep/branches", "deep/local_loss", "time/deep_rollout_s"],
    "stapo-maspo": ["actor/loss"],
    "stapo-stack": ["goldilocks/teacher_loss", "deep/local_loss", "deep/branches"],
}


def _cfg(name: str, *extra: str):
    return load_config(preset_path(name), [*TINY, *extra])


def _params(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for p in model.parameters()])


def _train(cfg, run_dir: Path, seen: dict | None = None):
    seen = {} if seen is None else seen
    seen["run"] = run = Run.build(cfg, run_dir, log=lambda m: None)
    train(run)
    return seen


@pytest.fixture(scope="module")
def shared_run(tmp_path_factory):
    """``get(cfg) -> (seen, run_dir)``: one training run per distinct config in this module (the
    recipe runs double as the DEEP-GRPO lambda = 1 and fused-MASPO runs when the configs are equal)."""
    runs: dict[str, tuple[dict, Path]] = {}

    def get(cfg):
        key = cfg.model_dump_json()
        if key not in runs:
            d = tmp_path_factory.mktemp("run")
            runs[key] = (_train(cfg, d), d)
        return runs[key]

    yield get
    runs.clear()


@pytest.mark.parametrize("name", ["stapo-goldilocks", "stapo-deep", "stapo-maspo", "stapo-stack"])
def test_recipe_runs_two_steps_on_tiny(name, shared_run):
    cfg = _cfg(name)
    assert cfg.algorithm.name == name
    _, run_dir = shared_run(cfg)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for key in LAYER_KEYS[name]:
        vals = [r.get(key) for r in rows]
        assert all(v is not None and math.isfinite(v) for v in vals), (key, vals)
    assert all(math.isfinite(r["actor/loss"]) and math.isfinite(r["actor/grad_norm"]) for r in rows)
    if "deep" in name or name == "stapo-stack":
        assert sum(r["deep/branches"] for r in rows) > 0


def test_deep_lambda_zero_is_plain_grpo_bit_for_bit(shared_run):
    (plain, _), (zero, zero_dir), (one, _) = (shared_run(_cfg("stapo-deep", *o)) for o in (
        ["algorithm.deep_grpo.enabled=false"], ["algorithm.deep_grpo.lambda=0"], ["algorithm.deep_grpo.lambda=1"]))
    p0, pz, p1 = (_params(s["run"].model) for s in (plain, zero, one))
    assert torch.equal(p0, pz)  # branches were generated and graded, but lambda = 0 adds nothing
    assert sum(r["deep/branches"] for r in read_jsonl(zero_dir / "metrics.jsonl")) > 0
    assert not torch.equal(p0, p1)  # and the local term does move the weights when it is on


def test_branches_share_exactly_the_pivot_prefix_and_local_loss_skips_it(tmp_path, monkeypatch):
    """Branches are a failed rollout's first t tokens plus a continuation, and the local loss puts no
    gradient on the prefix. The gradient is read at the seam every layout goes through: the per-token
    log-probs and entropies ``backend.token_stats`` returns to the local loss, always [rows, L] in
    the branch batch's own row layout (whatever the forward did inside: shared prompt KV, trimmed
    columns, packing). d(local loss)/d(log p_t) must be 0 on every prompt and prefix token and
    nonzero somewhere on the continuation."""
    captured: list = []
    grads: list = []
    orig_branches = deep_mod.DeepGRPO.rollout_branches
    orig_local = deep_mod.DeepGRPO.local_loss

    def spy_branches(self, run, step, seqs):
        br, m = orig_branches(self, run, step, seqs)
        # snapshot the rollouts as they were when branched (later stages may reshape their rewards)
        snap = [SimpleNamespace(prompt_ids=list(s.prompt_ids), response_ids=list(s.response_ids), correct=s.correct)
                for s in seqs]
        captured.append((snap, br))
        return br, m

    def spy_local(self, backend, br, step, roots=None):
        local = orig_local(self, backend, br, step, roots)
        if local is None:
            return None
        real = backend.token_stats
        rows, done = local.rows, local.done

        def token_stats(input_ids, attention_mask, response_mask=None, *, grad, **kw):
            lp, ent = real(input_ids, attention_mask, response_mask, grad=grad, **kw)
            if grad:  # the local loss's gradient forward: [b, L] rows of the branch batch
                ids = input_ids.detach().cpu()
                for name, t in (("lp", lp), ("ent", ent)):
                    if t.requires_grad:
                        t.register_hook(lambda g, ids=ids, name=name: grads.append((name, ids, g.detach().cpu())))
            return lp, ent

        def spy_rows(update):  # the actor runs the rows it gets right away, then reports their cost
            extra = rows(update)
            if extra is not None:
                backend.token_stats = token_stats
            return extra

        def spy_done(update, loss, tokens):
            backend.token_stats = real
            done(update, loss, tokens)

        local.rows, local.done = spy_rows, spy_done
        return local

    monkeypatch.setattr(deep_mod.DeepGRPO, "rollout_branches", spy_branches)
    monkeypatch.setattr(deep_mod.DeepGRPO, "local_loss", spy_local)
    _train(_cfg("stapo-deep", "algorithm.mini_batches=1", "trainer.micro_batch_size=64"), tmp_path)
    assert captured and any(br is not None for _, br in captured)
    for seqs, br in captured:
        if br is None:
            continue
        failed = [s for s in seqs if not s.correct]
        for i, b in enumerate(br.seqs):
            t = b.prefix_len
            assert 1 <= t < max(len(s.response_ids) for s in failed)
            # the prefix is a failed rollout's first t tokens, token for token (same prompt)
            assert any(s.prompt_ids == b.prompt_ids and s.response_ids[:t] == b.response_ids[:t]
                       and len(s.response_ids) > t for s in failed)
            # the batch row the local loss reads is that prompt + prefix + continuation, in order
            resp = br.batch.response_mask[i].nonzero().flatten()
            assert br.batch.input_ids[i, resp].tolist() == b.response_ids
            real = br.batch.attention_mask[i].nonzero().flatten()
            assert br.batch.input_ids[i, real[: len(b.prompt_ids)]].tolist() == b.prompt_ids
            suf = br.suffix[i].nonzero().flatten()
            assert suf.tolist() == resp[t:].tolist()  # exactly the continuation
    assert grads
    rows = [(br.batch.input_ids[k].cpu(), br.suffix[k].cpu()) for _, br in captured if br is not None
            for k in range(br.suffix.shape[0])]
    saw_signal = False
    for name, ids, g in grads:  # rows come in the hook's shuffled order: match them by their token ids
        for row, grow in zip(ids, g, strict=True):
            match = [suf for ids_k, suf in rows if ids_k.shape == row.shape and torch.equal(ids_k, row)]
            assert match, "a local-loss row that is no branch row"
            suffix = match[0]
            assert torch.all(grow[~suffix] == 0), (name, "gradient on a prompt or prefix token")
            saw_signal |= name == "lp" and bool((grow[suffix] != 0).any())
    assert saw_signal


def test_goldilocks_and_deep_resume_replays_the_uninterrupted_run(tmp_path):
    """Teacher weights, its optimizer, the replay buffer and the logistic window are in the checkpoint
    (the hooks' states): the step after the resume reads all of them (2 steps: one resumed step is
    enough to see any of them missing, at two thirds of the cost of 3)."""
    over = ["checkpoint.every=1", "algorithm.deep_grpo.min_fit_samples=2"]
    full = tmp_path / "full"
    _train(_cfg("stapo-stack", *over, "trainer.max_steps=2"), full)
    part = tmp_path / "part"
    _train(_cfg("stapo-stack", *over, "trainer.max_steps=1"), part)
    train(Run.build(_cfg("stapo-stack", *over, "trainer.max_steps=2"), part, log=lambda m: None), resume=True)

    def strip(rows):
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))} for r in rows]

    a, b = strip(read_jsonl(part / "metrics.jsonl")), strip(read_jsonl(full / "metrics.jsonl"))
    assert [r["step"] for r in a] == [1, 2]
    assert a == b


def test_maspo_fused_and_unfused_paths_agree(shared_run):
    """MASPO is per-token, so the fused chunked loss serves it; the unfused path is the reference.
    Two mini-batches: the second is off-policy (w != 1), where the gate acts."""
    fused, plain, clip = (shared_run(_cfg(*a))[0] for a in (
        ("stapo-maspo", "trainer.fused_loss=true"), ("stapo-maspo", "trainer.fused_loss=false"),
        ("stapo", "trainer.fused_loss=false")))
    pf, pp, pc = (_params(s["run"].model) for s in (fused, plain, clip))
    torch.testing.assert_close(pf, pp, rtol=1e-4, atol=1e-6)
    assert not torch.equal(pp, pc)  # and MASPO is not the hard clip
