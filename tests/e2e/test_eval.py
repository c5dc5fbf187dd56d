"""`stapo eval` end to end: a tiny random model through the CLI, and the scoring / resume paths.

What can fail here: the CLI must write results.json / samples.jsonl / eval_state.json with the
right counts; a known-good response must score 1 through the real grader; an interrupted eval must
resume without regenerating finished problems (engine calls are counted), drop a torn last line,
and refuse to mix samples of a different protocol; ``--model`` must resolve run dirs and checkpoints.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stapo.core.config import RewardConfig
from stapo.core.rollout import Completion, SamplingParams
from stapo.core.task.rewards import RewardFunction
from stapo.evals.runner import (
    EvalStateError,
    ModelSource,
    build_protocol,
    load_checkpoint_weights,
    read_samples,
    resolve_model,
    run_eval,
)
from stapo.verifier_service.grader import answers_equivalent, grade

# Four problems with known answers; the stand-in engine answers each with a scripted list.
PROBLEMS = [
    {"id": "p0", "problem": "What is 1/2 as a decimal?", "answer": "0.5"},
    {"id": "p1", "problem": "What is 2 + 3?", "answer": "5"},
    {"id": "p2", "problem": "What is 10 * 10?", "answer": "100"},
    {"id": "p3", "problem": "What is 7 - 9?", "answer": "-2"},
]
SCRIPT = {  # problem text -> the 4 responses the stand-in engine returns (k = 4)
    "What is 1/2 as a decimal?": [
        "So the answer is \\boxed{\\frac{1}{2}}.", "The answer is \\boxed{0.5}", "\\boxed{2}", ""],
    "What is 2 + 3?": ["\\boxed{5}", "\\boxed{5}", "\\boxed{5}", "\\boxed{5}"],
    "What is 10 * 10?": ["\\boxed{1000}", "\\boxed{1000}", "\\boxed{100}", "\\boxed{20}"],
    "What is 7 - 9?": ["\\boxed{2}", "\\boxed{3}", "\\boxed{4}", "\\boxed{16}"],
}
# By hand: correct counts 2, 4, 1, 0 of 4 -> avg@4 = (0.5 + 1 + 0.25 + 0) / 4 = 0.4375; pass@4 = 3/4;
# maj@4: p0 {1/2, 0.5} x2 is the majority -> right; p1 right; p2 "1000" x2 wins -> wrong; p3 wrong -> 2/4.


def encode(text: str) -> list[int]:
    """A stand-in tokenizer: code points (the engine decodes them back to find the problem)."""
    return [ord(c) for c in text]


class ScriptedStandInEngine:
    """A stand-in for a rollout engine (NOT a model): returns the scripted responses of each problem.

    Counts prompts and calls so tests can check that a resumed eval regenerates nothing finished;
    ``fail_after`` raises KeyboardInterrupt on that call, like a user hitting Ctrl-C mid-eval.
    """

    def __init__(self, fail_after: int | None = None) -> None:
        self.calls = 0
        self.prompts: list[str] = []
        self.fail_after = fail_after

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingParams) -> list[list[Completion]]:
        assert isinstance(sampling, SamplingParams) and (sampling.temperature, sampling.top_p) == (0.7, 0.9)
        self.calls += 1
        if self.fail_after is not None and self.calls > self.fail_after:
            raise KeyboardInterrupt
        out = []
        for ids in prompt_token_ids:
            text = "".join(map(chr, ids))
            self.prompts.append(text)
            responses = SCRIPT[text][: sampling.n]
            out.append([Completion(list(range(len(r))), [0.0] * len(r), "stop", r) for r in responses])
        return out


class InProcessGrader:
    """The real grader called in this process (the pool's worker processes would cost seconds to start)."""

    def grade_many(self, items: list[dict[str, str]]) -> list:
        return [grade(it["prediction"], it["gold"], it["mode"]) for it in items]


@pytest.fixture
def bench(tmp_path: Path) -> Path:
    f = tmp_path / "known.jsonl"
    f.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS))
    return f


def _protocol(bench: Path, k: int = 4):
    return build_protocol(model="stand-in", benchmarks=[f"custom:{bench}"], k=k, preset="t0.7", max_new_tokens=32,
                          template="none", chat_template=False)


def _run(bench: Path, out: Path, engine: ScriptedStandInEngine, k: int = 4) -> dict:
    return run_eval(engine=engine, reward_fn=RewardFunction(RewardConfig(), grader=InProcessGrader()),
                    encode=encode, protocol=_protocol(bench, k), out_dir=out, equivalent=answers_equivalent,
                    problems_per_call=1, progress=False)


