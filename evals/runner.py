"""The evaluation runner behind `stapo eval`: sample k responses per problem, grade, score, resume.

One pass, per benchmark: template each problem (``data.template``, the same templates training
uses), sample ``k`` responses per problem with the rollout engine (``hf`` or ``vllm``), grade them
with the reward function (local grader pool or remote verifier, with retries), append the problem's
``k`` graded samples to ``samples.jsonl`` as soon as they are done, then score the benchmark
(avg@k, unbiased pass@k, maj@k; see :mod:`stapo.evals.metrics`) into ``results.json``.

Resume: ``samples.jsonl`` is the state. A problem counts as done when the file holds all its ``k``
samples; on restart those problems are skipped and only the rest is generated. The protocol
(model, k per benchmark, sampling, template, max tokens) is pinned in ``eval_state.json``: resuming
with a different protocol is an error, since mixing samples would make the numbers meaningless.
A torn last line (a kill mid-write) and partial problems are dropped and redone.

Sampling presets (the paper's two settings): ``t1.0`` = temperature 1.0 / top-p 1.0 and ``t0.7`` =
temperature 0.7 / top-p 0.9.

The runner takes its engine, grader and prompt encoder as arguments, so tests can drive it with a
stand-in engine; :func:`evaluate` is the one call that builds the real ones from a config.
"""

from __future__ import annotations

import json
import os
import time
import zlib
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from stapo.core.tracking import read_jsonl
from stapo.evals.benchmarks import EvalProblem, default_k, load_benchmark, parse_benchmark_arg
from stapo.evals.metrics import SampleScore, macro_average, summarize_benchmark

__all__ = [
    "PRESETS",
    "EvalProtocol",
    "EvalStateError",
    "build_protocol",
    "run_eval",
    "evaluate",
    "ModelSource",
    "resolve_model",
    "load_checkpoint_weights",
    "read_samples",
    "results_table",
    "check_out_dir",
    "cap_warnings",
    "header",
    "CAP_WARN_SHARE",
]

PRESETS: dict[str, tuple[float, float]] = {"t1.0": (1.0, 1.0), "t0.7": (0.7, 0.9)}
"""Sampling presets of the paper: name -> (temperature, top_p)."""

CAP_WARN_SHARE = 0.1
"""Above this share of a benchmark's samples stopped at ``max_new_tokens``, the eval warns: its
scores count answers the cap cut off as wrong."""

SAMPLES_FILE = "samples.jsonl"
RESULTS_FILE = "results.json"
STATE_FILE = "eval_state.json"


class EvalStateError(RuntimeError):
    """The output dir holds samples from a different protocol: resuming would mix them."""


@dataclass(frozen=True)
class EvalProtocol:
    """Everything that decides what a sample means; pinned in ``eval_state.json`` for resume."""

    model: str
    benchmarks: tuple[str, ...]  # as given (names or custom:PATH specs)
    k: dict[str, int]  # benchmark name -> samples per problem
    preset: str
    temperature: float
    top_p: float
    max_new_tokens: int
    template: str
    chat_template: bool
    grader_mode: str
    seed: int
    limit: int | None = None
    data_dir: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def pinned(self) -> dict[str, Any]:
        """Fields that must match to resume (``limit`` may change: more problems can be added)."""
        d = asdict(self)
        for key in ("limit", "data_dir", "extra", "benchmarks"):
            d.pop(key)
        return d


