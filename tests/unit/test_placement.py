"""Placement: which device each rank takes, decided by one pure function of the launcher's environment.

The table below covers the launchers' variables (deepspeed's ``LOCAL_SIZE``, torchrun's
``LOCAL_WORLD_SIZE``, one GPU made visible per task, CPU ranks) with the devices worked out by hand;
a second table checks the ``LOCAL_RANK`` that DeepSpeed and vLLM then read is each rank's own
device's index (Slurm's ``--gpus-per-task=1`` and ``--gpus-per-node``, launchers, one process).
The ordering test runs the loop's start-up with a fake ``torch.cuda`` (no GPU here): it reports 2
GPUs and records ``set_device``; the test checks ``set_device(cuda:1)`` comes before the policy
loads, and that the policy loads on the CPU (the backend places it).
"""

from __future__ import annotations

import pytest
import torch

from stapo.core.placement import Placement, apply, place, presented_env

LAUNCH2 = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}


@pytest.mark.parametrize(
    "env, gpus, requested, tp, device, physical",
    [
        ({}, 0, "auto", 1, "cpu", None),  # alone, no GPU
        ({}, 1, "auto", 1, "cuda:0", "0"),  # alone, one GPU
        ({}, 8, "cuda:3", 1, "cuda:3", "3"),  # alone, a chosen GPU
        ({}, 4, "cpu", 1, "cpu", None),
        (LAUNCH2, 2, "auto", 1, "cuda:1", "1"),  # torchrun, one node
        (LAUNCH2, 0, "auto", 1, "cpu", None),  # torchrun on CPU
        # deepspeed launcher on node 1 of 2 (8 GPUs each): global rank 11, local 3, LOCAL_SIZE
        ({"RANK": "11", "WORLD_SIZE": "16", "LOCAL_RANK": "3", "LOCAL_SIZE": "8"}, 8, "auto", 1, "cuda:3", "3"),
        # deepspeed --include localhost:4,5,6,7 exports CUDA_VISIBLE_DEVICES: local rank 2 is physical GPU 6
        ({**LAUNCH2, "RANK": "2", "LOCAL_RANK": "2", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4",
          "CUDA_VISIBLE_DEVICES": "4,5,6,7"}, 4, "cuda", 1, "cuda:2", "6"),
        # Slurm --gpus-per-task=1: each task sees only its own GPU
        ({**LAUNCH2, "CUDA_VISIBLE_DEVICES": "5"}, 1, "auto", 1, "cuda:0", "5"),
        # tensor parallel 2 over 4 ranks: rank 3 is in group 1
        ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4"}, 4, "auto", 2, "cuda:3", "3"),
    ],
)
def test_each_environment_gets_its_device(env, gpus, requested, tp, device, physical):
    p = place(env, cuda_devices=gpus, requested=requested, tp_size=tp)
    assert (p.device, p.physical_gpu) == (device, physical)
    assert p.rank == int(env.get("RANK", 0)) and p.local_rank == int(env.get("LOCAL_RANK", 0))


