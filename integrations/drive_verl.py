"""verl's own reward code against the service and the adapters (run in a verl venv by integrations/run.py).

The config is composed from verl's own ``ppo_trainer.yaml`` with the overrides a user passes to
``python -m verl.trainer.main_ppo`` (Hydra's compose API, the same files and defaults), and the
rewards come from verl's own entry points:

* verl >= 0.7: ``verl.experimental.reward_loop.RewardLoopManager(config).compute_rm_score(batch)``,
  the Ray reward-loop workers the trainer uses (``reward.custom_reward_function.*`` and
  ``reward.reward_manager.name`` keys);
* verl 0.6.x: ``load_reward_manager(config, tokenizer, num_examine=0, **reward_model.reward_kwargs)``
  then ``compute_reward(batch, reward_fn)``, as ``main_ppo`` / ``RayPPOTrainer`` call them
  (``custom_reward_function.*`` and ``reward_model.reward_manager`` keys), for the naive, dapo,
  batch and prime managers. The prime manager forks a ``ProcessPoolExecutor`` after this process
  already called the service (the naive route runs first): the adapters' fork safety is checked here.

Only generation is replaced: a batch is built from known responses with a tokenizer made here.
"""

from __future__ import annotations

import os
import sys
import tempfile

import numpy as np
import torch
import verl
from cases import CASES, FAILURE, PROMPT, Case, args, emit, env_for, expected, tiny_tokenizer
from verl import DataProto

A = args()
VERSION = verl.__version__
NEW_LOOP = tuple(int(x) for x in VERSION.split(".")[:2]) >= (0, 7)
WORK = tempfile.mkdtemp(prefix="verl-drive-")
TOK_DIR = os.path.join(WORK, "tokenizer")
TOK = tiny_tokenizer(TOK_DIR)


def batch(cases=CASES) -> DataProto:
    """What the rollout hands to the reward step: left-padded prompts, right-padded responses."""
    p_ids = [TOK(PROMPT, add_special_tokens=False)["input_ids"] for _ in cases]
    r_ids = [TOK(c.response, add_special_tokens=False)["input_ids"] for c in cases]
    P, R, pad = max(map(len, p_ids)), max(map(len, r_ids)), TOK.pad_token_id
    prompts = torch.tensor([[pad] * (P - len(p)) + p for p in p_ids])
    responses = torch.tensor([r + [pad] * (R - len(r)) for r in r_ids])
    p_mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in p_ids])
    r_mask = torch.tensor([[1] * len(r) + [0] * (R - len(r)) for r in r_ids])
    mask = torch.cat([p_mask, r_mask], dim=1)
    return DataProto.from_dict(
        tensors={
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": mask,
            "position_ids": (mask.cumsum(1) - 1).clamp(min=0),
        },
        non_tensors={
            "data_source": np.array(["math_dapo"] * len(cases), dtype=object),
            "reward_model": np.array(
                [{"ground_truth": c.gold, "style": "rule"} for c in cases], dtype=object
            ),
            "extra_info": np.array([{"index": i} for i in range(len(cases))], dtype=object),
        },
    )


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    cfg_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=cfg_dir, version_base=None):
        return hydra_compose(config_name="ppo_trainer", overrides=overrides)


def per_item(reward_tensor: torch.Tensor) -> list[float]:
    return [float(x) for x in reward_tensor.sum(dim=-1)]


def raised(err: BaseException) -> str:
    """The adapters' exception, also when Ray wraps it (``RayTaskError(VerifierUnavailable)``)."""
    text = f"{type(err).__name__}: {err}"
    for name in ("VerifierUnavailable", "VerifierRequestError"):
        if name in text:
            return f"raises {name}"
    return f"raises {type(err).__name__}"


# ----------------------------------------------------------------------------------- verl >= 0.7


def loop_config(overrides: list[str]):
    return compose([f"actor_rollout_ref.model.path={TOK_DIR}", "reward.num_workers=1", *overrides])


def reward_loop_ray(overrides: list[str], env: dict[str, str]) -> list[float] | str:
    """``RewardLoopManager`` as ``RayPPOTrainer`` builds it: a local Ray whose workers see ``env``
    (the variables a user exports before starting the job), one reward-loop worker actor."""
    import ray
    from verl.experimental.reward_loop import RewardLoopManager

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
    try:
        out = RewardLoopManager(loop_config(overrides)).compute_rm_score(batch())
        return per_item(out.batch["rm_scores"])
    except Exception as err:  # noqa: BLE001 - the row shows it
        return raised(err)
    finally:
        ray.shutdown()


