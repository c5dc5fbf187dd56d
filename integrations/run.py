"""The integration matrix: verl, OpenRLHF and TRL's own reward code against the service and the adapters.

    make integrations                              # every framework version (builds venvs once)
    .venv/bin/python integrations/run.py trl-1.16.0 verl-0.6.1   # some of them

Opt-in and slow (each framework version has its own virtualenv from PyPI, see ``envs.py``); never
part of ``make test``. For each environment it starts the service (``stapo verifier serve``, a real
uvicorn on 127.0.0.1, with a token), runs the framework's driver (``drive_<framework>.py``) in that
environment, and prints one table: framework | version | route | rewards | expected. Exits 1 on
any mismatch (or a driver that fails), 0 when every row matches.
"""

from __future__ import annotations

import datetime
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cases import CASES, MAX_PREDICTION_CHARS  # noqa: E402
from envs import CACHE, ENVS, REPO, build  # noqa: E402

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_service(token: str) -> tuple[subprocess.Popen, str]:
    """``stapo verifier serve`` from the project's own environment, with a token and a small size limit."""
    import httpx

    port = free_port()
    env = dict(os.environ)
    env.update(
        STAPO_VERIFIER_TOKEN=token,
        STAPO_VERIFIER_WORKERS="2",
        # a loaded 2-core machine can take over the default 5 s on a cold sympy comparison: such an
        # item would answer "timeout" (the failure value), a row failing for load, not for a bug
        STAPO_VERIFIER_DEADLINE_S="30",
        STAPO_VERIFIER_MAX_PREDICTION_CHARS=str(MAX_PREDICTION_CHARS),
        STAPO_VERIFIER_LOG_LEVEL="warning",
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "stapo.cli.main", "verifier", "serve", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    end = time.monotonic() + 120
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"the service exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the service did not become ready in 120 s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def run_driver(name: str, settings: dict, log_path: Path) -> tuple[list[dict], int]:
    """Run one environment's driver; its MATRIX rows and exit code (its full output goes to the log)."""
    env = ENVS[name]
    python = build(env, log=log_path.open("a"))
    child_env = {
        k: v for k, v in os.environ.items() if not k.startswith(("STAPO_VERIFIER_", "VIRTUAL_ENV", "PYTHON"))
    }
    child_env.update(
        STAPO_VERIFIER_MAX_PREDICTION_CHARS=str(MAX_PREDICTION_CHARS),
        STAPO_VERIFIER_WORKERS="1",
        RAY_USAGE_STATS_ENABLED="0",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        WANDB_MODE="disabled",
    )
    with log_path.open("a") as log:
        print(f"\n===== {name} driver", file=log, flush=True)
        proc = subprocess.run(
            [str(python), str(HERE / f"drive_{env.framework}.py"), json.dumps(settings)],
            env=child_env,
            cwd=str(HERE),
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            timeout=1800,
        )
        log.write(proc.stdout)
    rows = [
        json.loads(line[len("MATRIX ") :]) for line in proc.stdout.splitlines() if line.startswith("MATRIX ")
    ]
    return rows, proc.returncode


def fmt(x) -> str:
    if isinstance(x, list):
        n = len(CASES)  # the same batch graded in several steps: "3 x [...]"
        if len(x) > n and len(x) % n == 0 and x == x[:n] * (len(x) // n):
            return f"{len(x) // n} x {fmt(x[:n])}"
        return (
            "["
            + ", ".join("None" if v is None else f"{v:g}" if isinstance(v, float) else str(v) for v in x)
            + "]"
        )
    return str(x)


def table(rows: list[dict]) -> str:
    head = ("framework", "version", "route", "rewards", "expected", "ok")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        same = "ok" if r["rewards"] == r["expected"] else "**MISMATCH**"
        lines.append(
            f"| {r['framework']} | {r['version']} | {r['route']} | {fmt(r['rewards'])} | {fmt(r['expected'])} | {same} |"
        )
    return "\n".join(lines)


def main(names: list[str]) -> int:
    unknown = [n for n in names if n not in ENVS]
    if unknown:
        print(f"unknown environment(s) {unknown}; known: {', '.join(ENVS)}", file=sys.stderr)
        return 2
    CACHE.mkdir(exist_ok=True)
    stamp = datetime.datetime.now(datetime.UTC).isoformat()
    token = secrets.token_urlsafe(16)
    proc, url = start_service(token)
    rows: list[dict] = []
    failed: list[str] = []
    try:
        settings = {
            "url": url,
            "token": token,
            "dead_url": f"http://127.0.0.1:{free_port()}",
            "adapters_file": str(REPO / "verifier_service" / "clients" / "adapters.py"),
        }
        for name in names:
            env = ENVS[name]
            log_path = CACHE / f"{name}.log"  # one log per environment: runs of different ones can overlap
            log_path.write_text(f"integration matrix {stamp}\n")
            print(f"{name}: building / running (log: {log_path}) ...", flush=True)
            t0 = time.monotonic()
            got, code = run_driver(name, settings, log_path)
            print(f"{name}: {len(got)} rows, exit {code}, {time.monotonic() - t0:.0f} s", flush=True)
            if code != 0 or not got:
                failed.append(f"{name} (driver exit {code}, {len(got)} rows; see {log_path})")
            rows += [{"framework": env.framework, "version": env.version, **r} for r in got]
    finally:
        stop(proc)
    print()
    print(f"Integration matrix, {datetime.date.today().isoformat()} (2 shared CPU cores, torch CPU)")
    print(table(rows))
    bad = [r for r in rows if r["rewards"] != r["expected"]]
    for r in bad:
        print(f"MISMATCH {r['framework']} {r['version']} {r['route']}: {r['rewards']} != {r['expected']}")
    for f in failed:
        print(f"FAILED {f}")
    return 1 if bad or failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or list(ENVS)))