def test_tensor_parallel_groups_are_consecutive_ranks():
    groups = [place({"RANK": str(r), "WORLD_SIZE": "8", "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "8"},
                    cuda_devices=8, tp_size=2) for r in range(8)]
    assert [(p.tp_group, p.tp_rank) for p in groups] == [(r // 2, r % 2) for r in range(8)]
    assert "vLLM tensor-parallel group 1" in groups[3].describe()


@pytest.mark.parametrize(
    "env, gpus, requested, tp, fragment",
    [
        ({"RANK": "1", "WORLD_SIZE": "2"}, 2, "auto", 1, "LOCAL_RANK is unset"),
        ({**LAUNCH2, "LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "3", "RANK": "1"}, 2, "auto", 1, "4 ranks on this node but 2 GPUs"),
        (LAUNCH2, 2, "cuda:1", 1, "pins one GPU"),
        (LAUNCH2, 1, "auto", 1, "2 ranks on this node but 1 GPUs"),  # two ranks would share GPU 0
        (LAUNCH2, 0, "cuda", 1, "CUDA is not available"),
        ({**LAUNCH2, "WORLD_SIZE": "3", "RANK": "1"}, 2, "auto", 2, "rollout.vllm.tensor_parallel_size (2) must divide"),
        ({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, 2, "auto", 4, "stays on one node"),
        ({"RANK": "x"}, 0, "auto", 1, "RANK='x' is not an integer"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, 0, "auto", 1, "outside WORLD_SIZE"),
    ],
)
def test_impossible_placements_name_the_variable_or_key(env, gpus, requested, tp, fragment):
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        place(env, cuda_devices=gpus, requested=requested, tp_size=tp)


# What DeepSpeed (set_device(LOCAL_RANK)), zero.Init and vLLM's external launcher (LOCAL_RANK < device
# count, cuda:LOCAL_RANK) see as LOCAL_RANK once the rank is placed: always the index of its own device.
SLURM_TASK3 = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "8"}


@pytest.mark.parametrize(
    "env, gpus, requested, presented",
    [
        ({**SLURM_TASK3, "CUDA_VISIBLE_DEVICES": "3"}, 1, "auto",  # --gpus-per-task=1: sees only GPU 3
         {"LOCAL_RANK": "0", "STAPO_LAUNCHER_LOCAL_RANK": "3"}),
        ({**SLURM_TASK3, "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}, 8, "auto", {}),  # --gpus-per-node=8
        (SLURM_TASK3, 8, "auto", {}),  # deepspeed / torchrun: every GPU of the node visible
        ({**SLURM_TASK3, "LOCAL_RANK": "0", "RANK": "0", "CUDA_VISIBLE_DEVICES": "6"}, 1, "auto", {}),  # task 0
        ({}, 8, "cuda:5", {"LOCAL_RANK": "5", "STAPO_LAUNCHER_LOCAL_RANK": "0"}),  # one process on a chosen GPU
        ({**SLURM_TASK3, "CUDA_VISIBLE_DEVICES": "3"}, 0, "auto", {}),  # CPU: nothing indexes a GPU
    ],
)
def test_local_rank_is_presented_as_the_ranks_own_device(env, gpus, requested, presented, monkeypatch):
    p = place(env, cuda_devices=gpus, requested=requested)
    assert presented_env(p, env) == presented
    seen = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.append(str(d)))
    proc = dict(env)
    apply(p, proc)
    index = p.device.split(":")[1] if p.is_cuda else None
    if p.is_cuda:  # what DeepSpeed and vLLM then compute from LOCAL_RANK is the device set here
        assert seen == [p.device] and proc["LOCAL_RANK"] == index and int(proc["LOCAL_RANK"]) < gpus
        again = place(proc, cuda_devices=gpus, requested=requested)  # a second look agrees
        assert again.device == p.device and presented_env(again, proc) == {}
    else:
        assert seen == [] and proc == env


def test_vllm_tensor_parallel_under_one_gpu_per_task_names_the_slurm_setting():
    env = {**SLURM_TASK3, "CUDA_VISIBLE_DEVICES": "3"}
    with pytest.raises(ValueError, match=r"^rollout\.vllm\.tensor_parallel_size=2 with one GPU visible per process.*"
                                         r"--gpus-per-node .*--gpus-per-task=1"):
        place(env, cuda_devices=1, tp_size=2)


class _Stop(Exception):
    pass


def test_set_device_comes_before_the_policy_loads(monkeypatch, tmp_path):
    """Fake ``torch.cuda`` (no GPU on this machine): 2 devices; this process is local rank 1 of 2."""
    from stapo.configs import preset_path
    from stapo.core.config import load_config
    from stapo.core.train.run import Run
    from stapo.core.trainer import models

    events: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: events.append(f"set_device {torch.device(d)}"))
    for k, v in LAUNCH2.items():
        monkeypatch.setenv(k, v)

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)

    def fake_load(model_cfg, *, device="cpu", compute_device=None, init_context=None):
        events.append(f"load_policy on {device} for {compute_device}")
        assert models.resolve_dtype(model_cfg, compute_device) == torch.bfloat16  # `auto` on a GPU
        raise _Stop

    monkeypatch.setattr(models, "load_policy", fake_load)
    # the memory plan (a GPU run's first part) measures against the config's card: no GPU to ask
    # (two ranks train under DeepSpeed: the launch check refuses the one-process torch backend)
    pytest.importorskip("deepspeed")
    cfg = load_config(preset_path("tiny"), ["trainer.device=auto", "model.dtype=auto", "trainer.gpu_memory_gib=80",
                                            "trainer.backend=deepspeed"])
    with pytest.raises(_Stop):
        Run.build(cfg, tmp_path, log=lambda m: None)
    assert events == ["set_device cuda:1", "load_policy on cpu for cuda:1"]


def test_resolve_device_under_a_launcher(monkeypatch):
    """Fake ``torch.cuda`` with 2 devices (no GPU here); this process is local rank 1 of 2."""
    from stapo.core.placement import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for k, v in LAUNCH2.items():
        monkeypatch.setenv(k, v)
    assert [resolve_device(n) for n in ("auto", "cuda", "cuda:1", "cpu")] == [
        torch.device("cuda:1"), torch.device("cuda:1"), torch.device("cuda:1"), torch.device("cpu")]
    with pytest.raises(ValueError, match="cannot parse 'gpu'"):
        resolve_device("gpu")


def test_record_writes_where_the_rank_landed(tmp_path):
    import json

    p = Placement(rank=3, world_size=4, local_rank=1, local_world_size=2, device="cuda:1", physical_gpu="5")
    row = json.loads(p.record(tmp_path).read_text())
    assert (row["rank"], row["local_rank"], row["device"], row["physical_gpu"]) == (3, 1, "cuda:1", "5")
    assert row["host"] and row["pid"] > 0


def test_a_tensor_parallel_rank_keeps_its_own_share_of_the_group_outputs():
    """The group generates every rank's prompts in rank order; each rank keeps its own slice."""
    from stapo.core.rollout.vllm import own_share

    outputs = ["a0", "a1", "b0", "b1", "b2"]  # rank 0 sent 2 prompts, rank 1 sent 3
    assert own_share(outputs, [2, 3], 0) == ["a0", "a1"]
    assert own_share(outputs, [2, 3], 1) == ["b0", "b1", "b2"]
    assert own_share(outputs, [0, 5], 0) == []
