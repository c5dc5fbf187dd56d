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
    ("typo'd preset", ["train", "--config", "tinyy"],
     "config 'tinyy' is neither a file nor a preset; did you mean tiny? presets:"),
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
    ("a misspelt recipe", ["train", "--config", "tiny", "--recipe", "stpo"],
     "recipe 'stpo' is neither a file nor a preset; did you mean stapo"),
    ("a malformed line in a data file", ["train", "--config", "tiny", "--set", "data.source={tmp}/bad.jsonl"],
     "bad.jsonl:3: not valid JSON"),
    ("a data file without the problem field", ["train", "--config", "tiny", "--set", "data.source={tmp}/q.jsonl"],
     "data.problem_field: field 'problem' not found in {tmp}/q.jsonl row 0; fields present: answer, question; "
     "--set data.problem_field=question names the one to read"),
]


def _data_files(tmp_path: Path) -> None:
    """A JSONL file whose third line is cut mid-object, and one that names its problem `question`."""
    rows = [json.dumps({"problem": f"{i} + 1", "answer": str(i + 1)}) for i in range(3)]
    (tmp_path / "bad.jsonl").write_text("\n".join([*rows[:2], rows[2][:-3], ""]))
    (tmp_path / "q.jsonl").write_text(json.dumps({"question": "1 + 1", "answer": "2"}) + "\n")


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
        _data_files(tmp_path)
        if "{run}" in " ".join(argv):
            fill["run"] = str(_run_dir_with_checkpoint(tmp_path))
        if "{out}" in " ".join(argv):
            fill["out"] = str(_eval_out_of_another_model(tmp_path))
        before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
        code, out, err = stapo_main(*[a.format(**fill) for a in argv])
    lines = [line for line in err.strip().splitlines() if not line.startswith("  ")]  # a config error's indented causes
    assert code == 2, (name, err)
    assert len(lines) == 1 and lines[0].startswith("error: "), (name, err)
    assert fragment.format(**fill) in " ".join(err.split()), (name, err)
    assert "unexpected" not in err + out
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing written


def test_verifier_help_shows_the_size_limits_the_service_applies(stapo_main):
    """`stapo verifier serve --help` states each size limit's default, the one Settings applies."""
    from stapo.verifier_service.server.settings import Settings

    code, out, _err = stapo_main("verifier", "serve", "--help")
    assert code == 0
    text = " ".join(out.split())
    for field, shown in (("max_items", "default 4096"), ("max_prediction_chars", "default 100000 characters"),
                         ("max_gold_chars", "default 10000 characters"), ("max_body_bytes", "default 16777216")):
        assert shown in text, field
        assert shown.split()[1] == str(Settings.model_fields[field].default), field


def test_a_missing_deepspeed_is_named_even_where_it_is_installed(monkeypatch):
    """The same check with DeepSpeed hidden (it is installed on the project's machines)."""
    from stapo.core.train.prepare import LaunchError, check_engine_and_device

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    cfg = load_config(preset_path("tiny"), ["trainer.backend=deepspeed"])
    with pytest.raises(LaunchError, match=r"^trainer\.backend=deepspeed needs deepspeed, which is not installed: install "
                                       r"stapo\[train\] or --set trainer\.backend=torch$"):
        check_engine_and_device(cfg, {})


def _hub_cache(root: Path, repo: str, files: tuple[str, ...]) -> Path:
    """A Hugging Face cache holding ``files`` of ``repo`` at revision main (the layout the hub client writes)."""
    folder = root / f"models--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text("abc123")
    for name in files:
        (folder / "snapshots" / "abc123").mkdir(parents=True, exist_ok=True)
        (folder / "snapshots" / "abc123" / name).write_text("{}")
    return root


def test_a_hub_id_without_a_hub_fails_at_once_and_a_cached_one_is_not_probed(monkeypatch, tmp_path):
    """Not cached: refused in one line when HF_HUB_OFFLINE is set or the hub does not answer (the
    probe's answer is stood in: this machine has no network); cached: accepted without a probe."""
    import time

    from huggingface_hub import constants

    import stapo.core.train.prepare as common

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(_hub_cache(tmp_path, "acme/cached", ("config.json",))))
    asked: list[str] = []
    monkeypatch.setattr(common, "hub_answers", lambda endpoint, timeout_s=5.0: asked.append(endpoint) or "ConnectError")
    cfg = load_config(preset_path("tiny"), ["model.name_or_path=acme/absent"])
    t0 = time.perf_counter()
    with pytest.raises(common.InputError) as err:
        common.check_inputs(cfg)
    assert time.perf_counter() - t0 < 2.0
    assert str(err.value) == (
        f"model.name_or_path: acme/absent is not a local folder and not in the Hugging Face cache ({tmp_path}), and "
        f"the hub ({constants.ENDPOINT}) cannot be reached (ConnectError, 5 s limit); download it where the hub is "
        "reachable (`hf download acme/absent`), give a model folder, or use tiny-random")
    assert asked == [constants.ENDPOINT]
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(common.InputError, match=r"acme/absent is not a local folder .*, and HF_HUB_OFFLINE is set; "):
        common.check_inputs(cfg)
    assert len(asked) == 1  # offline: no probe
    common.check_inputs(load_config(preset_path("tiny"), ["model.name_or_path=acme/cached"]))  # loads offline
    with pytest.raises(common.InputError, match=r"^model\.tokenizer: acme/cached-tok is not a local folder"):
        common.check_inputs(load_config(preset_path("tiny"), ["model.name_or_path=acme/cached",
                                                              "model.tokenizer=acme/cached-tok"]))
    assert len(asked) == 1


def test_the_hub_probe_answers_for_a_server_and_names_a_dead_one(monkeypatch) -> None:
    """:func:`stapo.core.train.prepare.hub_answers` itself (the autouse stand-in replaces it elsewhere)."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    import stapo.core.train.prepare as common

    monkeypatch.undo()  # the real probe, not tests/conftest.py's stand-in

    class _Ok(BaseHTTPRequestHandler):
        def do_HEAD(self) -> None:  # noqa: N802 (http.server's name)
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), _Ok)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    try:
        assert common.hub_answers(f"http://127.0.0.1:{server.server_address[1]}", 5.0) is None
    finally:
        server.shutdown()
        server.server_close()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert common.hub_answers(f"http://127.0.0.1:{port}", 2.0) == "ConnectError"