def reward_loop(overrides: list[str]) -> list[float] | str:
    """The reward-loop worker class the manager runs as a Ray actor (``RewardLoopWorker``), here in
    this process (one Ray actor costs minutes on a loaded 2-core machine), and the manager class's
    own ``assemble_rm_scores``: the same code from config to reward tensor, without Ray."""
    from verl.experimental.reward_loop import RewardLoopWorker
    from verl.trainer.ppo.reward import resolve_reward_manager_cls

    config = loop_config(overrides)
    data = batch()
    try:
        worker = RewardLoopWorker(config)
        outs = worker.loop.run_until_complete(worker.compute_score_batch(data))
        scores = [o["reward_score"] for o in outs]
        return per_item(resolve_reward_manager_cls(config).assemble_rm_scores(data, scores))
    except Exception as err:  # noqa: BLE001 - the row shows it
        return raised(err)


def run_new_loop() -> None:
    pkg = "pkg://stapo.verifier_service.clients.adapters"
    fn = ["reward.custom_reward_function.name=compute_score"]
    want = expected()
    os.environ["STAPO_VERIFIER_FAILURE_SCORE"] = str(FAILURE)
    exported = {
        "STAPO_VERIFIER_URL": A["url"],
        "STAPO_VERIFIER_TOKEN": A["token"],
        "STAPO_VERIFIER_FAILURE_SCORE": str(FAILURE),
        "STAPO_VERIFIER_MAX_PREDICTION_CHARS": os.environ["STAPO_VERIFIER_MAX_PREDICTION_CHARS"],
    }
    emit(
        "RewardLoopManager (Ray), naive, pkg://, service",
        reward_loop_ray([f"reward.custom_reward_function.path={pkg}", *fn], exported),
        want,
    )
    env_for(A["url"], A["token"])
    emit("naive, pkg:// path, service", reward_loop([f"reward.custom_reward_function.path={pkg}", *fn]), want)
    emit(
        "naive, file path, service",
        reward_loop([f"reward.custom_reward_function.path={A['adapters_file']}", *fn]),
        want,
    )
    emit(
        "dapo, pkg:// path, service",
        reward_loop([f"reward.custom_reward_function.path={pkg}", *fn, "reward.reward_manager.name=dapo"]),
        want,
    )
    # dapo's overlong penalty (verl 0.9 DAPORewardManager: needs reward_kwargs.max_resp_len too) is
    # added to whatever score the function returned, the failure value of an ungraded item included
    lens = [int(x) for x in batch().batch["attention_mask"][:, -batch().batch["responses"].shape[1] :].sum(-1)]
    buf = max(lens[:-1])  # the graded items stay within max_resp_len - buffer: no penalty for them
    overlong = [
        f"reward.custom_reward_function.path={pkg}",
        *fn,
        "reward.reward_manager.name=dapo",
        "+reward.reward_kwargs.overlong_buffer_cfg.enable=True",
        f"+reward.reward_kwargs.overlong_buffer_cfg.len={buf}",
        "+reward.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0",
        "+reward.reward_kwargs.overlong_buffer_cfg.log=False",
    ]
    max_resp = 2 * buf
    penalty = [min(-(n - (max_resp - buf)) / buf * 1.0, 0.0) for n in lens]  # verl's formula, by hand
    emit(
        "dapo + overlong penalty with max_resp_len, a failed item",
        [round(x, 3) for x in reward_loop([*overlong, f"+reward.reward_kwargs.max_resp_len={max_resp}"])],
        [round(w + pen, 3) for w, pen in zip(want, penalty, strict=True)],
        "the failed (too long) item scores the failure value plus the penalty",
    )
    emit("dapo + overlong penalty without max_resp_len", reward_loop(overlong), "raises AssertionError")
    emit(
        "naive, service down (reward_kwargs.url)",
        reward_loop(
            [
                f"reward.custom_reward_function.path={pkg}",
                *fn,
                f"+reward.custom_reward_function.reward_kwargs.url={A['dead_url']}",
            ]
        ),
        "raises VerifierUnavailable",
    )
    env_for(A["url"], "wrong-token")
    emit(
        "naive, wrong token",
        reward_loop([f"reward.custom_reward_function.path={pkg}", *fn]),
        "raises VerifierRequestError",
    )
    env_for(None, None)
    emit("naive, in-process pool", reward_loop([f"reward.custom_reward_function.path={pkg}", *fn]), want)

    # main_ppo of this version does not migrate the legacy keys: the custom function is not loaded
    from verl.trainer.ppo.reward import get_custom_reward_fn

    legacy = compose(
        [f"custom_reward_function.path={A['adapters_file']}", "custom_reward_function.name=compute_score"]
    )
    emit(
        "legacy custom_reward_function.* keys",
        "ignored" if get_custom_reward_fn(legacy) is None else "loaded",
        "ignored",
        "main_ppo of 0.9.x does not migrate them (0.7-0.8 do); verl grades with its own scorer",
    )
    from verl.experimental.reward_loop.reward_manager import get_reward_manager_cls

    for name in ("prime", "batch"):
        try:
            get_reward_manager_cls(name)
            found = "exists"
        except Exception:  # noqa: BLE001 - verl raises ValueError for an unknown name
            found = "absent"
        emit(
            f"reward loop manager '{name}'", found, "absent", "the legacy managers are not in the reward loop"
        )


