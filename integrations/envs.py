"""The framework versions the integration matrix covers, and how each one's virtualenv is built.

Each framework version gets its own virtualenv under ``.integrations/venvs/`` (gitignored), built
from PyPI once and reused while its recipe is unchanged. torch is installed first, from ``$TORCH``
(default ``torch==2.13.0``: the CPU build on disk on the project's machines), and then pinned with
a constraints file, so that no framework can pull a CUDA build behind our back. stapo itself goes
in with ``--no-deps`` plus the few packages the adapters import, so the framework's own pins decide
every shared dependency, as they would in a user's environment.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CACHE = REPO / ".integrations"
VENVS = CACHE / "venvs"

# What ``stapo.verifier_service.clients.adapters`` imports (grader, pool, client, settings), nothing more:
# the install line of docs/integrations.md, word for word (tests/unit/verifier_service/clients/test_adapter_deps.py checks
# both, and that grading in-process and through the client imports nothing else).
# math-verify comes with the ANTLR runtime the framework already pins (see ``Env.antlr``).
ADAPTER_DEPS = (
    "httpx>=0.27",
    "pydantic>=2.7,<3",
    "pydantic-settings>=2.3,<3",
    "mpmath>=1.3",
    "pebble>=5.1,<6",
)


@dataclass(frozen=True)
class Env:
    """One framework version: the packages of its environment and the driver that exercises it."""

    framework: str
    version: str
    packages: tuple[str, ...]  # installed with their dependencies (torch pinned)
    no_deps: tuple[str, ...] = ()  # installed without (their full install needs CUDA)
    extra: tuple[str, ...] = field(default=())  # what the no-deps package's reward path imports
    # hydra-core / omegaconf (verl) pin antlr4-python3-runtime 4.9; math-verify parses LaTeX with
    # whichever runtime its extra names, so verl environments take ``math-verify[antlr4_9_3]``.
    antlr: str = "antlr4_13_2"

    @property
    def name(self) -> str:
        return f"{self.framework}-{self.version}"

    @property
    def path(self) -> Path:
        return VENVS / self.name

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"

    def recipe(self, torch_spec: str) -> dict:
        return {**asdict(self), "torch": torch_spec, "adapter_deps": ADAPTER_DEPS, "repo": str(REPO)}


ENVS = {
    e.name: e
    for e in (
        # verl: the newest release and the last 0.6.x (the legacy reward managers: prime, batch)
        Env("verl", "0.9.1", ("verl==0.9.1",), antlr="antlr4_9_3"),
        # verl 0.6.1's own pins let pip pick releases its reward loop does not run with; these do
        Env("verl", "0.6.1", ("verl==0.6.1", "transformers<5", "pyarrow<21", "datasets<4.2", "openai"),
            antlr="antlr4_9_3"),
        # OpenRLHF's full install pulls vLLM, DeepSpeed and flash-attn (CUDA); its reward path
        # (openrlhf.utils.agent) imports aiohttp, and through openrlhf.utils transformers, sympy and
        # pylatexenc.
        Env(
            "openrlhf",
            "0.11.2",
            (),
            no_deps=("openrlhf==0.11.2",),
            extra=("aiohttp", "transformers", "sympy", "pylatexenc"),
        ),
        Env("trl", "1.16.0", ("trl==1.16.0",)),
    )
}


def _pip(py: Path, *args: str, log) -> None:
    cmd = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", *args]
    print("   $", " ".join(cmd[2:]), file=log, flush=True)
    subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT)


def build(env: Env, *, torch_spec: str | None = None, log=None) -> Path:
    """Create (or reuse) ``env``'s virtualenv; returns its python. Raises ``CalledProcessError`` on failure."""
    torch_spec = torch_spec or os.environ.get("TORCH", "torch==2.13.0")
    marker = env.path / ".stapo-recipe.json"
    want = json.loads(json.dumps(env.recipe(torch_spec)))  # tuples as lists, as the marker stores them
    if marker.exists() and json.loads(marker.read_text()) == want and env.python.exists():
        return env.python
    log = log or sys.stderr
    VENVS.mkdir(parents=True, exist_ok=True)
    if marker.exists():
        marker.unlink()
    subprocess.run([sys.executable, "-m", "venv", str(env.path)], check=True)
    _pip(env.python, "--upgrade", "pip", log=log)
    _pip(env.python, *torch_spec.split(), log=log)
    constraints = CACHE / "torch-constraint.txt"
    pinned = subprocess.run(
        [str(env.python), "-c", "import torch; print(torch.__version__.split('+')[0])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    constraints.write_text(f"torch=={pinned}\n")
    if env.packages:
        _pip(env.python, "-c", str(constraints), *env.packages, log=log)
    if env.no_deps:
        _pip(env.python, "--no-deps", *env.no_deps, log=log)
    math_verify = f"math-verify[{env.antlr}]==0.9.0"
    _pip(env.python, "-c", str(constraints), *env.extra, math_verify, *ADAPTER_DEPS, log=log)
    _pip(env.python, "--no-deps", "-e", str(REPO), log=log)
    marker.write_text(json.dumps(want, indent=1))
    return env.python


if __name__ == "__main__":  # build the named environments (all by default), e.g. to warm the cache
    for name in sys.argv[1:] or list(ENVS):
        print(f"building {name} ...", flush=True)
        print(f"  {build(ENVS[name], log=sys.stdout)}", flush=True)