def build_protocol(
    *,
    model: str,
    benchmarks: Sequence[str],
    k: int | None,
    preset: str,
    max_new_tokens: int,
    template: str,
    chat_template: bool,
    grader_mode: str = "math",
    seed: int = 0,
    limit: int | None = None,
    data_dir: str | None = None,
) -> EvalProtocol:
    """Validate the eval options into a protocol; ``k=None`` uses each benchmark's default."""
    if preset not in PRESETS:
        raise ValueError(f"eval.preset: unknown preset {preset!r}; valid: {', '.join(PRESETS)}")
    if k is not None and k < 1:
        raise ValueError(f"eval.k: must be >= 1, got {k}")
    if not benchmarks:
        raise ValueError("eval.benchmarks: no benchmarks given")
    names: dict[str, int] = {}
    for arg in benchmarks:
        name, _, _ = parse_benchmark_arg(arg)
        if name in names:
            raise ValueError(f"eval.benchmarks: {name!r} given twice")
        names[name] = k if k is not None else default_k(name)
    temperature, top_p = PRESETS[preset]
    return EvalProtocol(
        model=model,
        benchmarks=tuple(benchmarks),
        k=names,
        preset=preset,
        temperature=temperature,
        top_p=top_p,
        max_new_tokens=max_new_tokens,
        template=template,
        chat_template=chat_template,
        grader_mode=grader_mode,
        seed=seed,
        limit=limit,
        data_dir=data_dir,
    )


# ----------------------------------------------------------------------------- samples file


def read_samples(path: Path) -> list[dict[str, Any]]:
    """Rows of ``samples.jsonl``; a torn last line (kill mid-write) is ignored."""
    return read_jsonl(path)


def _load_done(out_dir: Path, protocol: EvalProtocol) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """Complete problems already in ``samples.jsonl``; rewrites the file without torn/partial entries."""
    path = out_dir / SAMPLES_FILE
    rows = read_samples(path)
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[(r["benchmark"], str(r["problem_id"]))].append(r)
    done: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for key, samples in groups.items():
        k = protocol.k.get(key[0])
        idx = sorted(int(s["sample"]) for s in samples)
        if k is not None and idx == list(range(k)):
            done[key] = sorted(samples, key=lambda s: int(s["sample"]))
        elif k is None:
            done[key] = samples  # another benchmark's rows: keep them untouched
    kept = [s for samples in done.values() for s in samples]
    if path.exists() and len(kept) != len(path.read_text(encoding="utf-8").splitlines()):
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(s, ensure_ascii=False) + "\n" for s in kept), encoding="utf-8")
        os.replace(tmp, path)
    return done


def check_out_dir(out_dir: Path, protocol: EvalProtocol) -> dict[str, Any]:
    """The pinned protocol ``out_dir`` goes on with (nothing written); :class:`EvalStateError` when
    it holds samples of another protocol (another model, k, sampling, cap...). `stapo eval` calls it
    before the model loads."""
    path = Path(out_dir) / STATE_FILE
    if not path.exists():
        return protocol.pinned()
    old = json.loads(path.read_text())
    old_k = old.get("k", {})
    new = protocol.pinned()
    for key, val in new.items():
        if key == "k":
            clash = {b: (old_k[b], v) for b, v in val.items() if b in old_k and old_k[b] != v}
            if clash:
                raise EvalStateError(_mismatch_msg(out_dir, "k", clash))
        elif key in old and old[key] != val:
            raise EvalStateError(_mismatch_msg(out_dir, key, (old[key], val)))
    return {**old, **new, "k": {**old_k, **protocol.k}}


def _check_state(out_dir: Path, protocol: EvalProtocol) -> None:
    (out_dir / STATE_FILE).write_text(json.dumps(check_out_dir(out_dir, protocol), indent=2))


def _mismatch_msg(out_dir: Path, key: str, what: Any) -> str:
    if isinstance(what, tuple) and len(what) == 2:
        what = f"{what[0]!r} there, {what[1]!r} now"
    return (
        f"{out_dir} holds samples of a different eval protocol ({key}: {what}); "
        "use another --out dir or delete it to start over"
    )


# ----------------------------------------------------------------------------- the loop