def test_scoring_path_counts_known_answers(bench: Path, tmp_path: Path) -> None:
    res = _run(bench, tmp_path / "out", ScriptedStandInEngine())
    m = res["benchmarks"]["known"]
    assert m["avg@4"] == pytest.approx(0.4375)
    assert m["pass@4"] == pytest.approx(0.75)
    assert m["maj@4"] == pytest.approx(0.5)
    assert m["n"] == 4 and m["samples"] == 16 and m["no_answer"] == 1
    rows = read_samples(tmp_path / "out" / "samples.jsonl")
    assert len(rows) == 16
    by = {(r["problem_id"], r["sample"]): r for r in rows}
    assert by[("p0", 0)]["correct"] is True and by[("p0", 0)]["extracted"] == "\\frac{1}{2}"
    assert by[("p0", 3)]["status"] == "no_answer" and by[("p0", 3)]["correct"] is False
    assert by[("p2", 2)]["correct"] is True and by[("p2", 0)]["correct"] is False
    assert set(rows[0]) >= {"benchmark", "problem_id", "sample", "response", "extracted", "correct", "status", "tokens"}
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["benchmarks"]["known"]["avg@4"] == pytest.approx(0.4375) and saved["model"] == "stand-in"


def test_resume_skips_finished_problems(bench: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        _run(bench, out, ScriptedStandInEngine(fail_after=2))  # p0 and p1 finish, then Ctrl-C
    assert len(read_samples(out / "samples.jsonl")) == 8
    with (out / "samples.jsonl").open("a") as fh:  # a kill mid-write leaves a torn line
        fh.write('{"benchmark": "known", "problem_id": "p2", "sam')
    engine = ScriptedStandInEngine()
    res = _run(bench, out, engine)
    assert engine.prompts == [PROBLEMS[2]["problem"], PROBLEMS[3]["problem"]]  # only the unfinished ones
    rows = read_samples(out / "samples.jsonl")
    assert len(rows) == 16 and len({(r["problem_id"], r["sample"]) for r in rows}) == 16
    assert res["benchmarks"]["known"]["avg@4"] == pytest.approx(0.4375)
    # A finished eval regenerates nothing.
    again = ScriptedStandInEngine()
    _run(bench, out, again)
    assert again.calls == 0
    # Another k in the same dir would mix protocols: refused.
    with pytest.raises(EvalStateError, match="k"):
        _run(bench, out, ScriptedStandInEngine(), k=2)


def test_resolve_model(tmp_path: Path) -> None:
    assert resolve_model("tiny-random") == ModelSource("tiny-random", "tiny-random")
    run = tmp_path / "run"
    (run / "checkpoints" / "step_000004" / "model").mkdir(parents=True)
    (run / "checkpoints" / "step_000004" / "model" / "config.json").write_text("{}")
    (run / "checkpoints" / "step_000010" / "trainer").mkdir(parents=True)
    (run / "checkpoints" / "step_000010" / "trainer" / "trainer_state.pt").write_bytes(b"")
    (run / "checkpoints" / "step_000010" / "config.yaml").write_text("model: {name_or_path: tiny-random}\n")
    (run / "metrics.jsonl").write_text("")
    newest = resolve_model(str(run))  # no final/: the newest checkpoint, a torch trainer state
    assert newest.name_or_path == "tiny-random" and newest.label == str(run / "checkpoints" / "step_000010")
    assert newest.state_file == run / "checkpoints" / "step_000010" / "trainer" / "trainer_state.pt"
    assert resolve_model(str(run), step=4).name_or_path == str(run / "checkpoints" / "step_000004" / "model")
    (run / "final").mkdir()
    (run / "final" / "config.json").write_text("{}")
    assert resolve_model(str(run)) == ModelSource(str(run / "final"), str(run / "final"))
    with pytest.raises(FileNotFoundError, match="step_000004, step_000010"):
        resolve_model(str(run), step=7)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model(str(tmp_path / "nope"))


def test_checkpoint_weights_are_the_ones_evaluated(tmp_path: Path) -> None:
    """A torch trainer checkpoint (no HF export) is loaded as base model + its saved weights."""
    import torch

    from stapo.core.config import ModelConfig
    from stapo.core.trainer.models import load_policy

    mcfg = ModelConfig(name_or_path="tiny-random")
    trained, _ = load_policy(mcfg, device="cpu")
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.5)  # "training" moved every weight
    ck = tmp_path / "run" / "checkpoints" / "step_000003"
    (ck / "trainer").mkdir(parents=True)
    torch.save({"model": trained.state_dict(), "optimizer": {}}, ck / "trainer" / "trainer_state.pt")
    (ck / "config.yaml").write_text("model: {name_or_path: tiny-random}\n")
    src = resolve_model(str(tmp_path / "run"))
    fresh, _ = load_policy(ModelConfig(**src.model_config), device="cpu")
    load_checkpoint_weights(fresh, src.state_file)
    for (name, a), b in zip(fresh.state_dict().items(), trained.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_tiny_random_eval_through_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real path: tiny random model, hf engine, grader pool, 4 GSM8K problems x k=2 (accuracy ~0),
    with no data flag: the benchmark is the copy shipped with stapo."""
    monkeypatch.delenv("STAPO_DATA_DIR", raising=False)
    from typer.testing import CliRunner

    from stapo.cli.main import app

    out = tmp_path / "ev"
    args = ["eval", "--model", "tiny-random", "--benchmarks", "gsm8k", "--k", "2", "--limit", "4",
            "--max-new-tokens", "8", "--out", str(out), "--no-progress",
            "--set", "trainer.device=cpu", "--set", "reward.workers=1"]
    res = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "gsm8k" in res.output and "avg@k" in res.output
    assert "sampling: max_new_tokens 8, temperature 0.7, top-p 0.9 (preset t0.7), k 2" in res.output
    assert "hit cap %" in res.output and "(max_new_tokens 8)" in res.output
    results = json.loads((out / "results.json").read_text())
    m = results["benchmarks"]["gsm8k"]
    capped = sum(r["finish_reason"] == "length" for r in read_samples(out / "samples.jsonl")) / 8
    assert m["truncated"] == capped and results["protocol"]["max_new_tokens"] == 8
    assert (f"{100 * capped:.0f}% of gsm8k's samples stopped at max_new_tokens=8" in res.output) == (capped > 0.1)
    assert m["n"] == 4 and m["samples"] == 8 and m["k"] == 2
    assert {"avg@2", "pass@2", "maj@2"} <= set(m) and 0.0 <= m["avg@2"] <= m["pass@2"] <= 1.0
    assert results["model"] == "tiny-random" and results["protocol"]["temperature"] == 0.7
    assert results["config"]["model"]["name_or_path"] == "tiny-random"
    rows = read_samples(out / "samples.jsonl")
    assert len(rows) == 8 and [r["problem_id"] for r in rows[::2]] == ["0", "1", "2", "3"]
    assert all(1 <= r["tokens"] <= 8 and r["status"] in ("ok", "no_answer") for r in rows)
    assert json.loads((out / "eval_state.json").read_text())["k"] == {"gsm8k": 2}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--benchmarks", "aime2024"], "valid names: aime24"),
        (["--benchmarks", "gsm8k", "--data-dir", "/nonexistent"], "STAPO_DATA_DIR"),
        (["--benchmarks", "gsm8k", "--preset", "t0.5"], "eval.preset"),
        (["--model", "./no/such/model"], "does not exist"),
        (["--model", "tiny-random", "--set", "rollout.engine=vllm"], "install stapo[vllm] or --set rollout.engine=hf"),
        (["--model", "tiny-random", "--set", "trainer.device=cuda:3"], "trainer.device"),
        (["--model", "tiny-random", "--benchmarks", "gsm8k"],
         "holds samples of a different eval protocol (model: 'runs/other/final' there, 'tiny-random' now)"),
    ],
)
def test_eval_cli_errors_before_loading_a_model(tmp_path: Path, args: list[str], message: str) -> None:
    from typer.testing import CliRunner

    from stapo.cli.common import CLIError
    from stapo.cli.main import app

    (tmp_path / "o").mkdir()  # an --out dir of another model's eval (read before any model loads)
    (tmp_path / "o" / "eval_state.json").write_text(json.dumps({"model": "runs/other/final", "k": {"gsm8k": 4}}))
    res = CliRunner().invoke(app, ["eval", "--out", str(tmp_path / "o"), "--no-progress", *args])
    assert isinstance(res.exception, CLIError), res.output
    assert message in str(res.exception)
    assert not (tmp_path / "o" / "samples.jsonl").exists()
