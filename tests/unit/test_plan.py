"""The memory plan (stapo.core.train.plan) against hand computations, DeepSpeed's estimators and a measured peak.

* Parameter counts of the shipped Qwen3 configs (built on the meta device) against the closed form
  of a Qwen3 decoder written out here, and against the model cards' published sizes.
* The plan of configs/stapo.yaml for Qwen3-8B and Qwen3-1.7B at 8 ranks, term by term, against the
  byte accounting written out in each test (no code of the plan reused).
* Model states against DeepSpeed's own ``estimate_zero{2,3}_model_states_mem_needs``; the documented
  ``stapo train --config configs/stapo.yaml --plan --world-size 8 --json`` runs offline.
* The named terms: ZeRO buffers from the engine's own bucket settings, the CUDA-graph pool and NCCL
  buffers a sleeping vLLM keeps without 0.33's flags, the fragmentation margin a fit requires; a
  fleet learner (vllm_server) with no KV cache and rank 0's push.
* What fits: the settings named for a config that does not fit (``fix``, a list of ``--set``
  overrides) fit it; `--plan` exits 1 when it does not fit; the update's bounded path is chosen when
  the kept graphs would eat the margin; the start-up check refuses a config that cannot fit.
* On CPU: one update of a small model, its peak resident memory measured by the kernel (VmHWM in a
  fresh process, glibc told to return large blocks) against the plan's update phase, within 15%.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import types
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stapo.cli.main import app
from stapo.core.config import load_config
from stapo.core.train import plan

REPO = Path(__file__).resolve().parents[2]
STAPO = REPO / "configs" / "stapo.yaml"
GIB = 2**30

# (hidden, intermediate, layers, heads, kv heads, head dim, vocab, tied) from the model cards / config.json
QWEN3 = {
    "Qwen/Qwen3-1.7B-Base": (2048, 6144, 28, 16, 8, 128, 151936, True),
    "Qwen/Qwen3-8B-Base": (4096, 12288, 36, 32, 8, 128, 151936, False),
    "Qwen/Qwen3-14B-Base": (5120, 17408, 40, 40, 8, 128, 151936, False),
}
CARD_SIZES = {"Qwen/Qwen3-1.7B-Base": 1.7e9, "Qwen/Qwen3-8B-Base": 8.2e9, "Qwen/Qwen3-14B-Base": 14.8e9}


def qwen3_params(h, i, n, heads, kv, d, v, tied):
    """A Qwen3 decoder by hand: embeddings (+ an untied LM head), per layer q/k/v/o, the SwiGLU MLP,
    two RMSNorms and the q/k norms (head dim each), and the final norm."""
    attn = h * heads * d + 2 * h * kv * d + heads * d * h
    layer = attn + 3 * h * i + 2 * h + 2 * d
    return v * h * (1 if tied else 2) + n * layer + h


def cfg_for(model: str, *overrides: str):
    return load_config(STAPO, [f"model.name_or_path={model}", *overrides])


@pytest.fixture(scope="module")
def shapes():
    return {m: plan.model_shape(cfg_for(m).model) for m in QWEN3}


def test_param_counts_from_config_match_the_closed_form_and_the_model_cards(shapes):
    for name, dims in QWEN3.items():
        s = shapes[name]
        assert s.params == qwen3_params(*dims), name
        assert s.largest_layer_params == dims[6] * dims[0]  # the embedding table (or the LM head)
        assert abs(s.params - CARD_SIZES[name]) < 0.05e9, name  # the cards round to 0.1B
    assert shapes["Qwen/Qwen3-8B-Base"].params == 8_190_735_360
    # the post-trained checkpoint's name resolves to the same shipped shapes
    assert plan.model_shape(cfg_for("Qwen/Qwen3-8B").model).params == 8_190_735_360


# DeepSpeed 0.19.8's defaults (deepspeed/runtime/zero/config.py), which configs/stapo.yaml leaves as they
# are: stage3_prefetch_bucket_size 5e7, stage3_max_live_parameters 1e9, reduce_bucket_size 5e8 elements
PREFETCH, MAX_LIVE, REDUCE = 50_000_000, 1_000_000_000, 500_000_000


def hand_plan(name, world, card_gib, kept: bool):
    """configs/stapo.yaml's plan by hand: ZeRO-3, bf16, micro_batch_size 1 row of 1024 + 15360 tokens,
    256 x 8 rows in 4 mini-batches, vLLM at 0.6 of the card with sleep mode (no vLLM installed: the
    CUDA-graph pool stays through the update), 1 GiB of CUDA context + 1 GiB of NCCL, ZeRO-3's buffers
    in bf16, a 5% margin."""
    h, i, n, heads, kv, d, v, tied = QWEN3[name]
    P = qwen3_params(*QWEN3[name])
    L = v * h
    states = 4 * L + 18 * P // world  # DeepSpeed ZeRO-3: one gathered layer + 18 B/param partitioned
    rows = 256 * 8 // 4 // world  # 64 rows per rank per mini-batch at 8 ranks
    T = 1 * (1024 + 15360)  # 16384 tokens in the longest forward
    micros = rows // 1
    graph = n * T * h * 2 + T * h * 2 + 2 * T * 4  # checkpointed layer inputs, final hidden, lp / H
    layer = T * (4 * h + 2 * heads * d + 2 * kv * d + 4 * i) * 2
    work = layer + layer // 2 + 3 * 2048 * v * 4  # 1.5 layers' activations, three fp32 [2048, V] head blocks
    runtime = GIB + GIB  # CUDA context, NCCL
    zero = 2 * (PREFETCH + min(MAX_LIVE, P) + REDUCE)
    graphs = GIB  # vLLM's CUDA-graph pool, kept asleep
    update = states + runtime + (micros * graph + work if kept else graph + work) + zero + graphs
    generate = states + runtime + int(0.6 * card_gib * GIB)
    # vLLM's bf16 weights + one streamed parameter (the embedding, 0 MiB sync bucket) + one layer's reload
    sync = states + runtime + 2 * P + v * h * 2 + L * 2 + graphs
    peak = max(update, generate, sync)
    return {"states": states, "T": T, "micros": micros, "update": update, "generate": generate, "sync": sync,
            "kept": micros * graph, "zero": zero, "peak": peak, "fits": peak + int(0.05 * card_gib * GIB) <= card_gib * GIB}


@pytest.mark.parametrize(("name", "kept_fits"), [("Qwen/Qwen3-8B-Base", False), ("Qwen/Qwen3-1.7B-Base", False)])
def test_recipe_plan_matches_the_hand_computation(shapes, name, kept_fits):
    p = plan.plan_run(cfg_for(name), 8, 80.0, shapes[name], sleep_flags=[])
    hand = hand_plan(name, 8, 80.0, kept=kept_fits)
    assert p.zero_buffers_gib == pytest.approx(hand["zero"] / GIB, abs=1e-3)
    assert (p.runtime_gib, p.nccl_gib, p.cuda_graphs_gib, p.fragmentation_gib) == (1.0, 1.0, 1.0, 4.0)
    assert p.model_states_gib == pytest.approx(hand["states"] / GIB, abs=1e-3)
    assert (p.micro_batch_tokens, p.micro_batches_per_mini_batch) == (hand["T"], hand["micros"])
    assert p.kept_graphs_gib == pytest.approx(hand["kept"] / GIB, abs=1e-3)
    assert p.phases_gib["update"] == pytest.approx(hand["update"] / GIB, abs=1e-3)
    assert p.phases_gib["generate"] == pytest.approx(hand["generate"] / GIB, abs=1e-3)
    assert p.phases_gib["weight sync"] == pytest.approx(hand["sync"] / GIB, abs=1e-3)
    assert p.peak_gib == pytest.approx(hand["peak"] / GIB, abs=1e-3)
    assert p.update_path == ("keep_graphs" if kept_fits else "bounded") and p.fits == hand["fits"] is True
    # weights + gradients + optimizer add up to the model states (DeepSpeed's total)
    assert p.weights_gib + p.gradients_gib + p.optimizer_gib == pytest.approx(p.model_states_gib, abs=3e-3)


def test_8b_kept_graphs_are_the_checkpointed_inputs_of_64_micro_batches(shapes):
    """64 micro-batches of 1 x 16384 tokens at 8B: 64 x 36 layers x 16384 tokens x 4096 x 2 B = 309 GB
    of checkpointed inputs, most of the kept graphs: far beyond any card, so the update is bounded."""
    p = plan.plan_run(cfg_for("Qwen/Qwen3-8B-Base"), 8, 80.0, shapes["Qwen/Qwen3-8B-Base"])
    ckpt = 64 * 36 * 16384 * 4096 * 2
    assert ckpt == pytest.approx(309.2e9, rel=1e-3)
    assert ckpt / GIB < p.kept_graphs_gib < ckpt / GIB + 64 and p.update_path == "bounded"


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("offload", [False, True])
def test_model_states_agree_with_deepspeeds_estimators(shapes, stage, offload):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    s = shapes["Qwen/Qwen3-14B-Base"]
    p = plan.plan_run(cfg_for("Qwen/Qwen3-14B-Base", f"trainer.zero_stage={stage}",
                              f"trainer.offload_optimizer={str(offload).lower()}"), 8, 200.0, s)
    if stage == 2:
        ds = estimate_zero2_model_states_mem_needs(s.params, 8, 1, cpu_offload=offload)[1]
    else:
        ds = estimate_zero3_model_states_mem_needs(s.params, s.largest_layer_params, 8, 1, cpu_offload=offload,
                                                   cpu_offload_params=False)[1]
    assert p.model_states_gib == pytest.approx(ds / GIB, rel=0.10)
    assert p.weights_gib + p.gradients_gib + p.optimizer_gib == pytest.approx(ds / GIB, rel=0.01)


def memory_plan_section() -> str:
    text = (REPO / "docs" / "gpu.md").read_text()
    start = text.index("## The memory plan")
    return text[start:text.index("\n## ", start + 1)]


def test_documented_plan_commands_run_offline_and_agree_with_deepspeed(monkeypatch):
    """Every command of docs/gpu.md's memory plan section, as written; the --json one's model states
    against DeepSpeed's ZeRO-3 estimator for its own params."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.chdir(REPO)
    block = memory_plan_section().split("```")[1]
    commands = [shlex.split(line) for line in block.strip().splitlines()]
    assert len(commands) == 3 and all(c[0] == "stapo" for c in commands)
    for argv in commands:
        res = CliRunner().invoke(app, argv[1:])
        assert res.exit_code in (0, 1), (argv, res.output)
        last = res.stdout.strip().splitlines()[-1]
        assert (res.exit_code == 0) == (last.endswith("fits") or '"fits": true' in last), (argv, res.output)
        if "--json" in argv:
            out = json.loads(res.stdout)  # stdout is the one JSON object and nothing else
            for key in ("params", "largest_layer_params", "model_states_gib", "peak_gib", "card_gib", "fits",
                        "fix", "zero_buffers_gib", "cuda_graphs_gib", "nccl_gib", "fragmentation_gib"):
                assert key in out
            assert isinstance(out["fix"], list)
            ds = estimate_zero3_model_states_mem_needs(out["params"], out["largest_layer_params"], 8, 1,
                                                       cpu_offload=False, cpu_offload_params=False)[1]
            assert out["model_states_gib"] == pytest.approx(ds / GIB, rel=0.10)
        else:
            assert sum(line.startswith("per-GPU peak:") for line in res.stdout.splitlines()) == 1


