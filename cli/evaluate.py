"""`stapo eval`: sample k responses per benchmark problem, grade them, report avg@k, pass@k, maj@k.

    stapo eval --model runs/stapo --benchmarks aime24,amc23,math500 --out evals/stapo
    stapo eval --config tiny --benchmarks gsm8k --k 4 --limit 20 --out /tmp/ev
    stapo eval --model Qwen/Qwen3-1.7B-Base --set rollout.engine=vllm --preset t1.0 --template boxed \\
               --max-new-tokens 8192 --out evals/base
    stapo eval --model tiny-random --benchmarks "custom:my.jsonl#problem=question,answer=final" --out /tmp/c

Config: ``--config`` (a file or a preset name from configs/), else the run's own ``config.yaml`` when
``--model`` is a run dir or one of its checkpoints (so the prompt template matches training), else
the defaults; ``--set`` and the options below override it. The options are shorthands for
``eval.*``, ``data.*`` and ``rollout.*`` fields. The response cap is ``eval.max_new_tokens`` (the
paper's 20,480 unless the config's eval section says otherwise), never the run's training cap; the
first lines say the cap, temperature, top-p and k, and the results the share of samples that hit
the cap (a warning above ``CAP_WARN_SHARE``). Re-running the same command with the same
``--out`` resumes: finished problems are kept. See :mod:`stapo.evals.runner` and docs/evaluation.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from stapo.cli.common import CLIError, ConfigOpt, SetOpt, prepare_errors, quiet_known_noise
from stapo.cli.common import console as make_console


def _run_config(model: str | None) -> Path | None:
    """``config.yaml`` of the run dir that ``--model`` points into (run dir, final/, checkpoint), if any."""
    if model is None:
        return None
    p = Path(model).expanduser()
    for cand in (p, p.parent, p.parent.parent):
        if (cand / "config.yaml").is_file() and ((cand / "metrics.jsonl").exists() or (cand / "checkpoints").is_dir()
                                                 or cand == p):
            return cand / "config.yaml"
    return None


def command(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    model: Annotated[
        str | None,
        typer.Option("--model", "-m", metavar="RUN|PATH|ID", help="Run dir, checkpoint dir, HF model folder or hub id, or `tiny-random`."),
    ] = None,
    step: Annotated[int | None, typer.Option("--step", metavar="N", help="With a run dir: evaluate checkpoints/step_N.")] = None,
    benchmarks: Annotated[
        str | None,
        typer.Option("--benchmarks", "-b", metavar="NAMES", help="Comma-separated: aime24,aime25,amc23,math500,minerva_math,"
                     "olympiadbench,gsm8k or custom:PATH.jsonl[#problem=F,answer=F,id=F]."),
    ] = None,
    k: Annotated[
        int | None, typer.Option("--k", metavar="K", help="Samples per problem (default: 32 for AIME24/25, AMC23; 4 otherwise).")
    ] = None,
    limit: Annotated[int | None, typer.Option("--limit", metavar="N", help="At most this many problems per benchmark.")] = None,
    preset: Annotated[
        str | None, typer.Option("--preset", metavar="t1.0|t0.7", help="Sampling: t1.0 (temperature 1.0, top-p 1.0) or t0.7 (0.7 / 0.9).")
    ] = None,
    template: Annotated[
        str | None, typer.Option("--template", metavar="NAME", help="Prompt template: dapo, boxed, short, none (data.template).")
    ] = None,
    max_new_tokens: Annotated[
        int | None, typer.Option("--max-new-tokens", metavar="N", help="Response length cap (eval.max_new_tokens; "
                                 "default 20480 as in the paper, or the config's eval section; not the run's training cap).")
    ] = None,
    data_dir: Annotated[
        Path | None, typer.Option("--data-dir", metavar="DIR", help="Benchmark folder (default: data.data_dir, else $STAPO_DATA_DIR, else the copies shipped with stapo).")
    ] = None,
    out: Annotated[Path, typer.Option("--out", "-o", metavar="DIR", help="Output dir: results.json, samples.jsonl (resumable).")] = Path(
        "eval_results"
    ),
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Rich progress bars (on a terminal only).")] = True,
) -> None:
    """Evaluate a policy on math benchmarks: avg@k, unbiased pass@k, maj@k per benchmark and macro average.

    Examples:

    \b
      stapo eval --model runs/stapo --benchmarks aime24,amc23,math500 --out evals/stapo
      stapo eval --config tiny --model tiny-random --benchmarks gsm8k --k 4 --limit 20 --out /tmp/ev
      stapo eval --model Qwen/Qwen3-1.7B-Base --set rollout.engine=vllm --preset t1.0 --out evals/base
    """
    from stapo.core.config import ConfigError, config_from_dict, load_config

    overrides = list(set_ or [])
    if k is not None:
        overrides.append(f"eval.k={k}")
    if limit is not None:
        overrides.append(f"eval.limit={limit}")
    if preset is not None:
        overrides.append(f"eval.preset={preset}")
    if template is not None:
        overrides.append(f"data.template={template}")
    if max_new_tokens is not None:
        overrides.append(f"eval.max_new_tokens={max_new_tokens}")
    try:
        if config is not None:
            from stapo.cli.train import resolve_config_path

            path: Path | None = resolve_config_path(config)
        else:
            path = _run_config(model)
        cfg = load_config(path, overrides)
        if benchmarks is not None:
            names = [b.strip() for b in benchmarks.split(",") if b.strip()]
            if not names:
                raise CLIError("--benchmarks: no benchmark names given")
            data = cfg.model_dump(mode="json")
            data["eval"]["benchmarks"] = names
            cfg = config_from_dict(data)
    except ConfigError as err:
        raise CLIError(str(err)) from None

    from stapo.core.train.prepare import check_engine_and_device

    with prepare_errors():
        check_engine_and_device(cfg)  # a missing engine or GPU: one line before anything loads
    quiet_known_noise(cfg.trainer.backend)
    from stapo.core.task.rewards import RewardError
    from stapo.evals.runner import EvalStateError, evaluate, results_table

    console = make_console()
    console.print(f"eval: model {model or cfg.model.name_or_path}, benchmarks {', '.join(cfg.eval.benchmarks)}, "
                  f"preset {cfg.eval.preset}, out {out}" + (f" (config {path})" if path else ""))
    try:
        results = evaluate(cfg, out_dir=out, model_path=model, step=step,
                           data_dir=str(data_dir) if data_dir else None, progress=progress and console.is_terminal,
                           console=console)
    except ConfigError as err:  # e.g. a checkpoint's model section that this version rejects
        raise CLIError(str(err)) from None
    except (FileNotFoundError, KeyError, ValueError, EvalStateError) as err:
        msg = err.args[0] if isinstance(err, KeyError) and err.args else str(err)
        raise CLIError(str(msg)) from None
    except RewardError as err:
        raise CLIError(f"eval stopped (finished problems are kept; rerun to resume): {err}") from None
    except KeyboardInterrupt:  # Ctrl-C: what is kept, and the command that goes on from it
        for line in interrupted_report(out):
            typer.echo(line, err=True)
        raise typer.Exit(130) from None
    console.print(results_table(results))
    for warning in results.get("warnings", []):
        typer.echo(f"warning: {warning}", err=True)
    console.print(f"results: {out / 'results.json'}  samples: {out / 'samples.jsonl'}")


def interrupted_report(out: Path, argv: list[str] | None = None) -> list[str]:
    """The lines an interrupted `stapo eval` prints: the samples ``out`` keeps (every graded sample is
    written as it is done; a problem with all its k samples is not sampled again) and the command,
    ``argv`` (default: this process's), that resumes from them."""
    import shlex
    import sys

    from stapo.evals.runner import SAMPLES_FILE, read_samples

    rows = read_samples(out / SAMPLES_FILE) if (out / SAMPLES_FILE).is_file() else []
    per: dict[str, set[str]] = {}
    for r in rows:
        per.setdefault(str(r["benchmark"]), set()).add(str(r["problem_id"]))
    touched = ", ".join(f"{b} {len(ids)}" for b, ids in sorted(per.items())) or "none"
    command = shlex.join(["stapo", *(sys.argv[1:] if argv is None else argv)])
    return ["", f"eval interrupted: {len(rows)} graded samples kept in {out / SAMPLES_FILE} (problems sampled: "
                f"{touched}); problems with all their samples are not sampled again.",
            f"resume with the same command: {command}"]

