"""Items whose rewards are known, and the small things every driver needs (runs in each framework's venv).

Only the standard library, ``transformers``/``tokenizers`` (every framework here has them) and
stapo are imported, so a driver can run in any of the matrix's environments.
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass
from typing import Any

# The service and the in-process routes run with this prediction limit (STAPO_VERIFIER_MAX_PREDICTION_CHARS),
# so the too-long item is cheap to build and tokenize.
MAX_PREDICTION_CHARS = 2000
# verl and OpenRLHF need a number for an item that could not be graded: the failure value is set to
# -1 (STAPO_VERIFIER_FAILURE_SCORE), so it cannot be mistaken for a wrong answer (0) or a right one (1).
FAILURE = -1.0

PROMPT = "<|im_start|>user\nSolve it and put the answer in \\boxed{}.<|im_end|>\n<|im_start|>assistant\n"
EOT = "<|im_end|>"


@dataclass(frozen=True)
class Case:
    name: str
    response: str  # what the model wrote (an end-of-turn token where the model would emit one)
    gold: Any  # as a data set stores it: str, or int (verl parquet, JSON)
    correct: bool | None  # None: the item cannot be graded (too long)


CASES = (
    Case("fraction", "3 of 4 parts: \\boxed{\\frac{3}{4}}" + EOT, "0.75", True),
    Case("root", "so $x = \\boxed{2\\sqrt{2}}$" + EOT, "\\sqrt{8}", True),
    Case("tuple", "The point is \\boxed{(1, -2)}" + EOT, "(1,-2)", True),
    Case("end-of-turn", "The answer is \\boxed{5}." + EOT, "5", True),
    Case("integer gold", "Total: \\boxed{12}" + EOT, 12, True),
    Case("wrong", "I get \\boxed{7}" + EOT, "8", False),
    Case("wrong fraction", "so \\boxed{\\frac{1}{3}}" + EOT, "0.5", False),
    Case("too long", "x" * (MAX_PREDICTION_CHARS + 100) + " \\boxed{4}" + EOT, "4", None),
)


def expected(failure: float | None = FAILURE) -> list[float | None]:
    """The rewards of CASES: 1 / 0, and ``failure`` for the item that cannot be graded."""
    return [failure if c.correct is None else float(c.correct) for c in CASES]


def tiny_tokenizer(save_dir: str | None = None):
    """A byte-level BPE tokenizer built here (no hub): decodes any text back exactly, with the
    chat-template special tokens of Qwen-style models (``<|im_end|>`` is the end-of-turn / EOS token)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([PROMPT, *(c.response for c in CASES[:-1])], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=specials,
    )
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    if save_dir:
        fast.save_pretrained(save_dir)
    return fast


def show(x: Any) -> Any:
    """JSON-safe rewards: NaN (TRL's "no reward") becomes None, floats are rounded."""
    if isinstance(x, float):
        return None if math.isnan(x) else round(x, 4)
    if isinstance(x, (list, tuple)):
        return [show(v) for v in x]
    return x


def emit(route: str, rewards: Any, want: Any, note: str = "") -> None:
    """One row of the matrix, as a JSON line on stdout (the runner reads these)."""
    row = {"route": route, "rewards": show(rewards), "expected": show(want), "note": note}
    print("MATRIX " + json.dumps(row), flush=True)
    print(f"[row] {route}: {row['rewards']} (expected {row['expected']})", file=sys.stderr, flush=True)


def error_name(fn, *args, **kwargs) -> str:
    """Run ``fn``; the name of the exception it raised, or 'no error'."""
    try:
        fn(*args, **kwargs)
    except Exception as err:  # noqa: BLE001 - the name is the result
        return f"raises {type(err).__name__}"
    return "no error"


def env_for(url: str | None, token: str | None) -> None:
    """Point the adapters at ``url`` (None: in-process) with ``token``, in this process."""
    for k, v in (("STAPO_VERIFIER_URL", url), ("STAPO_VERIFIER_TOKEN", token)):
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    from stapo.verifier_service.clients import adapters

    adapters.close_verifiers()


def args() -> dict:
    """The runner passes its settings as one JSON argument."""
    return json.loads(sys.argv[1])
