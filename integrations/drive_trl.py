"""TRL's own reward step against the service and the adapters (run in a TRL venv).

A real ``GRPOTrainer`` (a tiny random Qwen2 model and a tokenizer built here, on the CPU) with
``reward_funcs=[make_trl_reward("answer")]``; the rewards come from the trainer's own reward step
(``GRPOTrainer._calculate_rewards``, the method ``_generate_and_score_completions`` calls after
generation) given the known completions: the same keyword call (``prompts=``, ``completions=``,
``completion_ids=``, every data set column, ``trainer_state``, ``log_extra``, ``log_metric``) and
the same ``None`` -> NaN handling. That method is TRL-internal: it is the only way to give the
trainer completions whose rewards are known instead of sampled ones.
"""

from __future__ import annotations

import math
import os
import sys
import tempfile

from cases import CASES, PROMPT, args, emit, env_for, expected, tiny_tokenizer

A = args()
WORK = tempfile.mkdtemp(prefix="trl-drive-")
TOK = tiny_tokenizer()


def trainer():
    import torch
    from datasets import Dataset
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from stapo.verifier_service.clients.adapters import make_trl_reward

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=len(TOK),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=4096,
        pad_token_id=TOK.pad_token_id,
        eos_token_id=TOK.eos_token_id,
    )
    ds = Dataset.from_list([{"prompt": PROMPT, "answer": "1"}] * 2)
    return GRPOTrainer(
        model=Qwen2ForCausalLM(cfg),
        reward_funcs=[make_trl_reward("answer")],
        args=GRPOConfig(
            output_dir=os.path.join(WORK, "out"),
            per_device_train_batch_size=2,
            num_generations=2,
            max_completion_length=8,
            report_to=[],
            use_cpu=True,
            logging_steps=1,
        ),
        train_dataset=ds,
        processing_class=TOK,
    )


def rewards(tr, conversational: bool = False) -> list[float | None] | str:
    from stapo.verifier_service.clients.client import VerifierRequestError, VerifierUnavailable

    if conversational:
        prompts = [[{"role": "user", "content": "Solve it."}] for _ in CASES]
        completions = [[{"role": "assistant", "content": c.response}] for c in CASES]
    else:
        prompts = [PROMPT for _ in CASES]
        completions = [c.response for c in CASES]
    inputs = [{"prompt": p, "answer": c.gold} for p, c in zip(prompts, CASES, strict=True)]
    ids = [TOK(c.response, add_special_tokens=False)["input_ids"] for c in CASES]
    try:
        out = tr._calculate_rewards(inputs, prompts, completions, ids)
    except (VerifierUnavailable, VerifierRequestError) as err:
        return f"raises {type(err).__name__}"
    return [None if math.isnan(x) else x for x in out[:, 0].tolist()]


def unguarded_script() -> str:
    """A TRL-style script with no ``if __name__ == "__main__":`` that grades in-process: the pool's
    workers would import it again; the pool must refuse in the caller, naming the guard, before any
    worker starts (the script's body runs once)."""
    import subprocess

    script = os.path.join(WORK, "unguarded.py")
    with open(script, "w") as f:
        f.write(
            "print('body')\n"
            "from stapo.verifier_service.clients.adapters import make_trl_reward\n"
            "fn = make_trl_reward('answer')\n"
            "print(fn(['p'], ['so \\\\boxed{\\\\frac{3\\\\sqrt{2}}{4}}'], answer=['\\\\frac{\\\\sqrt{18}}{4}']))\n"
        )
    env = {k: v for k, v in os.environ.items() if not k.startswith("STAPO_VERIFIER_")}
    env["STAPO_VERIFIER_WORKERS"] = "1"
    out = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=300, cwd=WORK)
    if out.returncode == 0:
        return "ran"
    refused = "outside `if __name__ == '__main__':`" in out.stderr and out.stdout.count("body") == 1
    return "refused naming the guard, body run once" if refused else out.stderr[-200:]


if __name__ == "__main__":
    url, token, dead = A["url"], A["token"], A["dead_url"]
    tr = trainer()
    want = expected(failure=None)  # TRL: None for an item that could not be graded (NaN in the tensor)

    env_for(url, token)
    emit("make_trl_reward, service", rewards(tr), want)
    emit("make_trl_reward, service, conversational", rewards(tr, conversational=True), want)
    env_for(url, "wrong-token")
    emit("make_trl_reward, wrong token", rewards(tr), "raises VerifierRequestError")
    env_for(dead, token)
    emit("make_trl_reward, service down", rewards(tr), "raises VerifierUnavailable")
    env_for(None, None)
    emit("make_trl_reward, in-process pool", rewards(tr), want)
    emit("in-process pool from a script without a main guard", unguarded_script(),
         "refused naming the guard, body run once")
