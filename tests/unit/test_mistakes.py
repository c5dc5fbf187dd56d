"""The mistakes a user makes, walked through the real command line: each is answered with one
`error:` line naming the fix (exit status 2), before any model loads, worker pool starts or run dir
is written, and none is called "unexpected" (that word is kept for stapo's own bugs).

The list is the one README.md, docs/architecture.md ("A resume keeps the record"), docs/evaluation.md
and docs/verifier.md describe: a typo'd preset, a model path that does not exist, a --set of an
unknown key or of a list without brackets, a recipe's name on another method, a resume that changes
how the run trains, an engine that is not installed, a GPU that is not there, an eval --out dir of
another model, a busy port for the verifier.
"""

from __future__ import annotations

import importlib.util
import json
import socket
from pathlib import Path

import pytest
import torch

from stapo.configs import preset_path
from stapo.core.config import load_config, save_config

NO_GPU = not torch.cuda.is_available()
NO_VLLM = importlib.util.find_spec("vllm") is None


def _run_dir_with_checkpoint(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    (run / "checkpoints" / "step_000002").mkdir(parents=True)
    (run / "checkpoints" / "step_000002" / "meta.json").write_text(json.dumps({"step": 2, "extra": {}}))
    save_config(load_config(preset_path("tiny")), run / "config.yaml")
    return run


def _eval_out_of_another_model(tmp_path: Path) -> Path:
    out = tmp_path / "ev"
    out.mkdir()
    (out / "eval_state.json").write_text(json.dumps({"model": "runs/other/final", "k": {"gsm8k": 4}}))
    return out


# (name, argv builder, fragment of the one error line); {tmp}, {run}, {out} are filled in per test
MISTAKES = [
    ("typo'd preset", ["train", "--config", "tinyy"], "config 'tinyy' is neither a file nor a preset; presets:"),
    ("missing model", ["train", "--config", "tiny", "--set", "model.name_or_path=/no/such/model"],
     "model.name_or_path: /no/such/model does not exist; give a model folder"),
    ("unknown key", ["train", "--config", "tiny", "--set", "trainer.step=3"],
     "--set trainer.step: unknown field 'step' in trainer; allowed:"),
    ("a list without brackets", ["train", "--config", "tiny", "--set", "eval.benchmarks=gsm8k,math500"],
     "a list on the command line: --set eval.benchmarks=[a,b]"),
    ("a recipe's name on another method", ["train", "--config", "tiny", "--set", "algorithm.name=grpo"],
     "`--recipe grpo` runs the grpo recipe's method"),
    ("a resume that changes the lr", ["train", "--run-dir", "{run}", "--resume", "--set", "trainer.lr=0.5"],
     "trainer.lr 0.001 -> 0.5. Add --allow-changes"),
    ("eval into another model's --out", ["eval", "--model", "tiny-random", "--benchmarks", "gsm8k", "--out", "{out}"],
     "holds samples of a different eval protocol (model: 'runs/other/final' there, 'tiny-random' now); use "
     "another --out dir"),
    pytest.param("vllm not installed (train)", ["train", "--config", "tiny", "--set", "rollout.engine=vllm"],
                 "install stapo[vllm] or --set rollout.engine=hf",
                 marks=pytest.mark.skipif(not NO_VLLM, reason="vllm is installed here")),
    pytest.param("vllm not installed (eval)", ["eval", "--model", "tiny-random", "--set", "rollout.engine=vllm",
                                               "--out", "{tmp}/e2"],
                 "install stapo[vllm] or --set rollout.engine=hf",
                 marks=pytest.mark.skipif(not NO_VLLM, reason="vllm is installed here")),
    pytest.param("no GPU (train)", ["train", "--config", "tiny", "--set", "trainer.device=cuda"],
                 "trainer.device is 'cuda' but CUDA is not available here; use `cpu` or `auto`",
                 marks=pytest.mark.skipif(not NO_GPU, reason="a GPU is here")),
    pytest.param("no GPU (eval)", ["eval", "--model", "tiny-random", "--set", "trainer.device=cuda",
                                   "--out", "{tmp}/e3"],
                 "trainer.device is 'cuda' but CUDA is not available here",
                 marks=pytest.mark.skipif(not NO_GPU, reason="a GPU is here")),
    pytest.param("wandb not installed", ["train", "--config", "tiny", "--set", "logging.wandb=true"],
                 "logging.wandb=true needs wandb, which is not installed: `pip install wandb`",
                 marks=pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is here")),
    pytest.param("deepspeed not installed", ["train", "--config", "tiny", "--set", "trainer.backend=deepspeed"],
                 "trainer.backend=deepspeed needs deepspeed, which is not installed: install stapo[train]",
                 marks=pytest.mark.skipif(importlib.util.find_spec("deepspeed") is not None, reason="deepspeed is here")),
    ("verifier on a busy port", ["verifier", "serve", "--port", "{port}", "--workers", "1"],
     "(another process listens there); pick another --port (STAPO_VERIFIER_PORT)"),
]


@pytest.mark.parametrize(("name", "argv", "fragment"), MISTAKES, ids=lambda v: v if isinstance(v, str) else None)
def test_a_mistake_is_one_line_naming_the_fix_before_anything_heavy(name, argv, fragment, tmp_path, stapo_main,
                                                                    monkeypatch):
    import stapo.cli.train as cli_train
    import stapo.core.trainer.models as models

    def heavy(*_a, **_k):
        raise AssertionError(f"{name}: a model loaded before the mistake was caught")

    monkeypatch.setattr(models, "load_policy", heavy)
    monkeypatch.setattr(cli_train, "run_training", heavy)
    monkeypatch.chdir(tmp_path)  # a default run dir would land here
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        fill = {"tmp": str(tmp_path), "port": str(busy.getsockname()[1])}
        if "{run}" in " ".join(argv):
            fill["run"] = str(_run_dir_with_checkpoint(tmp_path))
        if "{out}" in " ".join(argv):
            fill["out"] = str(_eval_out_of_another_model(tmp_path))
        before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
        code, out, err = stapo_main(*[a.format(**fill) for a in argv])
    lines = [line for line in err.strip().splitlines() if not line.startswith("  ")]  # a config error's indented causes
    assert code == 2, (name, err)
    assert len(lines) == 1 and lines[0].startswith("error: "), (name, err)
    assert fragment in err, (name, err)
    assert "unexpected" not in err + out
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing written


def test_verifier_help_shows_the_size_limits_the_service_applies(stapo_main):
    """`stapo verifier serve --help` states each size limit's default, the one Settings applies."""
    from stapo.verifier_service.settings import Settings

    code, out, _err = stapo_main("verifier", "serve", "--help")
    assert code == 0
    text = " ".join(out.split())
    for field, shown in (("max_items", "default 4096"), ("max_prediction_chars", "default 100000 characters"),
                         ("max_gold_chars", "default 10000 characters"), ("max_body_bytes", "default 16777216")):
        assert shown in text, field
        assert shown.split()[1] == str(Settings.model_fields[field].default), field


def test_a_missing_deepspeed_is_named_even_where_it_is_installed(monkeypatch):
    """The same check with DeepSpeed hidden (it is installed on the project's machines)."""
    from stapo.cli.common import JobError, check_engine_and_device

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    cfg = load_config(preset_path("tiny"), ["trainer.backend=deepspeed"])
    with pytest.raises(JobError, match=r"^trainer\.backend=deepspeed needs deepspeed, which is not installed: install "
                                       r"stapo\[train\] or --set trainer\.backend=torch$"):
        check_engine_and_device(cfg, {})