def test_documented_recipe_table_is_the_plans_output(shapes):
    rows = [line.split(" | ") for line in memory_plan_section().splitlines() if line.startswith("| Qwen3-")]
    assert len(rows) == 3
    for model, params, states, kept, path, peak, verdict in rows:
        name = "Qwen/" + model.strip("| ")
        p = plan.plan_run(cfg_for(name), 8, 80.0, shapes[name])
        assert params == f"{p.params / 1e9:.3f}B"
        assert states == f"{p.model_states_gib:.1f} GiB" and kept == f"{p.kept_graphs_gib:.1f} GiB"
        assert path == p.update_path and peak == f"{p.peak_gib:.1f} GiB ({p.peak_phase})"
        verdict = verdict.strip("| ")
        if p.fits:
            assert verdict == "fits"
        else:
            assert verdict == "fits with " + " ".join(f"`--set {k}`" for k in p.fix)


def test_a_config_that_does_not_fit_names_the_setting_that_fits_it(shapes):
    s = shapes["Qwen/Qwen3-14B-Base"]
    p = plan.plan_run(cfg_for("Qwen/Qwen3-14B-Base"), 8, 80.0, s, sleep_flags=[])
    # 14B: model states 33.8 GiB + 2 of runtime + 48 GiB of vLLM + the 4 GiB margin do not fit 80; a 0.50
    # share (40 GiB) does
    assert not p.fits and p.fix == ["rollout.vllm.gpu_memory_utilization=0.50"]
    fixed = plan.plan_run(cfg_for("Qwen/Qwen3-14B-Base", *p.fix), 8, 80.0, s, sleep_flags=[])
    assert fixed.fits and fixed.peak_gib == p.fix_peak_gib
    assert fixed.peak_gib + fixed.fragmentation_gib <= 80 < fixed.peak_gib + fixed.fragmentation_gib + 4
    # on a 60 GiB card no vLLM share leaves room for its weights: the optimizer goes to the CPU
    p60 = plan.plan_run(cfg_for("Qwen/Qwen3-14B-Base"), 8, 60.0, s, sleep_flags=[])
    assert not p60.fits and "trainer.offload_optimizer=true" in p60.fix
    # ZeRO-2 at 8B on 80 GB: 2 B/param whole + the rest partitioned, plus vLLM's 48 GiB, is too much
    p2 = plan.plan_run(cfg_for("Qwen/Qwen3-8B-Base", "trainer.zero_stage=2"), 8, 80.0, shapes["Qwen/Qwen3-8B-Base"])
    assert not p2.fits and "trainer.zero_stage=3" in p2.fix


