"""The GPU suite's wheel decision and budget, without a GPU and without the network.

What can fail here: a requirement the device meets is carried anyway (or one it does not meet is
left behind), the requirement is read from somewhere other than pyproject.toml, a wheel built for
another Python is taken for the device's, or a part runs although the budget cannot hold it. The
wheels themselves are downloaded and installed by tests/e2e/test_gpu_suite_dry.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet
from packaging.utils import parse_wheel_filename

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_wheels  # noqa: E402


@pytest.mark.parametrize("name,spec,keep", [
    ("transformers", ">=5.24,<5.25", False),     # the device has 5.17
    ("transformers", ">=5.16.1,<5.21", True),    # vLLM's range holds 5.17: nothing to carry
    ("torch", ">=2.4", True),                     # 2.11 on the device
    ("pebble", ">=5.1,<6", False),                # not on the device
    ("typer", ">=0.29,<0.30", False),             # on the device, version unknown, bounded: carried
    ("rich", ">=13", True),                       # version unknown, a lower bound only: the device's
    ("Huggingface_Hub", ">=1.0,<2", True),        # names are compared normalized; 1.33.0 there
])
def test_device_keeps(name, spec, keep):
    assert gpu_wheels.device_keeps(name, SpecifierSet(spec))[0] is keep


def test_requirements_come_from_pyproject():
    import tomllib

    proj = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = gpu_wheels.requirements(["train"])
    assert reqs == proj["dependencies"] + proj["optional-dependencies"]["train"]
    with pytest.raises(SystemExit, match="no extra 'nope'"):
        gpu_wheels.requirements(["nope"])


@pytest.mark.parametrize("wheel,python,fits", [
    ("pydantic_core-2.50.5-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl", "3.12", True),
    ("pydantic_core-2.50.5-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl", "3.11", False),
    ("multiprocess-0.70.19-py312-none-any.whl", "3.12", True),
    ("multiprocess-0.70.19-py312-none-any.whl", "3.11", False),
    ("pebble-5.2.3-py3-none-any.whl", "3.11", True),
    ("tokenizers-0.23.2-cp39-abi3-manylinux_2_17_x86_64.whl", "3.12", True),
    ("orjson-3.13.0-cp312-cp312-macosx_15_0_arm64.whl", "3.12", False),
])
def test_wheel_fits_python(wheel, python, fits):
    assert gpu_wheels._fits(parse_wheel_filename(wheel)[3], python) is fits


def test_every_part_skips_itself_when_the_budget_is_short(tmp_path):
    """A budget below every part's cost: nothing runs (no model, no part), each part says why."""
    out, work = tmp_path / "out", tmp_path / "work"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_suite.py"), "--dry-run", "--budget-s", "12",
                        "--out", str(out), "--work", str(work)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    report = json.loads((out / "results.json").read_text())
    import gpu_suite

    assert list(report["parts"]) == [x.name for x in gpu_suite.PARTS if x.default]
    for name, res in report["parts"].items():
        assert res["ok"] is None and res["skipped"].startswith("needs ~"), (name, res)
    assert "models" not in report  # a model is made only before a part that has the time to run
    assert sorted(f.name for f in out.iterdir()) == ["parts.log", "results.json"]


def test_the_wheels_get_64_mib_less_the_working_tree(tmp_path):
    """The device tool carries 64 MiB in all: the tracked files, untracked ones git does not ignore,
    and the carried paths. A repository of a 1 MiB tracked file, a 2 MiB untracked one and a 5 MiB
    ignored one (the wheel folder) leaves 61 MiB for the wheels."""
    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / ".gitignore").write_text(".whl/\n")
    (repo / "tracked.bin").write_bytes(b"\0" * 2**20)
    subprocess.run(["git", "-C", str(repo), "add", "tracked.bin", ".gitignore"], check=True)
    (repo / "notes.txt").write_bytes(b"x" * 2 * 2**20)
    (repo / ".whl").mkdir()
    (repo / ".whl" / "big.whl").write_bytes(b"\0" * 5 * 2**20)
    assert gpu_wheels.wheel_limit_bytes(repo) == 64 * 2**20 - 3 * 2**20 - len(".whl/\n")
    tracked = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, check=True).stdout
    size = sum((ROOT / f).lstat().st_size for f in tracked.decode().split("\0") if f and (ROOT / f).is_file())
    assert gpu_wheels.wheel_limit_bytes() <= 64 * 2**20 - size  # this checkout: the tracked tree at least
