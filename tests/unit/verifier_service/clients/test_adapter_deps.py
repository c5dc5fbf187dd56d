"""The adapters' documented install is complete: docs/integrations.md's install line is
``integrations/envs.py``'s ``ADAPTER_DEPS`` word for word, and what grading imports (in-process,
with its pool, and through the service's client) comes from those packages and their dependencies.

The last two tests install that line into a fresh virtualenv from PyPI and grade in-process there:
alone (~80 s on the project's 2-core machine: pip resolving and downloading math-verify, sympy,
pydantic), and over OpenRLHF 0.11.2 with its transformers and ray pins, where it must change no
version OpenRLHF installed. They are opt-in: ``STAPO_SLOW=1``.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from integrations.envs import ADAPTER_DEPS

REPO = Path(__file__).resolve().parents[4]
MATH_VERIFY = "math-verify[antlr4_9_3]==0.9.0"
# httpx's `cli` extra: httpx/__init__.py imports its command line (click, rich, pygments) when they are
# installed and carries on without them
OPTIONAL = {"click", "rich", "pygments"}

GRADE = """
import json, sys
if __name__ == "__main__":
    from stapo.verifier_service.clients import adapters, client  # noqa: F401  (the service route's client too)
    score = adapters.compute_score(data_source="x", solution_str="so \\\\boxed{\\\\frac{1}{2}}", ground_truth="0.5")
    print(json.dumps({"score": score["score"], "modules": sorted({m.split(".")[0] for m in sys.modules})}))
"""


def _documented_line(antlr: str = "antlr4_9_3") -> list[str]:
    """The adapters' install line for a framework whose environment has this ANTLR runtime (verl: 4.9;
    OpenRLHF leaves it free: 4.13)."""
    text = (REPO / "docs" / "integrations.md").read_text()
    line = next(x for x in text.splitlines() if x.startswith(f'pip install "math-verify[{antlr}]'))
    return shlex.split(line)[2:]


def test_the_documented_install_line_is_adapter_deps():
    words = _documented_line()
    assert words[0] == MATH_VERIFY
    assert tuple(words[1:]) == ADAPTER_DEPS
    openrlhf = _documented_line("antlr4_13_2")  # the OpenRLHF line: the same packages, its ANTLR runtime
    assert openrlhf == [MATH_VERIFY.replace("antlr4_9_3", "antlr4_13_2"), *ADAPTER_DEPS]
    text = (REPO / "docs" / "integrations.md").read_text()
    assert _openrlhf_block(text) == [["--no-deps", "-e", "/path/to/stapo"], openrlhf]  # nothing else in it


def _openrlhf_block(text: str) -> list[list[str]]:
    """The arguments of each ``pip install`` of the page's OpenRLHF install block."""
    lines = _block_after(text, "**Installing stapo next to OpenRLHF.**", "bash").strip().splitlines()
    assert all(ln.startswith("pip install ") for ln in lines), lines
    return [shlex.split(ln)[2:] for ln in lines]
    assert any(Requirement(d).name == "pebble" for d in ADAPTER_DEPS)  # the in-process pool's workers


def _closure(roots: list[str]) -> set[str]:
    """Distribution names of ``roots`` and everything they require (unconditional requirements and
    the extras asked for), as installed here."""
    seen: set[str] = set()
    todo = [Requirement(r) for r in roots]
    while todo:
        req = todo.pop()
        name = re.sub(r"[-_.]+", "-", req.name).lower()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(req.name) or []
        except metadata.PackageNotFoundError:
            continue
        for raw in requires:
            sub = Requirement(raw)
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in (req.extras or {""})):
                todo.append(sub)
    return seen