def test_fitting_requires_the_fragmentation_margin(shapes):
    """A peak within the card but inside its 5% margin does not fit (a fleet learner: no phase scales
    with the card, as vLLM's share does)."""
    s = shapes["Qwen/Qwen3-8B-Base"]
    cfg = cfg_for("Qwen/Qwen3-8B-Base", "rollout.engine=vllm_server", "rollout.server.urls=[http://h:1]",
                  "trainer.update_memory=bounded")
    peak = plan.plan_memory(cfg, 8, 80.0, s).peak_gib
    tight = plan.plan_memory(cfg, 8, peak / 0.975, s)  # the peak plus half the margin
    roomy = plan.plan_memory(cfg, 8, peak / 0.95 + 0.01, s)
    assert tight.peak_gib == roomy.peak_gib == peak < tight.card_gib and not tight.fits and roomy.fits
    assert tight.fragmentation_gib == pytest.approx(0.05 * tight.card_gib, abs=2e-3)


def test_the_bounded_path_is_chosen_when_kept_graphs_would_eat_the_margin(shapes):
    """A card on which the kept graphs' update phase fits, but not with the margin: auto bounds them."""
    s = shapes["Qwen/Qwen3-8B-Base"]
    keep = plan.plan_memory(cfg_for("Qwen/Qwen3-8B-Base", "trainer.update_memory=keep_graphs"), 8, 200.0, s,
                            sleep_flags=[])
    card = keep.phases_gib["update"] / 0.97  # update < card < update + 5% of the card
    auto = plan.plan_memory(cfg_for("Qwen/Qwen3-8B-Base"), 8, card, s, sleep_flags=[])
    assert keep.update_path == "keep_graphs" and auto.update_path == "bounded"