def run_eval(
    *,
    engine: Any,
    reward_fn: Callable[[Sequence[str], Sequence[str]], Any],
    encode: Callable[[str], list[int]],
    protocol: EvalProtocol,
    out_dir: Path,
    equivalent: Callable[[str, str], bool],
    problems_per_call: int = 8,
    config: dict[str, Any] | None = None,
    progress: bool = True,
    console: Any = None,
) -> dict[str, Any]:
    """Evaluate, resuming from ``out_dir``; returns (and writes) the ``results.json`` object.

    ``engine.generate(prompt_token_ids, SamplingParams)`` -> ``[prompt][sample] Completion``;
    ``reward_fn(responses, golds)`` -> an object with ``correct``, ``valid``, ``extracted`` lists
    (:class:`stapo.core.task.rewards.RewardFunction`); ``encode(problem_text)`` -> prompt token ids
    (template + chat template applied).
    """
    from stapo.core.rollout import SamplingParams  # light: dataclasses only

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _check_state(out_dir, protocol)
    done = _load_done(out_dir, protocol)
    all_problems: dict[str, list[EvalProblem]] = {}
    for arg in protocol.benchmarks:
        probs = load_benchmark(arg, data_dir=protocol.data_dir, limit=protocol.limit)
        all_problems[probs[0].benchmark] = probs
    todo = {b: [p for p in ps if (b, p.id) not in done] for b, ps in all_problems.items()}

    t0 = time.perf_counter()
    samples_path = out_dir / SAMPLES_FILE
    with _progress(progress, console) as prog, samples_path.open("a", encoding="utf-8") as fh:
        for bench, probs in all_problems.items():
            k = protocol.k[bench]
            task = prog.add_task(f"{bench} (k={k})", total=len(probs), completed=len(probs) - len(todo[bench]))
            sampling = SamplingParams(
                n=k,
                temperature=protocol.temperature,
                top_p=protocol.top_p,
                max_new_tokens=protocol.max_new_tokens,
            )
            pending = todo[bench]
            for start in range(0, len(pending), max(1, problems_per_call)):
                chunk = pending[start : start + max(1, problems_per_call)]
                seed = protocol.seed + zlib.crc32(f"{bench}/{chunk[0].id}".encode()) % (2**31)
                params = SamplingParams(**{**asdict(sampling), "seed": seed})
                completions = engine.generate([encode(p.problem) for p in chunk], params)  # [prompt][sample]
                if len(completions) != len(chunk) or any(len(c) != k for c in completions):
                    raise RuntimeError(
                        f"engine returned {[len(c) for c in completions]} samples for {len(chunk)} prompts, "
                        f"expected {k} each"
                    )
                texts = [c.text for cs in completions for c in cs]
                golds = [p.answer for p in chunk for _ in range(k)]
                graded = reward_fn(texts, golds)
                for i, prob in enumerate(chunk):
                    rows = []
                    for j, comp in enumerate(completions[i]):
                        g = i * k + j
                        valid = bool(graded.valid[g])
                        rows.append(
                            {
                                "benchmark": bench,
                                "problem_id": prob.id,
                                "sample": j,
                                "gold": prob.answer,
                                "response": comp.text,
                                "extracted": graded.extracted[g],
                                "correct": bool(graded.correct[g]) and valid,
                                "status": _status_of(graded, g, valid),
                                "tokens": len(comp.token_ids),
                                "finish_reason": comp.finish_reason,
                            }
                        )
                    # One write per finished problem: a kill leaves whole problems or a torn last line.
                    fh.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
                    fh.flush()
                    os.fsync(fh.fileno())
                    done[(bench, prob.id)] = rows
                    prog.advance(task)
    results = score(done, all_problems, protocol, equivalent=equivalent)
    results["warnings"] = cap_warnings(results)
    results["wall_s"] = time.perf_counter() - t0
    results["config"] = config or {}
    (out_dir / RESULTS_FILE).write_text(json.dumps(results, indent=2, ensure_ascii=False))
    return results


def _status_of(graded: Any, g: int, valid: bool) -> str:
    statuses = getattr(graded, "status", None)
    if statuses is not None:
        return str(statuses[g])
    if not valid:
        return "error"
    return "ok" if graded.extracted[g] is not None else "no_answer"


