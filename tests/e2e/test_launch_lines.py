"""Every documented launch line parses with its launcher's own parser, and each shape trains on CPU.

Collected: the ``deepspeed`` / ``torchrun`` / ``srun`` / ``docker run`` / ``docker compose run``
lines of README.md and docs/*.md (fenced blocks, backslash continuations joined, ``NAME="..."``
assignments of the same block expanded), the ``# Run:`` header of each recipe (configs/*.yaml), the
``docker run`` lines of the Dockerfile, compose's ``trainer`` service (entrypoint + command), and the
one-GPU ``stapo train`` line of docs/gpu.md. Docker lines are rebuilt into the argv the container
runs (the image's entrypoint is ``stapo``; ``--entrypoint`` or compose's ``entrypoint`` replaces it).

For every line: the launcher's parser (``deepspeed.launcher.runner.parse_args``,
``torch.distributed.run.get_args_parser``) accepts it, the module is ``stapo.cli.main`` run with
``train`` (deepspeed: ``--module`` and ``--no_local_rank``), and its ``--config`` and ``--set``
values load. Then one line per shape runs for real on CPU with 2 processes, changing only what a CPU
forces: the process count (2 on one "node", or 1 on each of 2 "nodes" on 127.0.0.1), ``--config
tiny`` with the line's backend and ZeRO stage, one step, a temporary run dir, a free port. It must
exit 0, write one metrics row, and print its start-up lines once for the job.

Not run here, and why: the SSH hostfile shape (no SSH between machines: parsed and config-checked
only), ``srun`` itself (no Slurm: the command each task runs is run by bash with the ``SLURM_NNODES``
/ ``SLURM_NODEID`` srun would set), Docker (no engine: the container's argv runs without it).
A 3-rank torchrun launch whose ranks do not divide the prompts prints the error once.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

pytest.importorskip("deepspeed")

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 600
LAUNCHERS = ("deepspeed", "torchrun", "srun", "docker")
# Values of the shell variables the documented lines leave to the user (parse only; the CPU runs
# set their own).
SHELL_VARS = {"NODE_RANK": "0", "PWD": "/home/user/stapo"}
# --set keys a CPU run drops: the model, its data and where it generates or grades are what a CPU
# forces (tiny's own model, data and in-process grading stand in).
CPU_DROPS = ("model.", "data.", "rollout.engine", "rollout.vllm.", "reward.urls")


@dataclass
class Line:
    source: str  # file:line
    argv: list[str]  # what runs: ["deepspeed", ...], ["torchrun", ...], ["stapo", "train", ...]
    shape: str = ""
    train: list[str] = field(default_factory=list)  # the stapo arguments, from "train" on
    inner: str = ""  # srun: the command each task runs (bash -c)


# ----------------------------------------------------------------------------- collection


def _expand(text: str, assigned: dict[str, str]) -> str:
    for name, value in {**SHELL_VARS, **assigned}.items():
        text = text.replace(f"${name}", value)
    return text


def _docker_argv(tokens: list[str], compose_trainer: dict) -> list[str] | None:
    """The argv a ``docker run ... stapo-trainer ARGS`` or ``docker compose run ... trainer ARGS``
    runs in the container; None for other images and services."""
    entry: list[str] | None = None
    i = 2 if tokens[1] == "run" else 3
    while i < len(tokens) and tokens[i].startswith("-"):
        flag = tokens[i].split("=", 1)[0]
        takes_value = flag in ("-v", "-e", "-p", "--gpus", "--shm-size", "--entrypoint", "--name", "--volume",
                               "--env", "--publish")
        if flag == "--entrypoint":
            entry = [tokens[i].split("=", 1)[1] if "=" in tokens[i] else tokens[i + 1]]
        i += 2 if takes_value and "=" not in tokens[i] else 1
    image, args = tokens[i], tokens[i + 1:]
    if tokens[1] == "compose":
        if image != "trainer":
            return None
        entry = entry or list(compose_trainer.get("entrypoint") or ["stapo"])
    elif image != "stapo-trainer":
        return None
    return (entry or ["stapo"]) + args


def _shell_lines(text: str) -> list[tuple[int, str, dict[str, str]]]:
    """(line number, command, assignments seen before it) of each fenced block's commands."""
    out, assigned, in_block, buf, start = [], {}, False, "", 0
    for n, raw in enumerate(text.splitlines(), 1):
        if raw.lstrip().startswith("```"):
            in_block, assigned = not in_block, {}
            continue
        if not in_block:
            continue
        if not buf:
            start = n
        buf += raw.rstrip().removesuffix("\\") + " "
        if raw.rstrip().endswith("\\"):
            continue
        cmd, buf = buf.strip(), ""
        m = re.match(r'^([A-Z_]+)="(.*)"$', cmd)
        if m:
            assigned[m.group(1)] = m.group(2)
        elif cmd:
            out.append((start, cmd, dict(assigned)))
    return out