# ----------------------------------------------------------------------------------- verl 0.6.x


def slow_cases(n: int, start: int) -> list[Case]:
    """Distinct right answers that only a real sympy comparison decides (tens of ms each at the
    service): the prime manager's workers then have requests in flight at the same time."""
    return [
        Case(
            f"slow {k}",
            f"so \\boxed{{\\frac{{{k}\\sqrt{{2}}}}{{{k + 1}}}}}",
            f"\\frac{{\\sqrt{{{2 * k * k}}}}}{{{k + 1}}}",
            True,
        )
        for k in range(start, start + n)
    ]


def legacy(
    overrides: list[str], steps: int = 1, before_step=None, repeat: int = 1, cases=None
) -> list[float] | str:
    """``load_reward_manager`` + ``compute_reward`` as main_ppo / RayPPOTrainer call them (one call per step)."""
    from verl.trainer.ppo.reward import compute_reward, load_reward_manager

    config = compose(overrides)
    try:
        reward_fn = load_reward_manager(
            config, TOK, num_examine=0, **config.reward_model.get("reward_kwargs", {})
        )
        out: list[float] = []
        for _ in range(steps):
            if before_step is not None:
                before_step()
            reward_tensor, _ = compute_reward(batch(cases or CASES * repeat), reward_fn)
            out += per_item(reward_tensor)
        return out
    except Exception as err:  # noqa: BLE001 - the row shows it
        return raised(err)


def run_legacy() -> None:
    path = [f"custom_reward_function.path={A['adapters_file']}"]
    want = expected()
    overlong = [
        "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=False",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.len=0",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=0.0",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.log=False",
        "+reward_model.reward_kwargs.max_resp_len=4096",
    ]
    os.environ["STAPO_VERIFIER_FAILURE_SCORE"] = str(FAILURE)
    env_for(A["url"], A["token"])
    emit("naive, file path, service", legacy([*path, "custom_reward_function.name=compute_score"]), want)
    emit(
        "dapo + overlong_buffer_cfg keys, service",
        legacy(
            [
                *path,
                "custom_reward_function.name=compute_score",
                "reward_model.reward_manager=dapo",
                *overlong,
            ]
        ),
        want,
    )
    emit(
        "dapo without overlong_buffer_cfg keys",
        legacy([*path, "custom_reward_function.name=compute_score", "reward_model.reward_manager=dapo"]),
        "raises AttributeError",
        "the manager reads overlong_buffer_cfg.enable",
    )
    emit(
        "batch, service",
        legacy(
            [*path, "custom_reward_function.name=compute_score_batch", "reward_model.reward_manager=batch"]
        ),
        want,
    )
    # The trainer process itself calls the service just before each step (a validation or logging
    # call), so it holds an idle keep-alive connection when the prime manager forks its 64 workers,
    # which then grade concurrently: three steps (three pools), as three training steps would, of
    # 64 items each (with 8, the first worker forked grades them all before the next one is up).
    # (uvicorn drops an idle connection after 5 s: a call long before the fork would test nothing.)
    from stapo.verifier_service.clients import adapters

    def parent_call():
        assert adapters.compute_score("x", "\\boxed{1}", "1")["score"] == 1.0

    prime = [*path, "custom_reward_function.name=compute_score_prime", "reward_model.reward_manager=prime"]
    emit(
        "prime, service, after fork (3 steps x 64 items)",
        legacy(prime, steps=3, before_step=parent_call, repeat=8),
        want * 24,
    )
    emit(
        "prime, service, after fork (64 sympy items)",
        legacy(prime, before_step=parent_call, cases=slow_cases(64, 3)),
        [1.0] * 64,
    )
    emit("naive, wrong token", _wrong_token(path), "raises VerifierRequestError")
    env_for(A["dead_url"], A["token"])
    emit(
        "naive, service down",
        legacy([*path, "custom_reward_function.name=compute_score"]),
        "raises VerifierUnavailable",
    )
    emit(
        "prime, service down",
        legacy(prime),
        [0.0] * len(CASES),
        "verl's prime manager turns the error into 0.0 (prints '[Error] Task failed')",
    )
    env_for(None, None)
    emit("prime, in-process", legacy(prime), want)
    emit("naive, in-process pool", legacy([*path, "custom_reward_function.name=compute_score"]), want)


def _wrong_token(path: list[str]) -> list[float] | str:
    env_for(A["url"], "wrong-token")
    try:
        return legacy([*path, "custom_reward_function.name=compute_score"])
    finally:
        env_for(A["url"], A["token"])


if __name__ == "__main__":
    sys.setrecursionlimit(10_000)
    (run_new_loop if NEW_LOOP else run_legacy)()