def test_grading_imports_nothing_the_install_line_leaves_out(tmp_path):
    script = tmp_path / "grade.py"
    script.write_text(GRADE)
    env = {k: v for k, v in os.environ.items() if not k.startswith("STAPO_VERIFIER_")}
    env["STAPO_VERIFIER_WORKERS"] = "1"
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["score"] == 1.0
    allowed = _closure([MATH_VERIFY.replace("antlr4_9_3", "antlr4_13_2"), *ADAPTER_DEPS]) | {"stapo"} | OPTIONAL
    owners = metadata.packages_distributions()
    stdlib = set(sys.stdlib_module_names)
    outside = {}
    for module in result["modules"]:
        if module in stdlib or module.startswith("_") or module == "stapo":
            continue
        dists = {re.sub(r"[-_.]+", "-", d).lower() for d in owners.get(module, [])}
        if dists and not dists & allowed:
            outside[module] = sorted(dists)
    assert not outside, f"imported while grading but not in ADAPTER_DEPS (or their dependencies): {outside}"


@pytest.mark.skipif(os.environ.get("STAPO_SLOW") != "1", reason="slow (~80 s of pip from PyPI): set STAPO_SLOW=1")
def test_the_documented_install_grades_in_process_in_a_fresh_venv(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    for args in (["--no-deps", "-e", str(REPO)], _documented_line()):  # the two documented lines
        done = subprocess.run([py, "-m", "pip", "install", "-q", *args], capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-2000:]
    script = tmp_path / "grade.py"
    script.write_text(GRADE)
    env = {k: v for k, v in os.environ.items() if not k.startswith("STAPO_VERIFIER_")}
    env["STAPO_VERIFIER_WORKERS"] = "1"
    out = subprocess.run([py, str(script)], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1])["score"] == 1.0


OPENRLHF_PINS = ("transformers==5.15.0", "ray[default]==2.55.0")  # openrlhf 0.11.2's Requires-Dist


def _freeze(py: str) -> dict[str, str]:
    out = subprocess.run([py, "-m", "pip", "list", "--format=json"], capture_output=True, text=True, check=True)
    return {re.sub(r"[-_.]+", "-", p["name"]).lower(): p["version"] for p in json.loads(out.stdout)}


def _block_after(text: str, marker: str, lang: str) -> str:
    """The first fenced ``lang`` block after ``marker`` on the page."""
    return text.split(marker, 1)[1].split(f"```{lang}\n", 1)[1].split("```", 1)[0]


@pytest.mark.skipif(os.environ.get("STAPO_SLOW") != "1", reason="slow (minutes of pip from PyPI): set STAPO_SLOW=1")
def test_the_openrlhf_install_keeps_its_pins_and_grades(tmp_path):
    """OpenRLHF 0.11.2 (``--no-deps``: its full install needs CUDA) with its pinned transformers and
    ray and the torch on disk; then the page's two stapo lines. No version OpenRLHF's install put
    there moves, and the page's adapters-file check prints the right rewards in that environment."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = str(venv / "bin" / "python")

    def pip(*args: str) -> None:
        done = subprocess.run([py, "-m", "pip", "install", "-q", *args], capture_output=True, text=True, timeout=1800)
        assert done.returncode == 0, done.stderr[-2000:]

    pip(os.environ.get("TORCH", "torch==2.13.0"))
    pip("--no-deps", "openrlhf==0.11.2")
    pip(*OPENRLHF_PINS)
    before = _freeze(py)
    text = (REPO / "docs" / "integrations.md").read_text()
    assert _openrlhf_block(text) == [["--no-deps", "-e", "/path/to/stapo"], _documented_line("antlr4_13_2")]
    pip("--no-deps", "-e", str(REPO))
    pip(*_documented_line("antlr4_13_2"))
    after = _freeze(py)
    moved = {name: (v, after.get(name)) for name, v in before.items() if after.get(name) != v}
    assert not moved, f"the stapo lines changed packages of OpenRLHF's install: {moved}"
    assert after["transformers"] == "5.15.0" and after["ray"] == "2.55.0"

    script = tmp_path / "check.py"
    script.write_text(_block_after(text, "Runnable check of the adapters file's function", "python"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("STAPO_VERIFIER_")}
    env["STAPO_VERIFIER_WORKERS"] = "1"
    out = subprocess.run([py, str(script)], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "'rewards': tensor([1., 0.])" in out.stdout, out.stdout