def score(
    done: dict[tuple[str, str], list[dict[str, Any]]],
    all_problems: dict[str, list[EvalProblem]],
    protocol: EvalProtocol,
    *,
    equivalent: Callable[[str, str], bool],
) -> dict[str, Any]:
    """The ``results.json`` object from graded samples of the problems in this eval."""
    benches: dict[str, dict[str, Any]] = {}
    for bench, probs in all_problems.items():
        k = protocol.k[bench]
        per = {
            p.id: [SampleScore(bool(s["correct"]), s.get("extracted")) for s in done[(bench, p.id)]] for p in probs
        }
        m = summarize_benchmark(per, k=k, equivalent=equivalent)
        rows = [s for p in probs for s in done[(bench, p.id)]]
        m["failed"] = sum(1 for s in rows if s["status"] in ("timeout", "error", "undecided"))
        m["no_answer"] = sum(1 for s in rows if s["status"] == "no_answer")
        m["mean_tokens"] = sum(s["tokens"] for s in rows) / len(rows)
        m["truncated"] = sum(1 for s in rows if s.get("finish_reason") == "length") / len(rows)
        m["k"] = k
        benches[bench] = m
    return {
        "benchmarks": benches,
        "macro": macro_average(benches),
        "model": protocol.model,
        "protocol": {
            "preset": protocol.preset,
            "temperature": protocol.temperature,
            "top_p": protocol.top_p,
            "max_new_tokens": protocol.max_new_tokens,
            "template": protocol.template,
            "chat_template": protocol.chat_template,
            "grader_mode": protocol.grader_mode,
            "seed": protocol.seed,
            "limit": protocol.limit,
            "k": dict(protocol.k),
        },
    }


def cap_warnings(results: dict[str, Any]) -> list[str]:
    """One line per benchmark whose share of samples stopped at the cap is above :data:`CAP_WARN_SHARE`."""
    cap = results["protocol"]["max_new_tokens"]
    return [
        f"{100 * m['truncated']:.0f}% of {name}'s samples stopped at max_new_tokens={cap} (warned above "
        f"{100 * CAP_WARN_SHARE:.0f}%): their answers may be cut off and count as wrong; raise --max-new-tokens "
        "(the paper evaluates at 20480)"
        for name, m in results["benchmarks"].items() if m.get("truncated", 0.0) > CAP_WARN_SHARE
    ]


def header(protocol: EvalProtocol) -> str:
    """How the eval samples, for the line `stapo eval` prints first: cap, temperature, top-p, k."""
    ks = sorted(set(protocol.k.values()))
    k = str(ks[0]) if len(ks) == 1 else ", ".join(f"{b} {v}" for b, v in protocol.k.items())
    return (f"max_new_tokens {protocol.max_new_tokens}, temperature {protocol.temperature:g}, "
            f"top-p {protocol.top_p:g} (preset {protocol.preset}), k {k}")


class _NullProgress:
    def __enter__(self) -> _NullProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def add_task(self, *args: Any, **kwargs: Any) -> int:
        return 0

    def advance(self, task: int) -> None:
        return None


def _progress(enabled: bool, console: Any) -> Any:
    if not enabled:
        return _NullProgress()
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    )


def results_table(results: dict[str, Any]) -> Any:
    """A rich table of ``results.json``: one row per benchmark plus the macro average."""
    from rich.table import Table

    cap = results.get("protocol", {}).get("max_new_tokens", "?")
    table = Table(title=f"stapo eval: {results.get('model', '?')} (max_new_tokens {cap})")
    for col in ("benchmark", "k", "n", "avg@k", "pass@k", "maj@k", "failed", "mean tokens", "hit cap %"):
        table.add_column(col, justify="left" if col == "benchmark" else "right")
    for name, m in results["benchmarks"].items():
        k = m["k"]
        table.add_row(
            name,
            str(k),
            str(m["n"]),
            f"{100 * m[f'avg@{k}']:.1f}",
            f"{100 * m[f'pass@{k}']:.1f}",
            f"{100 * m[f'maj@{k}']:.1f}",
            str(m.get("failed", 0)),
            f"{m.get('mean_tokens', 0):.0f}",
            f"{100 * m.get('truncated', 0.0):.1f}",
        )
    mac = results.get("macro")
    if mac and len(results["benchmarks"]) > 1:
        table.add_row(
            "[bold]macro avg", "", "", f"{100 * mac['avg']:.1f}", f"{100 * mac['pass']:.1f}", f"{100 * mac['maj']:.1f}",
            "", "", ""
        )
    return table


