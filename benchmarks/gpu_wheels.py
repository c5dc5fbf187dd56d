"""Which wheels a GPU machine needs for stapo, decided from pyproject.toml and the machine's package list.

The lent GPU machine (Python 3.12, x86-64, no package index) already holds torch, transformers,
triton and ~200 other packages (``DEVICE`` below). Whatever stapo (plus the ``train`` extra, and
``bench`` when the TRL side-by-side runs) needs beyond that travels as wheels in a folder that fits
what the device tool carries: 64 MiB in all for the working tree (tracked files and untracked ones
git does not ignore) and the carried paths, so the wheels get 64 MiB less the tree
(:func:`wheel_limit_bytes`; about 50 MiB with a 14 MiB tree). The decision is made per requirement, following each carried wheel's own ``Requires-Dist``:

- the device lacks the package: carry it;
- the device's version is known (``DEVICE``) and meets every specifier seen for it: keep the device's,
  else carry one that does (so widening stapo's transformers range to include 5.17 drops the 5.24 wheel);
- the device's version is unknown: keep it when the specifiers only set a lower bound (the image is
  built from current releases), carry when they set an upper bound or a pin.

A carried version is the one this tree is tested with (the running venv's) when it meets the
specifiers, else the newest that does. Wheels come from a cache folder outside git (downloaded once,
niced); DeepSpeed ships only a source archive and is built here with ``DS_BUILD_OPS=0`` (pure Python,
no op compiled).

    python benchmarks/gpu_wheels.py fetch --dest .whl [--extras train,bench]       # what gpu_wheels.sh runs
    python benchmarks/gpu_wheels.py standin --dest DIR --carried .whl               # dry run: a device stand-in
    python3.12 benchmarks/gpu_wheels.py imports --carried .whl                       # import every carried package

``standin`` builds, for the CPU dry run, a folder that holds what the device holds: the running venv's
copies of the device's packages (symlinked), with the device's own version installed instead where
it is known and differs (torch excepted: the CPU build stands in for the device's CUDA build), and
the carried wheels' cp311 twins for the binary ones (``--py311``), so the dry run runs on Python 3.11
with exactly the carried set's versions.
"""

from __future__ import annotations

import argparse
import email.parser
import os
import re
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The GPU machine's image (the device tool's KINDS.md, "Python packages already there", read on
# 2026-11-17; versions from its "pip list" row where one is given, None where none is). Python 3.12.3.
DEVICE_VERSIONS = {
    "accelerate": "1.15.0", "huggingface-hub": "1.33.0", "numpy": "2.5.2", "safetensors": "0.8.0",
    "tokenizers": "0.23.2", "torch": "2.11.0", "transformers": "5.17.0", "triton": "3.6.0",
    "sentencepiece": "0.2.2", "tiktoken": "0.14.0", "torchvision": "0.26.0", "torchaudio": "2.11.0",
}
DEVICE_NAMES = """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin
jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax
llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack
multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft
nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py
nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec
patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11
py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock
pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu
safetensors scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers
setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio
torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer
typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl
zipp""".split()
DEVICE_PYTHON = "3.12"
# The device's CUDA torch is replaced by this machine's CPU build in the stand-in, never by a wheel.
NOT_REPLACED = {"torch", "triton"}
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64"]
SOURCE_ONLY = {"deepspeed": {"DS_BUILD_OPS": "0"}}  # built here: name -> environment of the build
CACHE = Path(os.environ.get("STAPO_WHEEL_CACHE", Path.home() / ".cache" / "stapo-gpu-wheels"))
CARRY_MIB = 64  # the device tool's limit on one call's copy: the working tree plus the carried paths


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _req(text: str):
    from packaging.requirements import Requirement

    return Requirement(text)


