"""A clone of the project needs nothing beside it, and its images can build.

- no tracked file names a path outside the repository (the folder of original copies kept beside
  the checkout on the project machines, or absolute paths into those machines' work root);
- the data shipped in ``evals/data`` is byte-identical to its provenance record (README: rows and
  sha256 of each file), and every registered benchmark and offline training source has its file;
- a wheel built from a copy of the tracked files, installed into an empty folder, reads every
  benchmark and DAPO-Math-17k from a working directory with nothing in it (no data flag, no env);
- every Dockerfile stage that installs the project copies every folder pyproject maps to a package,
  and .dockerignore drops none of them (no Docker engine runs the build here: this is the check);
- compose.yaml requires a token and hands it to the trainer, probes readiness, and mounts nothing
  from outside the repository.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import subprocess
import sys

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]
from fnmatch import fnmatch
from pathlib import Path

import pytest
import yaml

from stapo.core.task.data import OFFLINE_SOURCES, shipped_data_dir
from stapo.evals.benchmarks import BENCHMARKS

ROOT = Path(__file__).resolve().parents[2]
# Built from parts so this file does not contain what it forbids.
OUTSIDE = re.compile(r"\.\./" + "shared" + r"|(?<![\w.~-])/" + "work" + r"(?:/|\b)")


def tracked_files() -> list[Path]:
    """Tracked files (``git ls-files``); the working tree minus ignored folders when git is absent."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60
        ).stdout
        return [ROOT / p for p in out.decode().split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", ".venv", "__pycache__", "build", "dist", ".pytest_cache", ".ruff_cache", "runs"}
        return [
            p for p in ROOT.rglob("*")
            if p.is_file() and not skip.intersection(p.relative_to(ROOT).parts) and ".egg-info" not in str(p)
        ]


# ----------------------------------------------------------------------------- no outside paths


def test_no_tracked_file_points_outside_the_repository() -> None:
    hits = []
    for path in tracked_files():
        if not path.is_file():  # deleted in the working tree, not yet committed
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for lineno, line in enumerate(text.splitlines(), 1):
            if OUTSIDE.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{lineno}: {line.strip()[:120]}")
    assert not hits, "paths outside the repository:\n" + "\n".join(hits)


def test_the_outside_path_pattern_catches_what_it_should() -> None:
    """The scan above is only as good as its pattern: positive and negative cases."""
    bad = [".." + "/shared/data", "see /" + "work/shared/data", "`/" + "work/vllm-venv/bin/pip`"]
    good = ["/shared/runs/stapo-2x8", "~/work/x", "network/work/x", "the work/ folder", "homework/shared"]
    assert all(OUTSIDE.search(s) for s in bad)
    assert not any(OUTSIDE.search(s) for s in good)


# ----------------------------------------------------------------------------- shipped data


def readme_table() -> dict[str, tuple[int, str]]:
    """file -> (rows, sha256) from the provenance table of evals/data/README.md."""
    rows = {}
    for line in (ROOT / "evals" / "data" / "README.md").read_text(encoding="utf-8").splitlines():
        m = re.match(r"\| `([\w.]+\.jsonl)` \| (\d+) \|.*\| `([0-9a-f]{64})` \|$", line)
        if m:
            rows[m.group(1)] = (int(m.group(2)), m.group(3))
    return rows


def test_shipped_data_matches_its_provenance_record() -> None:
    table = readme_table()
    shipped = sorted(p.name for p in shipped_data_dir().glob("*.jsonl"))
    assert shipped == sorted(table), "every shipped file has a README row, and every row a file"
    for name, (rows, sha) in table.items():
        data = (shipped_data_dir() / name).read_bytes()
        assert hashlib.sha256(data).hexdigest() == sha, name
        assert data.count(b"\n") == rows, name


def test_every_registered_source_has_a_shipped_file() -> None:
    assert shipped_data_dir() == ROOT / "evals" / "data"  # the editable install reads this tree
    for name, spec in BENCHMARKS.items():
        assert (shipped_data_dir() / spec.files[0]).is_file(), name
    for name, file in OFFLINE_SOURCES.items():
        assert (shipped_data_dir() / file).is_file(), name


_PROBE = """
import json, sys
from pathlib import Path
import stapo
from stapo.core.config import DataConfig
from stapo.core.task.data import load_prompts, shipped_data_dir
from stapo.evals.benchmarks import BENCHMARKS, load_benchmark
counts = {name: len(load_benchmark(name)) for name in BENCHMARKS}
train, val = load_prompts(DataConfig(source="dapo_math_17k", template="dapo", val_size=10))
counts["dapo_math_17k"] = len(train) + len(val)
print(json.dumps({"pkg": stapo.__file__, "data": str(shipped_data_dir()), "counts": counts}))
"""


@pytest.mark.long  # pip wheel + pip install + a probe, each bounded on its own
def test_installed_wheel_reads_the_data_from_an_empty_directory(tmp_path: Path) -> None:
    """What a user gets from a clone (or pip): built from the tracked files alone, nothing beside."""
    src, wheels, site, cwd = (tmp_path / d for d in ("clone", "wheels", "site", "cwd"))
    cwd.mkdir()
    for f in tracked_files():
        if f.is_file():
            dest = src / f.relative_to(ROOT)
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(f.read_bytes())
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    build = subprocess.run([*pip, "wheel", "--no-deps", "-w", str(wheels), str(src)],
                           capture_output=True, text=True, timeout=600)
    if build.returncode != 0 and re.search(r"(?i)could not find a version|connection|network", build.stderr):
        pytest.skip(f"building a wheel needs setuptools from a package index: {build.stderr[-300:]}")
    assert build.returncode == 0, build.stderr[-2000:]
    (wheel,) = wheels.glob("stapo-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True, timeout=300)
    env = {k: v for k, v in os.environ.items() if k != "STAPO_DATA_DIR"}
    env["PYTHONPATH"] = str(site)  # the wheel's stapo, not the editable one
    out = subprocess.run([sys.executable, "-c", _PROBE], cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["pkg"].startswith(str(site)) and res["data"].startswith(str(site))
    expected = {name: rows for name, (rows, _) in readme_table().items()}
    assert res["counts"] == {
        "aime24": expected["aime24.jsonl"], "aime25": expected["aime25.jsonl"], "amc23": expected["amc23.jsonl"],
        "math500": expected["math500.jsonl"], "minerva_math": expected["minerva_math.jsonl"],
        "olympiadbench": expected["olympiadbench.jsonl"], "gsm8k": expected["gsm8k_test.jsonl"],
        "dapo_math_17k": 17255,  # 17917 rows, 17255 distinct problem texts (README: near-duplicates)
    }


# ----------------------------------------------------------------------------- Dockerfile


def mapped_folders() -> set[str]:
    """Folders pyproject's ``package-dir`` maps to packages (``stapo_pkg``, ``cli``, ``core``, ...)."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return set(pyproject["tool"]["setuptools"]["package-dir"].values())


def dockerfile_stages(text: str) -> dict[str, list[str]]:
    """Stage name -> its instructions (continuation lines joined, comments dropped)."""
    stages: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in re.sub(r"\\\n", " ", text).splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r"(?i)FROM\s+\S+(?:\s+AS\s+(\S+))?", line)
        if m:
            current = stages.setdefault(m.group(1) or f"stage{len(stages)}", [])
            continue
        if current is not None:
            current.append(line)
    return stages


def copied_sources(instructions: list[str]) -> set[str]:
    """Context paths the stage COPYs (``COPY [--flags] SRC... DEST``; ``--from`` copies are not context)."""
    out: set[str] = set()
    for ins in instructions:
        if not re.match(r"(?i)(COPY|ADD)\s", ins):
            continue
        args = shlex.split(ins)[1:]
        if any(a.startswith("--from") for a in args):
            continue
        srcs = [a for a in args if not a.startswith("--")][:-1]
        out |= {s.rstrip("/").removeprefix("./") or "." for s in srcs}
    return out


def installs_project(instructions: list[str]) -> bool:
    """Whether a RUN pip-installs the project itself (``.`` or ``.[extras]``)."""
    return any(
        re.match(r"(?i)RUN\s", ins) and re.search(r"pip install[^&;|]*\s['\"]?\.(\[[^\]]*\])?['\"]?(\s|$)", ins)
        for ins in instructions
    )


def test_every_installing_stage_copies_every_mapped_folder() -> None:
    stages = dockerfile_stages((ROOT / "Dockerfile").read_text())
    installing = {name: ins for name, ins in stages.items() if installs_project(ins)}
    assert {"verifier", "trainer"} <= set(installing), f"stages that install the project: {sorted(installing)}"
    needed = mapped_folders() | {"pyproject.toml", "README.md"}  # README: pyproject's `readme`
    for name, ins in installing.items():
        copied = copied_sources(ins)
        if "." in copied:
            continue
        assert not needed - copied, f"stage {name!r} does not copy {sorted(needed - copied)}"


def test_dockerfile_check_catches_a_missing_folder() -> None:
    """The check above fails on the original bug: a verifier stage without `COPY configs`."""
    text = (ROOT / "Dockerfile").read_text()
    broken = dockerfile_stages(re.sub(r"(?m)^COPY configs .*\n", "", text, count=1))
    first = next(name for name, ins in broken.items() if installs_project(ins))
    assert "configs" in mapped_folders() - copied_sources(broken[first])


def _dockerignored(rel: str, patterns: list[str]) -> bool:
    """Docker's rule: the last matching pattern wins; a pattern also excludes everything below it."""
    ignored = False
    parts = rel.split("/")
    for pat in patterns:
        neg = pat.startswith("!")
        pat = pat.lstrip("!").strip("/")
        if any(fnmatch("/".join(parts[: i + 1]), pat) for i in range(len(parts))) or (
            pat.startswith("**/") and any(fnmatch(p, pat[3:]) for p in parts)
        ):
            ignored = not neg
    return ignored


def test_dockerignore_keeps_every_packaged_file() -> None:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]
    assert _dockerignored(".venv/bin/python", patterns) and _dockerignored("core/__pycache__/x.pyc", patterns)
    assert _dockerignored(".env", patterns)  # the compose token file never enters an image
    for f in tracked_files():
        rel = f.relative_to(ROOT).as_posix()
        if rel.split("/")[0] in mapped_folders() | {"pyproject.toml", "README.md"}:
            assert not _dockerignored(rel, patterns), rel


# ----------------------------------------------------------------------------- compose


def test_compose_requires_a_token_for_both_ends_and_probes_readiness() -> None:
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services = compose["services"]
    for name in ("verifier", "trainer"):
        token = services[name]["environment"]["STAPO_VERIFIER_TOKEN"]
        assert token.startswith("${STAPO_VERIFIER_TOKEN:?"), f"{name}: the token must be required"
    assert "/readyz" in " ".join(services["verifier"]["healthcheck"]["test"])
    assert services["trainer"]["depends_on"]["verifier"]["condition"] == "service_healthy"
    named = set(compose.get("volumes") or {})
    for name, svc in services.items():
        for vol in svc.get("volumes", []):
            host = vol.split(":")[0]
            assert host in named or (host.startswith("./") and ".." not in host), f"{name}: {vol}"
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"HEALTHCHECK[^\n]*\\\n[^\n]*/readyz", dockerfile), "the image's HEALTHCHECK probes /readyz"