def test_vllms_sleep_flags_free_the_graphs_and_the_nccl_buffers(shapes):
    """Without vLLM 0.33's flags a sleeping engine keeps its CUDA-graph pool (and, at TP 2, its
    communicators) through the update; with them the plan charges neither; enforce_eager has no graphs."""
    s = shapes["Qwen/Qwen3-1.7B-Base"]
    cfg = cfg_for("Qwen/Qwen3-1.7B-Base", "rollout.vllm.tensor_parallel_size=2")
    kept = plan.plan_memory(cfg, 8, 80.0, s, sleep_flags=[])
    freed = plan.plan_memory(cfg, 8, 80.0, s, sleep_flags=["sleep_mode_offload_cudagraph", "enable_nccl_comm_suspend"])
    assert (kept.cuda_graphs_gib, kept.nccl_gib) == (1.0, 1.5) and (freed.cuda_graphs_gib, freed.nccl_gib) == (0, 1.0)
    assert kept.phases_gib["update"] - freed.phases_gib["update"] == pytest.approx(1.5, abs=2e-3)
    eager = plan.plan_memory(cfg_for("Qwen/Qwen3-1.7B-Base", "rollout.vllm.enforce_eager=true"), 8, 80.0, s,
                             sleep_flags=[])
    assert eager.cuda_graphs_gib == 0