# ----------------------------------------------------------------------------- real engine + grader


@dataclass(frozen=True)
class ModelSource:
    """What ``--model`` resolved to.

    ``name_or_path`` is what ``load_policy`` (or vLLM) loads. A training checkpoint holds no HF
    export, only the trainer's state (``trainer/trainer_state.pt``, see ``core/train/checkpoint.py``):
    then ``name_or_path`` is the run's base model, ``model_config`` the ``model`` section of the
    checkpoint's ``config.yaml``, and the weights in ``state_file`` replace the loaded ones.
    """

    name_or_path: str
    label: str
    state_file: Path | None = None
    model_config: dict[str, Any] | None = None


_HF_SUBDIRS = ("", "model", "trainer/model", "hf")
_STATE = Path("trainer") / "trainer_state.pt"


def resolve_model(path: str, *, step: int | None = None) -> ModelSource:
    """Turn ``--model`` into a :class:`ModelSource`.

    Accepted: a special name (``tiny-random``, ``demo:...``), a hub id, a folder with ``config.json``
    (an HF export such as ``RUN/final``), a checkpoint folder (``RUN/checkpoints/step_N``: an HF model
    in ``model/`` or ``hf/`` when there is one, else the torch trainer state), or a run dir: its
    ``final/`` export, else its newest checkpoint; ``step`` picks ``checkpoints/step_N`` instead.
    """
    p = Path(path).expanduser()
    if not p.exists():
        if path.startswith((".", "/", "~")):
            raise FileNotFoundError(f"--model: {path} does not exist")
        return ModelSource(path, path)  # special name or hub id
    if not p.is_dir():
        raise ValueError(f"--model: {path} is a file; give a model folder, a checkpoint or a run dir")
    ckpt_root = p / "checkpoints"
    if step is not None:
        ck = ckpt_root / f"step_{step:06d}"
        if not ck.is_dir():
            avail = sorted(c.name for c in ckpt_root.glob("step_*")) if ckpt_root.is_dir() else []
            raise FileNotFoundError(f"--step {step}: no {ck}; available: {', '.join(avail) or 'none'}")
        p = ck
    elif (p / "metrics.jsonl").exists() or ckpt_root.is_dir() or (p / "final").is_dir():
        if (p / "final" / "config.json").is_file():
            p = p / "final"
        else:
            ckpts = sorted(
                (c for c in ckpt_root.glob("step_*") if c.is_dir() and not c.name.startswith(".")),
                key=lambda c: int(c.name.split("_")[-1]),
            )
            if not ckpts:
                raise FileNotFoundError(f"--model: run dir {path} has neither final/ nor checkpoints/step_*")
            p = ckpts[-1]
    for sub in _HF_SUBDIRS:
        cand = p / sub if sub else p
        if (cand / "config.json").is_file():
            return ModelSource(str(cand), str(cand))
    if (p / _STATE).is_file():
        cfg_file = next((c for c in (p / "config.yaml", p.parent.parent / "config.yaml") if c.is_file()), None)
        if cfg_file is None:
            raise FileNotFoundError(f"--model: checkpoint {p} has no config.yaml saying which base model it trains")
        import yaml

        model_cfg = (yaml.safe_load(cfg_file.read_text()) or {}).get("model") or {}
        base = model_cfg.get("name_or_path")
        if not base:
            raise ValueError(f"{cfg_file}: no model.name_or_path")
        return ModelSource(base, str(p), state_file=p / _STATE, model_config=model_cfg)
    raise FileNotFoundError(
        f"--model: no HF model (config.json) in {p} or its model/, trainer/model/, hf/ subfolders, and no "
        f"torch trainer state ({_STATE}); a DeepSpeed checkpoint must be exported to HF format first"
    )