def _env(python: str) -> dict[str, str]:
    """Marker environment of a CPython ``python`` (e.g. "3.12") on x86-64 Linux."""
    return {"python_version": python, "python_full_version": python + ".0", "sys_platform": "linux",
            "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
            "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}


def requirements(extras: list[str]) -> list[str]:
    """stapo's runtime requirements plus the named extras, from pyproject.toml."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    proj = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    out = list(proj["dependencies"])
    for e in extras:
        if e not in proj["optional-dependencies"]:
            raise SystemExit(f"--extras: pyproject has no extra {e!r}; it has {', '.join(proj['optional-dependencies'])}")
        out += proj["optional-dependencies"][e]
    return out


def device_keeps(name: str, spec) -> tuple[bool, str]:
    """(the device's own copy will do, why) for package ``name`` under SpecifierSet ``spec``."""
    n = norm(name)
    if n not in DEVICE_NAMES:
        return False, "not on the device"
    have = DEVICE_VERSIONS.get(n)
    if have is not None:
        ok = spec.contains(have, prereleases=True)
        return ok, f"device has {have}" + ("" if ok else f", needs {spec}")
    bounded = any(s.operator in ("<", "<=", "==", "===", "~=") for s in spec)
    return (not bounded), ("device version unknown, " + (f"bounded {spec}: carried" if bounded else "lower bound only"))


def _wheel_meta(path: Path) -> tuple[str, str, list[str]]:
    """(name, version, Requires-Dist lines) of a wheel file."""
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        msg = email.parser.Parser().parsestr(z.read(meta).decode())
    return msg["Name"], msg["Version"], msg.get_all("Requires-Dist") or []


def _fits(wheel_tags, python: str) -> bool:
    """A wheel with these tags installs on CPython ``python`` ("3.12") for x86-64 Linux."""
    ver = python.replace(".", "")
    for t in wheel_tags:
        interp_ok = t.interpreter in (f"cp{ver}", f"py{ver}") or re.fullmatch(r"py\d", t.interpreter) or (
            t.abi == "abi3" and t.interpreter.startswith("cp") and int(t.interpreter[2:]) <= int(ver))
        if interp_ok and t.abi in ("none", "abi3", f"cp{ver}") and (t.platform == "any" or "x86_64" in t.platform):
            return True
    return False


def _cached(name: str, spec, python: str) -> Path | None:
    """The newest cached wheel of ``name`` meeting ``spec`` that installs on CPython ``python``."""
    from packaging.utils import parse_wheel_filename

    best = None
    for p in CACHE.glob("*.whl"):
        wname, ver, _, wtags = parse_wheel_filename(p.name)
        if norm(wname) == norm(name) and spec.contains(str(ver), prereleases=True) and _fits(wtags, python):
            if best is None or ver > best[0]:
                best = (ver, p)
    return best[1] if best else None


def _pin(name: str, spec) -> str:
    """The requirement to download: this venv's version when it meets ``spec`` (tested here), else ``spec``."""
    try:
        v = metadata.version(name)
        if spec.contains(v, prereleases=True):
            return f"{name}=={v}"
    except metadata.PackageNotFoundError:
        pass
    return f"{name}{spec}"


def fetch_one(name: str, spec, python: str) -> Path:
    """One wheel of ``name`` meeting ``spec`` for CPython ``python`` (cache first, else download/build)."""
    hit = _cached(name, spec, python)
    if hit:
        return hit
    CACHE.mkdir(parents=True, exist_ok=True)
    want = _pin(name, spec)
    nice = ["nice", "-n", "10"]
    if norm(name) in SOURCE_ONLY:
        env = {**os.environ, **SOURCE_ONLY[norm(name)]}
        cmd = [*nice, sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(CACHE), want]
        done = subprocess.run(cmd, env=env, stderr=subprocess.PIPE, text=True)
    else:
        plat = [a for p in PLATFORMS for a in ("--platform", p)]
        cmd = [*nice, sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
               "--python-version", python, "--implementation", "cp", *plat, "-d", str(CACHE), want]
        done = subprocess.run(cmd, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise LookupError(f"gpu_wheels: no wheel of {want} for Python {python}: "
                          + " ".join(done.stderr.strip().splitlines()[-1:]))
    hit = _cached(name, spec, python)
    if hit is None:
        raise LookupError(f"gpu_wheels: pip fetched no wheel for {want} (Python {python})")
    return hit


def plan(extras: list[str]) -> tuple[dict[str, Path], list[str], dict[str, str | None]]:
    """(carried wheels by name, notes, the device's own packages relied on -> their version if known)."""
    from packaging.specifiers import SpecifierSet

    env = _env(DEVICE_PYTHON)
    specs: dict[str, SpecifierSet] = {}
    carried: dict[str, Path] = {}
    kept: dict[str, str | None] = {}
    notes: list[str] = []
    queue = [(r, "stapo") for r in requirements(extras)]
    while queue:
        text, parent = queue.pop(0)
        req = _req(text)
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        n = norm(req.name)
        specs[n] = specs.get(n, SpecifierSet()) & req.specifier
        if n in carried:
            _, ver, _ = _wheel_meta(carried[n])
            if not specs[n].contains(ver, prereleases=True):
                raise SystemExit(f"gpu_wheels: {n} {ver} is carried but {parent} needs {req.specifier}")
            continue
        keep, why = device_keeps(n, specs[n])
        if keep:
            kept[n] = DEVICE_VERSIONS.get(n)
            continue
        kept.pop(n, None)
        whl = fetch_one(req.name, specs[n], DEVICE_PYTHON)
        carried[n] = whl
        notes.append(f"{n}: {why} (for {parent})")
        for sub in _wheel_meta(whl)[2]:
            if "extra ==" not in sub and "extra==" not in sub:
                queue.append((sub, n))
    return carried, notes, kept


def tree_bytes(root: Path) -> int:
    """The bytes the device tool copies from the checkout besides the carried paths: tracked files and
    untracked files git does not ignore."""
    out = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         capture_output=True, check=True).stdout.decode()
    return sum((root / f).lstat().st_size for f in dict.fromkeys(out.split("\0")) if f and (root / f).is_file())


def wheel_limit_bytes(root: Path = ROOT) -> int:
    """What the carried wheels may hold: the device tool's 64 MiB less the working tree it copies too."""
    return CARRY_MIB * 2**20 - tree_bytes(root)


def cmd_fetch(args: argparse.Namespace) -> None:
    carried, notes, _ = plan(args.extras)
    dest = Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.whl"):
        old.unlink()
    total = 0
    for n in sorted(carried):
        shutil.copy2(carried[n], dest / carried[n].name)
        total += carried[n].stat().st_size
    for line in notes:
        print(f"  carry {line}")
    for n in sorted(carried):
        print(f"{carried[n].stat().st_size / 2**20:8.2f} MiB  {carried[n].name}")
    limit = wheel_limit_bytes()
    print(f"{total / 2**20:8.2f} MiB  total, {len(carried)} wheels in {dest} (limit {limit / 2**20:.1f} MiB: "
          f"{CARRY_MIB} MiB carried in all, less the {(CARRY_MIB * 2**20 - limit) / 2**20:.1f} MiB working tree)")
    if total > limit:
        raise SystemExit(f"gpu_wheels: {total / 2**20:.1f} MiB is over the {limit / 2**20:.1f} MiB the device carries "
                         f"beside this working tree ({CARRY_MIB} MiB in all)")


def _version(name: str) -> str | None:
    """This venv's version of ``name`` (None: not installed)."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _binary(whl: Path) -> bool:
    """The wheel is built for one Python (a cp312 extension, a py312-only package): the dry run needs its twin."""
    from packaging.utils import parse_wheel_filename

    return not _fits(parse_wheel_filename(whl.name)[3], "3.11")


def cmd_standin(args: argparse.Namespace) -> None:
    """Dry run: the device's packages (this venv's copies) in --dest; the carried set's cp311 twins in --py311."""
    from packaging.specifiers import SpecifierSet
    from packaging.utils import parse_wheel_filename

    dest = Path(args.dest)
    shutil.rmtree(dest, ignore_errors=True)  # its links are removed, not followed
    dest.mkdir(parents=True)
    carried = sorted(Path(args.carried).glob("*.whl"))
    carried_names = {norm(parse_wheel_filename(p.name)[0]) for p in carried}
    _, _, kept = plan(args.extras)
    replaced: dict[str, Path] = {}  # the device's version instead of the venv's
    unfetched: list[str] = []  # not on the index this machine reaches
    # the device's version of what stapo keeps, and of what those versions need in turn where the device's
    # version is known (transformers 5.17 kept -> the device's huggingface-hub, not the venv's newer one)
    todo = [(n, ver) for n, ver in kept.items() if ver is not None]
    while todo:
        n, ver = todo.pop()
        if n in NOT_REPLACED or n in replaced or f"{n}=={ver}" in unfetched or _version(n) in (ver, None):
            continue
        try:
            replaced[n] = fetch_one(n, SpecifierSet(f"=={ver}"), "3.11")
        except LookupError:
            unfetched.append(f"{n}=={ver}")
            continue
        for sub in _wheel_meta(replaced[n])[2]:
            req = _req(sub)
            dep = norm(req.name)
            if dep in DEVICE_VERSIONS and (req.marker is None or req.marker.evaluate(_env("3.11"))):
                todo.append((dep, DEVICE_VERSIONS[dep]))
    # what the device has and the venv lacks (pandas for TRL's datasets, say), with what it needs
    queue, added = [n for n, v in kept.items() if _version(n) is None], {}
    while queue:
        n = queue.pop()
        if n in added or n in replaced or n in carried_names or _version(n) is not None:
            continue
        ver = DEVICE_VERSIONS.get(n)
        try:
            added[n] = fetch_one(n, SpecifierSet(f"=={ver}" if ver else ""), "3.11")
        except LookupError:
            unfetched.append(n)
            continue
        for sub in _wheel_meta(added[n])[2]:
            req = _req(sub)
            if req.marker is None or req.marker.evaluate(_env("3.11")):
                queue.append(norm(req.name))
    site = Path(metadata.distribution("pip").locate_file(""))
    linked = set()
    for dist in metadata.distributions():
        n = norm(dist.metadata["Name"])
        if n not in DEVICE_NAMES or n in replaced or n in carried_names or n in linked:
            continue
        linked.add(n)
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops:
            src, dst = site / top, dest / top
            if src.exists() and not dst.exists() and top not in ("bin", "__pycache__"):
                dst.symlink_to(src)
    if replaced or added:
        _pip_target(sys.executable, dest, [*replaced.values(), *added.values()])
    py311 = []
    for whl in carried:
        name, ver, _, _ = parse_wheel_filename(whl.name)
        py311.append(fetch_one(name, SpecifierSet(f"=={ver}"), "3.11") if _binary(whl) else whl)
    Path(args.py311).mkdir(parents=True, exist_ok=True)
    for old in Path(args.py311).glob("*.whl"):
        old.unlink()
    for w in py311:
        shutil.copy2(w, Path(args.py311) / w.name)
    print(f"stand-in {dest}: {len(linked)} device packages from this venv, device versions of "
          f"{', '.join(f'{n}=={kept.get(n) or DEVICE_VERSIONS[n]}' for n in sorted(replaced)) or 'none'}, "
          f"from the index: {', '.join(sorted(added)) or 'none'}"
          f"{'; not on the index here (the venv has its own, or none): ' + ', '.join(unfetched) if unfetched else ''}; "
          f"cp311 twins of {sum(_binary(w) for w in carried)} binary wheels in {args.py311}")


def _pip_target(python: str, target: Path, wheels: list[Path]) -> None:
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--upgrade", "--target", str(target), *map(str, wheels)], check=True)


def _foreign_binaries(folder: Path) -> set[str]:
    """Top-level names in ``folder`` holding extension modules built for another Python than this one."""
    mine = f"cpython-{sys.version_info.major}{sys.version_info.minor}-"
    out = set()
    for top in folder.iterdir():
        sos = [top] if top.is_file() else top.rglob("*.so") if top.is_dir() else []
        if any(".cpython-" in s.name and mine not in s.name for s in sos):
            out.add(top.name.split(".")[0])
    return out


def _blames(err: BaseException, roots: set[str]) -> str | None:
    """The first of ``roots`` the failed import went through (its traceback or the missing module's name)."""
    while err is not None:
        name = (getattr(err, "name", None) or "").split(".")[0]
        if name in roots:
            return name
        tb = err.__traceback__
        while tb is not None:
            parts = Path(tb.tb_frame.f_code.co_filename).parts
            hit = next((r for r in roots if r in parts), None)
            if hit:
                return hit
            tb = tb.tb_next
        err = err.__cause__ or err.__context__
    return None


def cmd_imports(args: argparse.Namespace) -> None:
    """Import every top-level module of the carried wheels (run by the device's Python version).

    A module whose import goes through a package this interpreter cannot load here (the stand-in's
    binary packages, torch among them, exist on this machine only for the venv's Python) is listed,
    not failed: the dry run imports it on that Python with the cp311 twins."""
    import importlib

    absent = _foreign_binaries(Path(args.standin)) if args.standin else set()
    failed, deferred, n_ok = [], [], 0
    todo: list[tuple[str, str]] = [(m, "stapo") for m in args.modules.split(",") if m]
    for whl in sorted(Path(args.carried).glob("*.whl")):
        with zipfile.ZipFile(whl) as z:
            names = z.namelist()
            tops = next((z.read(n).decode().split() for n in names if n.endswith(".dist-info/top_level.txt")), None)
        if tops is None:
            tops = sorted({n.split("/")[0].removesuffix(".py") for n in names if "/" in n or n.endswith(".py")}
                          - {n.split("/")[0] for n in names if n.split("/")[0].endswith((".dist-info", ".data"))})
        todo += [(mod, whl.name) for mod in tops
                 if mod and not mod.startswith("_") and not mod.endswith((".dist-info", ".data"))]
    for mod, origin in todo:
        try:
            importlib.import_module(mod)
            n_ok += 1
        except Exception as err:  # noqa: BLE001 - report every broken import, then fail
            root = _blames(err, absent)
            (deferred if root else failed).append(f"{mod} ({origin}): " + (f"goes through {root}" if root
                                                                          else f"{type(err).__name__}: {err}"))
    print(f"imports (Python {sys.version.split()[0]}): {n_ok} modules (stapo's, and the carried wheels' "
          "top-level ones) imported; "
          f"{len(deferred)} go through a binary package built here only for another Python: "
          + ", ".join(d.split(" (")[0] for d in deferred))
    if failed:
        raise SystemExit("gpu_wheels: carried modules that do not import:\n  " + "\n  ".join(failed))


def cmd_check(args: argparse.Namespace) -> None:
    """On the device, after the install: every requirement of stapo (and its extras) met, or say which not."""
    bad = []
    for text in requirements(args.extras):
        req = _req(text)
        if req.marker is not None and not req.marker.evaluate():
            continue
        try:
            have = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            bad.append(f"{req.name}: missing (needs {req.specifier or 'any'})")
            continue
        if not req.specifier.contains(have, prereleases=True):
            bad.append(f"{req.name}: {have} does not meet {req.specifier}")
    print("requirements: " + ("all met" if not bad else "NOT MET: " + "; ".join(bad)))
    if bad:
        raise SystemExit(1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("fetch", "standin", "imports", "check"):
        s = sub.add_parser(name)
        s.add_argument("--extras", default="train", type=lambda s: [e for e in s.split(",") if e])
        if name in ("fetch", "standin"):
            s.add_argument("--dest", required=True)
        if name in ("standin", "imports"):
            s.add_argument("--carried", required=True)
        if name == "standin":
            s.add_argument("--py311", required=True, help="folder for the carried set with cp311 binary wheels")
        if name == "imports":
            s.add_argument("--standin", default="", help="the stand-in folder on the path (its foreign binaries)")
            s.add_argument("--modules", default="stapo.verifier_service.server.app,stapo.verifier_service.server.pool,"
                           "stapo.core.task.rewards,stapo.cli.main", help="stapo modules imported first")
    args = p.parse_args()
    try:
        {"fetch": cmd_fetch, "standin": cmd_standin, "imports": cmd_imports, "check": cmd_check}[args.cmd](args)
    except LookupError as err:  # a wheel pip could not find: one line, not a traceback
        raise SystemExit(str(err)) from None


if __name__ == "__main__":
    main()