def test_zero_buffers_follow_the_engines_bucket_settings(shapes):
    """The ZeRO-3 term reads the engine's own settings: DeepSpeed's defaults, and a smaller live-parameter
    bound when the model is smaller than it (1.7B > 1e9: the bound; the tiny model: the model)."""
    s = shapes["Qwen/Qwen3-1.7B-Base"]
    zero = plan.zero_settings(cfg_for("Qwen/Qwen3-1.7B-Base"))
    assert (zero.prefetch_bucket_size, zero.max_live_parameters, zero.reduce_bucket_size) == (PREFETCH, MAX_LIVE, REDUCE)
    assert plan.zero_buffers(cfg_for("Qwen/Qwen3-1.7B-Base"), s) == 2 * (PREFETCH + MAX_LIVE + REDUCE)
    assert plan.zero_buffers(cfg_for("Qwen/Qwen3-1.7B-Base", "trainer.backend=torch"), s) == 0


def test_a_fleet_learner_plans_no_kv_cache_and_rank_0s_push(shapes):
    """rollout.engine=vllm_server: the servers generate, so a learner holds no KV cache and no vLLM;
    rank 0 gathers rollout.server.bucket_mb (512 MiB) for the push, or the largest parameter when that
    is larger (8B's embedding: 151936 x 4096 x 2 B = 1.16 GiB)."""
    s = shapes["Qwen/Qwen3-8B-Base"]
    cfg = cfg_for("Qwen/Qwen3-8B-Base", "rollout.engine=vllm_server", "rollout.server.urls=[http://127.0.0.1:8100]")
    p = plan.plan_run(cfg, 4, 80.0, s)
    assert p.kv_cache_gib == p.vllm_gib == p.cuda_graphs_gib == 0 and set(p.phases_gib) == {"update", "weight push"}
    base = p.model_states_gib + p.runtime_gib + p.nccl_gib
    assert p.phases_gib["weight push"] == pytest.approx(base + 151936 * 4096 * 2 / GIB, abs=2e-3)
    big = plan.plan_run(cfg_for("Qwen/Qwen3-8B-Base", "rollout.engine=vllm_server", "rollout.server.urls=[http://h:1]",
                                "rollout.server.bucket_mb=4096"), 4, 80.0, s)
    assert big.phases_gib["weight push"] == pytest.approx(base + 4.0, abs=2e-3)
    assert p.fits  # the documented one-node fleet (4 learners) fits an 80 GiB card


NCCL_FLEET = ("rollout.engine=vllm_server", "rollout.server.urls=[http://h:1]", "rollout.server.weight_sync=nccl",
              "rollout.server.nccl_master=h:29555")


def test_an_nccl_fleet_push_charges_vllms_packed_buffers_to_rank_0(shapes):
    """weight_sync=nccl: vLLM's packed broadcast holds 2 chunks at once (packed_tensor.py: one in flight,
    one being packed), each the 512 MiB buffer the push passes (rollout.server.bucket_mb) plus at most
    the parameter that closed it (8B's embedding, 151936 x 4096 bf16 = 1.16 GiB); under ZeRO-3 the
    chunk's gathered sources too (one more chunk) and the rest of their sync bucket."""
    s = shapes["Qwen/Qwen3-8B-Base"]
    chunk = 512 * 2**20 + 151936 * 4096 * 2
    p = plan.plan_run(cfg_for("Qwen/Qwen3-8B-Base", *NCCL_FLEET), 4, 80.0, s)  # ZeRO-3, sync_bucket_mb 0
    base = p.model_states_gib + p.runtime_gib + p.nccl_gib
    assert p.phases_gib["weight push"] == pytest.approx(base + 3 * chunk / GIB, abs=2e-3)  # 4.98 GiB
    bucket = plan.plan_run(cfg_for("Qwen/Qwen3-8B-Base", *NCCL_FLEET, "trainer.sync_bucket_mb=256"), 4, 80.0, s)
    assert bucket.phases_gib["weight push"] == pytest.approx(base + (3 * chunk + 256 * 2**20) / GIB, abs=2e-3)
    z2 = plan.plan_run(cfg_for("Qwen/Qwen3-8B-Base", *NCCL_FLEET, "trainer.zero_stage=2"), 4, 80.0, s)
    z2_base = z2.model_states_gib + z2.runtime_gib + z2.nccl_gib
    assert z2.phases_gib["weight push"] == pytest.approx(z2_base + 2 * chunk / GIB, abs=2e-3)  # no gather, no copy
    torch1 = plan.plan_run(cfg_for("Qwen/Qwen3-1.7B-Base", *NCCL_FLEET, "trainer.backend=torch"), 1, 80.0,
                           shapes["Qwen/Qwen3-1.7B-Base"])
    t_base = torch1.model_states_gib + torch1.runtime_gib + torch1.nccl_gib
    assert torch1.phases_gib["weight push"] == pytest.approx(  # fp32 weights on the wire
        t_base + 2 * (512 * 2**20 + 151936 * 2048 * 4) / GIB, abs=2e-3)
    assert "weight push peak" in "\n".join(p.report()) and "nccl: 2 packed buffers of 512 MiB" in p.weight_push