def collect() -> list[Line]:
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    trainer = compose["services"]["trainer"]
    lines: list[Line] = []

    def add(source: str, cmd: str, assigned: dict[str, str] | None = None) -> None:
        if cmd.split()[:1] not in ([p] for p in LAUNCHERS):
            return
        tokens = shlex.split(_expand(cmd, assigned or {}), comments=True)
        if tokens[0] == "docker":
            if tokens[1:2] != ["run"] and tokens[1:3] != ["compose", "run"]:
                return
            argv = _docker_argv(tokens, trainer)
            if argv is None or "train" not in argv:
                return
            tokens = argv
        lines.append(Line(source, tokens))

    docs = [ROOT / "docs" / "gpu.md", ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for path in dict.fromkeys(docs):
        rel = path.relative_to(ROOT)
        for n, cmd, assigned in _shell_lines(path.read_text()):
            if rel.as_posix() == "docs/gpu.md" and cmd.startswith("stapo train"):
                lines.append(Line(f"{rel}:{n}", shlex.split(cmd)))
            add(f"{rel}:{n}", cmd, assigned)
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        for n, raw in enumerate(path.read_text().splitlines(), 1):
            if raw.startswith("# Run:"):
                add(f"configs/{path.name}:{n}", raw.removeprefix("# Run:"))
    for n, raw in enumerate((ROOT / "Dockerfile").read_text().splitlines(), 1):
        if "docker run" in raw and raw.lstrip().startswith("#"):
            add(f"Dockerfile:{n}", raw[raw.index("docker run"):].strip().strip("`"))
    lines.append(Line("compose.yaml:trainer", list(trainer.get("entrypoint") or ["stapo"]) + list(trainer["command"])))
    return lines


LINES = collect()


# ----------------------------------------------------------------------------- parsing


def classify(line: Line) -> Line:
    """Parse ``line.argv`` with its launcher's own parser; set its shape and stapo arguments."""
    prog, args = line.argv[0], line.argv[1:]
    if prog == "stapo":
        line.shape, line.train = "one-process", args
    elif prog == "deepspeed":
        from deepspeed.launcher.runner import DLTS_HOSTFILE, parse_args

        ns = parse_args(args)
        assert ns.module and ns.no_local_rank, f"{line.source}: deepspeed needs --module and --no_local_rank"
        assert ns.user_script == "stapo.cli.main", f"{line.source}: runs {ns.user_script}"
        line.train = list(ns.user_args)
        line.shape = ("deepspeed-no-ssh" if ns.no_ssh else "deepspeed-ssh") if ns.hostfile != DLTS_HOSTFILE else "deepspeed"
    elif prog == "torchrun":
        from torch.distributed.run import get_args_parser

        ns = get_args_parser().parse_args(args)
        assert ns.module and ns.training_script == "stapo.cli.main", f"{line.source}: runs {ns.training_script}"
        line.train = list(ns.training_script_args)
        line.shape = "torchrun" if ns.nnodes in ("1", "1:1") else "torchrun-nodes"
    elif prog == "srun":
        inner = args[args.index("-c") + 1]
        line.inner = inner
        sub = classify(Line(line.source, shlex.split(_expand(inner, {"SLURM_NNODES": "2", "SLURM_NODEID": "0",
                                                                     "MASTER_ADDR": "gpu-node-1"}))))
        assert sub.shape == "torchrun-nodes", f"{line.source}: srun's task runs {sub.shape}"
        line.shape, line.train = "srun", sub.train
    else:
        raise AssertionError(f"{line.source}: {prog!r} is not a launcher stapo documents (the image's entrypoint "
                             "is stapo: a launcher needs --entrypoint)")
    assert line.train[:1] == ["train"], f"{line.source}: the module must run `train`, got {line.train[:1]}"
    return line


def train_options(train: list[str]) -> tuple[str, list[str]]:
    """(--config value, --set values) of stapo's ``train`` arguments."""
    config, sets, i = "demo", [], 1
    while i < len(train):
        if train[i] in ("--config", "-c"):
            config = train[i + 1]
        elif train[i] in ("--set", "-s"):
            sets.append(train[i + 1])
        i += 2 if train[i].startswith("-") and i + 1 < len(train) and not train[i + 1].startswith("-") else 1
    return config, sets


def load(line: Line):
    from stapo.cli.common import resolve_config_path
    from stapo.core.config import load_config

    config, sets = train_options(line.train)
    return load_config(resolve_config_path(Path(config)), sets)


def test_every_documented_shape_is_collected() -> None:
    shapes = {classify(Line(line.source, list(line.argv))).shape for line in LINES}
    assert shapes >= {"one-process", "deepspeed", "torchrun", "deepspeed-ssh", "deepspeed-no-ssh",
                      "torchrun-nodes", "srun"}, shapes
    sources = {line.source.split(":")[0] for line in LINES}
    assert {"docs/gpu.md", "configs/stapo.yaml", "Dockerfile", "compose.yaml", "docs/training-backends.md"} <= sources


@pytest.mark.parametrize("line", LINES, ids=[line.source for line in LINES])
def test_launch_line_parses_and_its_config_loads(line: Line) -> None:
    line = classify(Line(line.source, list(line.argv)))
    cfg = load(line)
    if line.shape != "one-process":
        assert cfg.trainer.backend == "deepspeed", f"{line.source}: several ranks need trainer.backend=deepspeed"


# ----------------------------------------------------------------------------- real runs on CPU


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _set_opt(tokens: list[str], flag: str, value: str) -> list[str]:
    """``tokens`` with ``flag value`` (or ``flag=value``) replaced, or appended before the module."""
    out = list(tokens)
    for i, t in enumerate(out):
        if t == flag:
            out[i + 1] = value
            return out
        if t.startswith(flag + "="):
            out[i] = f"{flag}={value}"
            return out
    cut = next(i for i, t in enumerate(out) if t in ("--module", "-m", "stapo.cli.main"))
    return out[:cut] + [flag, value] + out[cut:]


def cpu_train(line: Line, run_dir: Path) -> list[str]:
    """The line's ``train`` arguments as a CPU runs them: tiny model, the line's backend and ZeRO
    stage, its other --set values (but CPU_DROPS), one step."""
    cfg = load(line)
    _, sets = train_options(line.train)
    kept = [s for s in sets if not s.startswith(CPU_DROPS)]
    forced = [f"trainer.backend={cfg.trainer.backend}", f"trainer.zero_stage={cfg.trainer.zero_stage}",
              "trainer.device=auto", *kept, "trainer.max_steps=1", "logging.live=false", "logging.tensorboard=false",
              "checkpoint.export_hf=false"]
    return ["train", "--config", "tiny", "--run-dir", str(run_dir), *[a for s in forced for a in ("--set", s)]]


def _launcher(prog: str) -> list[str]:
    module = {"deepspeed": "deepspeed.launcher.runner", "torchrun": "torch.distributed.run"}[prog]
    return [sys.executable, "-m", module]


def cpu_commands(line: Line, tmp: Path) -> list[tuple[list[str], dict[str, str]]]:
    """(argv, extra env) of each process a CPU run of ``line`` starts (one per "node")."""
    run_dir, port = tmp / "run", str(_free_port())
    train = cpu_train(line, run_dir)
    head = line.argv[: len(line.argv) - len(line.train)]  # launcher and its options, up to the module
    if line.shape == "one-process":
        return [([sys.executable, "-m", "stapo.cli.main", *train], {})]
    if line.shape == "deepspeed":
        tokens = _set_opt(_set_opt(head[1:], "--num_gpus", "2"), "--master_port", port)
        return [(_launcher("deepspeed") + tokens + train, {})]
    if line.shape == "deepspeed-no-ssh":
        hostfile = tmp / "hostfile"
        hostfile.write_text("gpu-node-1 slots=1\ngpu-node-2 slots=1\n")
        tokens = _set_opt(_set_opt(_set_opt(head[1:], "--hostfile", str(hostfile)), "--master_addr", "127.0.0.1"),
                          "--master_port", port)
        return [(_launcher("deepspeed") + _set_opt(tokens, "--node_rank", str(r)) + train, {}) for r in (0, 1)]
    if line.shape == "torchrun":
        tokens = _set_opt(_set_opt(_set_opt(head[1:], "--nproc_per_node", "2"), "--master_addr", "127.0.0.1"),
                          "--master_port", port)
        return [(_launcher("torchrun") + tokens + train, {})]
    if line.shape == "srun":
        # the task's command as srun would run it, through bash, with srun's variables
        inner = shlex.split(line.inner)
        cut = inner.index("stapo.cli.main") + 1
        tokens = _set_opt(_set_opt(inner[1:cut], "--nproc_per_node", "1"), "--master_port", port)
        script = shlex.join(_launcher("torchrun")) + " " + " ".join(tokens) + " " + shlex.join(train)
        return [(["bash", "-c", script], {"SLURM_NNODES": "2", "SLURM_NODEID": str(r), "MASTER_ADDR": "127.0.0.1"})
                for r in (0, 1)]
    raise AssertionError(f"no CPU run for shape {line.shape}")


def run_all(commands: list[tuple[list[str], dict[str, str]]], tmp: Path) -> tuple[list[int], str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_EXTENSIONS_DIR=str(tmp / "ext"), PYTHONUNBUFFERED="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    procs = [subprocess.Popen(argv, env={**env, **extra}, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, start_new_session=True) for argv, extra in commands]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=TIMEOUT_S)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                os.killpg(q.pid, signal.SIGKILL)
            pytest.fail(f"launch did not finish in {TIMEOUT_S}s: {commands}")
    return [p.returncode for p in procs], "\n".join(outs)


# One real run per shape: the first line of each (docs/gpu.md's come first). The SSH hostfile shape
# needs SSH between machines: parsed above, not run.
RUNNABLE = ("one-process", "deepspeed", "deepspeed-no-ssh", "torchrun", "srun")


def _first_of(shape: str) -> Line:
    for line in LINES:
        parsed = classify(Line(line.source, list(line.argv)))
        if parsed.shape == shape:
            return parsed
    raise AssertionError(f"no documented {shape} line")


@pytest.mark.long
@pytest.mark.timeout(2 * TIMEOUT_S + 60)
@pytest.mark.parametrize("shape", RUNNABLE)
def test_each_launch_shape_trains_on_cpu(shape: str, tmp_path: Path) -> None:
    line = _first_of(shape)
    codes, out = run_all(cpu_commands(line, tmp_path), tmp_path)
    assert codes == [0] * len(codes), f"{line.source}: exit codes {codes}\n{out[-4000:]}"
    rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 1, rows
    starts = [ln for ln in out.splitlines() if ln.startswith(("run dir:", "done:", "policy ", "data:"))]
    assert sorted(s.split(":")[0].split(" ")[0] for s in starts) == ["data", "done", "policy", "run"], starts


@pytest.mark.long
def test_a_launch_whose_ranks_do_not_divide_the_prompts_says_so_once(tmp_path: Path) -> None:
    """3 ranks, 8 prompts per step: one line naming the key, before any model loads; no "unexpected"."""
    argv = _launcher("torchrun") + ["--nproc_per_node", "3", "--master_addr", "127.0.0.1", "--master_port",
                                    str(_free_port()), "-m", "stapo.cli.main", "train", "--config", "tiny",
                                    "--run-dir", str(tmp_path / "run"), "--set", "trainer.backend=deepspeed"]
    codes, out = run_all([(argv, {})], tmp_path)
    assert codes != [0]
    hits = [ln for ln in out.splitlines() if "must be divisible by the number of ranks (3)" in ln]
    assert len(hits) == 1 and hits[0].startswith("error: rollout.prompts_per_step (8)"), out[-3000:]
    assert "unexpected" not in out and "policy " not in out
    assert not (tmp_path / "run").exists()
