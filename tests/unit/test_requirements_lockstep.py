"""The service's requirement lists stay in step with pyproject, and carry no training stack.

requirements/verifier.txt is what the verifier image and `make test-verifier` install instead of
pyproject's dependencies (which include torch). If the two drifted, the image and the second-minor
test run would test other versions than `pip install stapo` gets; if torch entered the list, the
second-minor run would resolve a multi-GB CUDA build.
"""

from __future__ import annotations

import re
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parents[2]
TRAINING_STACK = {"torch", "transformers", "deepspeed", "vllm", "accelerate", "tensorboard", "matplotlib"}


def requirement_lines(path: Path) -> list[str]:
    """A requirements file's requirement lines (comments, blanks and ``-r`` includes dropped)."""
    out = []
    for line in path.read_text().splitlines():
        line = line.split(" #")[0].strip()
        if line and not line.startswith(("#", "-")):
            out.append(line)
    return out


def name_of(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def pyproject_requirements() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return set(project["dependencies"]) | set(project["optional-dependencies"]["dev"])


def test_every_line_is_pyprojects_own_and_none_is_the_training_stack() -> None:
    known = pyproject_requirements()
    for name in ("verifier.txt", "verifier-test.txt"):
        lines = requirement_lines(ROOT / "requirements" / name)
        assert lines, name
        for line in lines:
            assert line in known, f"requirements/{name}: {line!r} is not verbatim in pyproject's dependencies"
            assert name_of(line) not in TRAINING_STACK, f"requirements/{name}: {line!r} is training-only"
    includes = [ln for ln in (ROOT / "requirements/verifier-test.txt").read_text().splitlines() if ln.startswith("-r")]
    assert includes == ["-r verifier.txt"]


def test_the_verifier_image_installs_that_list() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    verifier_stage = dockerfile.split(" AS verifier", 1)[1].split("\nFROM ", 1)[0]
    assert "pip install -r requirements/verifier.txt" in verifier_stage
    assert "pip install --no-deps ." in verifier_stage


def test_the_check_sees_a_drifted_pin() -> None:
    """A line whose pin differs from pyproject's is not found there."""
    assert "math-verify[antlr4_13_2]==0.9.1" not in pyproject_requirements()
    assert name_of("uvloop>=0.19; sys_platform != 'win32'") == "uvloop"
    assert name_of("math-verify[antlr4_13_2]==0.9.0") == "math-verify"