def test_plan_shows_the_nccl_push_and_names_a_smaller_bucket_when_it_does_not_fit(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    args = ["train", "--config", str(STAPO), *[a for k in NCCL_FLEET for a in ("--set", k)], "--plan", "--world-size", "4"]
    res = CliRunner().invoke(app, [*args, "--card-gib", "80"])
    assert res.exit_code == 0, res.output
    assert re.search(r"rank 0's weight push peak [\d.]+ GiB \(nccl: 2 packed buffers of 512 MiB \+ one parameter "
                     r"each, its gathered sources and a 0 MiB sync bucket \(ZeRO-3\)\)", res.stdout), res.stdout
    # on a 56 GiB card (2.8 GiB margin) the update (53.1 GiB) fits and a 4096 MiB push (54.1) does not
    tight = plan.plan_run(cfg_for("Qwen/Qwen3-8B-Base", *NCCL_FLEET, "rollout.server.bucket_mb=4096"), 4, 56.0)
    assert tight.peak_phase == "weight push" and not tight.fits and tight.fix == ["rollout.server.bucket_mb=1024"]


def test_kept_graphs_that_do_not_fit_take_the_bounded_path(shapes):
    s = shapes["Qwen/Qwen3-8B-Base"]
    p = plan.plan_run(cfg_for("Qwen/Qwen3-8B-Base"), 8, 64.0, s)
    hand = hand_plan("Qwen/Qwen3-8B-Base", 8, 64.0, kept=False)
    assert p.update_path == "bounded" and p.fits
    assert p.phases_gib["update"] == pytest.approx(hand["update"] / GIB, abs=1e-3)
    assert "update path: bounded" in p.line()
    # a weighting that reads no statistics never keeps graphs
    none = plan.plan_run(cfg_for("Qwen/Qwen3-8B-Base", "algorithm.token_weighting=none"), 8, 64.0, s)
    assert none.update_path == "per_micro_batch" and none.kept_graphs_gib == 0


def test_start_check_on_a_gpu_refuses_or_resolves_the_path(shapes):
    """plan_at_start with trainer.device=cuda (the plan itself needs no GPU; the card is the config's)."""
    cfg, p = plan.plan_at_start(cfg_for("Qwen/Qwen3-8B-Base", "trainer.device=cuda", "trainer.gpu_memory_gib=64"), 8)
    assert p is not None and cfg.trainer.update_memory == "bounded"
    with pytest.raises(plan.PlanError, match=r"per-GPU peak: .*--set rollout.vllm.gpu_memory_utilization=0.50"):
        plan.plan_at_start(cfg_for("Qwen/Qwen3-14B-Base", "trainer.device=cuda", "trainer.gpu_memory_gib=80"), 8)
    cfg, p = plan.plan_at_start(cfg_for("Qwen/Qwen3-8B-Base", "trainer.device=cpu"), 8)
    assert p is None  # on CPU the check is skipped (stapo train says so)


def test_any_local_model_folder_plans_from_its_config_json(tmp_path):
    """A folder with only config.json: the meta-device count equals the real model's parameters."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=500, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    config.save_pretrained(tmp_path)
    real = LlamaForCausalLM(config)
    s = plan.model_shape(cfg_for(str(tmp_path)).model)
    assert s.params == sum(p.numel() for p in real.parameters())
    assert (s.kv_heads, s.head_dim, s.largest_layer_params) == (2, 16, 500 * 64)


def test_a_model_without_config_is_one_line():
    with pytest.raises(plan.PlanError, match="model.name_or_path=org/unknown: the plan needs the model's config.json"):
        plan.model_shape(cfg_for("org/unknown").model)


BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "plan_memory.py"


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's peak-RSS reset")
def test_measured_kept_graphs_and_optimizer_bytes_match_the_plan():
    """benchmarks/plan_memory.py on a 4M-parameter model, 12 rows of 384 tokens in 4 micro-batches:
    the kept graphs are the difference of the two update paths' measured peaks (the process's fixed
    costs, which vary with the machine, cancel), against the plan's kept-graph term; AdamW's moments
    are counted tensor by tensor. The absolute peaks are the benchmark's (benchmarks/RESULTS.md)."""
    out = subprocess.run([sys.executable, str(BENCH), "--hidden", "256", "--json"], capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    keep, bounded = json.loads(out.stdout.strip().splitlines()[-1])
    assert (keep["path"], bounded["path"]) == ("keep_graphs", "bounded")
    planned = keep["planned"] - bounded["planned"]
    # four micro-batches' graphs kept; the bounded path holds one at a time (the plan's GiB are rounded)
    assert planned == pytest.approx(keep["kept_graphs"] * 3 / 4, rel=0.05)
    assert keep["measured"] - bounded["measured"] == pytest.approx(planned, rel=0.15), (keep, bounded)
    for r in (keep, bounded):
        assert r["optimizer_bytes"] == pytest.approx(r["planned_optimizer_bytes"], abs=1)


def test_train_checks_the_plan_at_start(monkeypatch, capsys, tmp_path, stub_train):
    """On CPU the check is skipped and says so; a GPU config that cannot fit is refused before anything
    loads (trainer.device=cuda: the plan needs no GPU, the card is the config's), one that needs the
    bounded path trains with it."""
    seen = stub_train
    res = CliRunner().invoke(app, ["train", "--config", "tiny", "--run-dir", str(tmp_path / "a")])
    assert res.exit_code == 0, res.output
    assert "memory plan: skipped (CPU run" in res.stdout and len(seen) == 1
    gpu = ["--set", "trainer.device=cuda", "--set", "model.name_or_path=Qwen/Qwen3-14B-Base", "--set",
           "trainer.backend=deepspeed", "--set", "trainer.zero_stage=3", "--set", "trainer.micro_batch_size=4",
           "--set", "data.max_prompt_tokens=1024", "--set", "rollout.max_new_tokens=8192"]
    monkeypatch.setattr(plan, "card_gib", lambda cfg, given=None: 80.0)
    # vLLM is not installed beside the test venv (it needs its own): an empty stand-in module passes the
    # launch's import check, which runs before the plan, so the plan's refusal is what this run meets.
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    # no GPU here: the device check (which refuses cuda on a CPU machine) stands in for a GPU node's
    from stapo.core.train import prepare

    monkeypatch.setattr(prepare, "check_engine_and_device", lambda cfg, environ=None, given=(): None)
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setattr(sys, "argv", ["stapo", "train", "--config", str(STAPO), "--run-dir", str(tmp_path / "b"), *gpu])
    from stapo.cli.main import main

    with pytest.raises(SystemExit) as exc:
        main()
    err = capsys.readouterr().err
    assert exc.value.code != 0 and len(seen) == 1
    assert "per-GPU peak:" in err and "--set rollout.vllm.gpu_memory_utilization=0.50" in err
    assert not (tmp_path / "b").exists()


def test_plan_exits_non_zero_when_it_does_not_fit_and_json_lists_the_fix(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    res = CliRunner().invoke(app, ["train", "--config", str(STAPO), "--set", "model.name_or_path=Qwen/Qwen3-14B-Base",
                                   "--plan", "--world-size", "8", "--card-gib", "80", "--json"])
    out = json.loads(res.stdout)
    assert res.exit_code == 1 and not out["fits"] and out["fix"] == ["rollout.vllm.gpu_memory_utilization=0.50"]
    fixed = CliRunner().invoke(app, ["train", "--config", str(STAPO), "--set", "model.name_or_path=Qwen/Qwen3-14B-Base",
                                     *[a for k in out["fix"] for a in ("--set", k)],
                                     "--plan", "--world-size", "8", "--card-gib", "80"])
    assert fixed.exit_code == 0 and fixed.stdout.strip().endswith("fits")


def test_plan_flags_go_with_plan():
    res = CliRunner().invoke(app, ["train", "--config", "tiny", "--json"])
    assert res.exit_code != 0 and "--json and --world-size go with --plan" in str(res.exception)