def load_checkpoint_weights(model: Any, state_file: Path) -> None:
    """Copy the policy weights of a torch trainer checkpoint into ``model`` (strict: every key must match)."""
    import torch

    state = torch.load(state_file, map_location="cpu", weights_only=True)
    if "model" not in state:
        raise ValueError(f"{state_file}: no 'model' entry (keys: {', '.join(state)})")
    model.load_state_dict(state["model"], strict=True)


def evaluate(
    cfg: Any,
    *,
    out_dir: Path,
    model_path: str | None = None,
    step: int | None = None,
    data_dir: str | None = None,
    progress: bool = True,
    console: Any = None,
) -> dict[str, Any]:
    """Build the policy, engine and grader from ``cfg`` and run :func:`run_eval` (what `stapo eval` calls)."""
    from stapo.core.config import config_from_dict
    from stapo.core.rollout import build_rollout_engine
    from stapo.core.task.data import TEMPLATES, encode_prompt
    from stapo.core.task.rewards import RewardFunction
    from stapo.core.trainer.models import SPECIAL_MODELS, load_policy, resolve_device
    from stapo.verifier_service.grader import answers_equivalent

    source = resolve_model(model_path or cfg.model.name_or_path, step=step)
    model_section = cfg.model.model_dump()
    if source.model_config is not None:  # a checkpoint: its own model section (e.g. the tiny model's shape)
        model_section.update(source.model_config)
    model_section["name_or_path"] = source.name_or_path
    data = cfg.model_dump()
    data["model"] = model_section
    data["rollout"]["max_new_tokens"] = cfg.eval.max_new_tokens  # the engine's length (vLLM's context) is the eval's
    cfg = config_from_dict(data)
    ev = cfg.eval
    protocol = build_protocol(
        model=source.label,
        benchmarks=ev.benchmarks,
        k=ev.k,
        preset=ev.preset,
        max_new_tokens=ev.max_new_tokens,
        template=cfg.data.template,
        chat_template=cfg.data.chat_template,
        grader_mode=cfg.reward.mode,
        seed=cfg.trainer.seed,
        limit=ev.limit,
        data_dir=data_dir or cfg.data.data_dir,
    )
    for arg in protocol.benchmarks:  # fail on a missing file or bad field before any model loads
        load_benchmark(arg, data_dir=protocol.data_dir, limit=1)
    check_out_dir(Path(out_dir), protocol)  # an --out of another model or protocol, before the model loads
    if console is not None:
        console.print(f"sampling: {header(protocol)}")
    device = resolve_device(cfg.trainer.device)
    if cfg.rollout.engine == "vllm" and source.name_or_path not in SPECIAL_MODELS and source.state_file is None:
        # vLLM loads its own weights from the path: only the tokenizer is needed here.
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(
            cfg.model.tokenizer or source.name_or_path, trust_remote_code=cfg.model.trust_remote_code
        )
        engine = build_rollout_engine(cfg, tokenizer=tokenizer, model_path=source.name_or_path)
    else:
        model, tokenizer = load_policy(cfg.model, device=device)
        if source.state_file is not None:
            load_checkpoint_weights(model, source.state_file)
        model.eval()
        engine = build_rollout_engine(cfg, model=model, tokenizer=tokenizer)
        if cfg.rollout.engine == "vllm" and source.state_file is not None:
            # vLLM started from the base model: push the checkpoint's weights through the engine contract.
            engine.load_weights(model.named_parameters())
    template = TEMPLATES[cfg.data.template]

    def encode(problem: str) -> list[int]:
        return encode_prompt(tokenizer, template(problem), chat_template=cfg.data.chat_template)

    max_k = max(protocol.k.values())
    per_call = max(1, cfg.rollout.batch_size // max_k) if cfg.rollout.engine == "hf" else 64
    reward_fn = RewardFunction(cfg.reward)
    try:
        return run_eval(
            engine=engine,
            reward_fn=reward_fn,
            encode=encode,
            protocol=protocol,
            out_dir=out_dir,
            equivalent=answers_equivalent,
            problems_per_call=per_call,
            config=cfg.model_dump(mode="json"),
            progress=progress,
            console=console,
        )
    finally:
        reward_fn.close()
