"""A run directory belongs to one run: its lock, one name for every rank, and how a signal stops it.

* **The lock** (:func:`lock_run_dir`): ``RUN/.lock`` is held with the OS's advisory lock
  (``flock``) for the whole run and names its holder (host, pid, start time). A second ``stapo
  train`` or ``--resume`` into the dir is refused with the holder's name. The kernel drops the lock
  when its process dies, however it dies, so a ``kill -9`` never blocks the next run: that run takes
  the lock over and says whose it was. Released, the file is removed. Under a launcher only rank 0
  takes it. On NFS, ``flock`` is carried by NFS byte-range locks (Linux >= 2.6.12), so ranks and
  runs on other nodes see it too.
* **Ownership** (:func:`owned`, :class:`RunDirOwner`): ``stapo train`` holds the lock and handles
  SIGTERM like Ctrl-C for its whole run. A run that fails before its first step removes what it
  added (a dir it made and left empty is removed too); one interrupted there keeps ``config.yaml``,
  so that ``--resume --fresh`` starts it again with the same config. :func:`stop_report` is what a
  stopped run says: where it stopped, its last checkpoint and the command that continues it.
* **One name** (:func:`default_run_dir`, :func:`agree_run_dir`): under a launcher every rank names a default run dir from its
  own clock (``runs/<algorithm>-<time>``); rank 0's name wins, broadcast over the process group
  before any rank writes a file; :func:`open_run_dir` then creates it and writes ``config.yaml``.
  Rank 0 then writes a token file there and every rank reads it back: a rank that does not see it
  (a multi-node launch whose nodes do not share the run dir's filesystem) stops the run at start,
  naming the ranks and hosts, not at the first checkpoint whose shards would land elsewhere.
* **Signals** (:class:`Stopped`, :func:`stop_at_step_boundary`): SIGTERM (Slurm, Kubernetes,
  ``docker stop``) is handled like Ctrl-C, with exit status 143. While the loop runs steps and
  ``checkpoint.on_signal`` is on, the signal only raises a flag; at the next step boundary every rank
  agrees on it (a sum over ranks: a signal that reached one rank stops all of them at the same
  step), a checkpoint is written and the run stops. Elsewhere (start-up, validation, export) it
  stops the process at once, like Ctrl-C.
* **The record** (:func:`resume_config_data`, :func:`record_config_changes`,
  :func:`read_config_changes`): ``RUN/config.yaml`` is the config the run started with and stays so.
  A ``--resume`` that changes the config writes one row to ``RUN/config_changes.jsonl``: the step
  the changes take effect (the checkpoint's step + 1) and each changed key with its old and new
  value. The config a resume continues from is ``config.yaml`` with those rows replayed in order.
  Keys in :data:`BOOKKEEPING_KEYS` (how long the run goes, logging, checkpoint cadence, where the
  verifier lives) change nothing the run learns: ``stapo train`` resumes with them at once; any
  other change needs ``--allow-changes``, and a change the resumed run would not use is refused
  (:func:`unappliable_changes`: a checkpoint that fixes the value, with why).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import shlex
import shutil
import signal
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stapo.core.config import save_config
from stapo.core.fairness import config_differences, owned_by
from stapo.core.tracking import read_jsonl
from stapo.core.train.checkpoint import checkpoint_step, latest_checkpoint, list_checkpoints

__all__ = [
    "LOCK_NAME", "RunDirBusy", "RunLock", "check_not_busy", "lock_run_dir", "RunDirOwner", "owned", "holds_run",
    "default_run_dir", "agree_run_dir", "open_run_dir", "SharedDirError", "Stopped", "stop_report",
    "install_signal_handlers", "stop_at_step_boundary", "stop_at_once", "stop_requested",
    "CHANGES_NAME", "BOOKKEEPING_KEYS", "FIXED_AT_START", "unappliable_changes", "ConfigChange", "config_changes", "resume_config_data",
    "record_config_changes", "read_config_changes", "describe_config_changes",
]

LOCK_NAME = ".lock"
_TOKEN_NAME = ".rank0-token"


class RunDirBusy(Exception):
    """Another live process holds the run dir's lock."""


class SharedDirError(Exception):
    """Some rank does not see rank 0's run dir (the nodes do not share its filesystem)."""


# ----------------------------------------------------------------------------- the lock


def _describe(holder: dict[str, Any]) -> str:
    started = holder.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, int | float) else "?"
    return f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}, started {when}"


def _read_holder(fd: int) -> dict[str, Any]:
    os.lseek(fd, 0, os.SEEK_SET)
    raw = os.read(fd, 4096)
    try:
        holder = json.loads(raw) if raw.strip() else {}
    except ValueError:
        return {"pid": "?", "host": "?"}  # torn by a crash mid-write: still a previous holder
    return holder if isinstance(holder, dict) else {}


def _busy(run_dir: Path, holder: dict[str, Any]) -> RunDirBusy:
    return RunDirBusy(
        f"{run_dir} is in use by another run ({_describe(holder)}); wait for it to end or pick another --run-dir"
    )


def check_not_busy(run_dir: Path) -> None:
    """Raise :class:`RunDirBusy` when a live process holds ``run_dir``'s lock (nothing is written)."""
    try:
        fd = os.open(Path(run_dir) / LOCK_NAME, os.O_RDONLY)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise _busy(run_dir, _read_holder(fd)) from None
    finally:
        os.close(fd)  # (also drops the probe's shared lock)


@dataclass
class RunLock:
    """A held run-dir lock. ``previous`` describes a dead holder this lock took over (None: none)."""

    path: Path
    fd: int
    previous: str | None = None

    def release(self) -> None:
        """Remove the lock file, then drop the lock (in this order: see :func:`lock_run_dir`)."""
        if self.fd < 0:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        os.close(self.fd)
        self.fd = -1


def lock_run_dir(run_dir: Path) -> RunLock:
    """Take ``RUN/.lock`` (creating ``run_dir``) or raise :class:`RunDirBusy` naming its holder.

    The lock lives on the open file, not on the name: a holder that releases removes the file while
    it still holds the lock, so a process that opened the old file before the removal finds, once
    it gets the lock, that the name now points elsewhere (or nowhere) and opens it again.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_NAME
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise _busy(run_dir, holder) from None
        try:
            current = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            current = False
        if current:
            break
        os.close(fd)
    holder = _read_holder(fd)  # a holder that never released: it died (a live one would hold the lock)
    me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, (json.dumps(me) + "\n").encode())
    os.fsync(fd)
    return RunLock(path, fd, _describe(holder) if holder else None)


# ----------------------------------------------------------------------------- ownership and clean-up


def holds_run(run_dir: Path) -> bool:
    """A run dir with metrics or a checkpoint: a new run there would mix with it."""
    return (Path(run_dir) / "metrics.jsonl").exists() or bool(list_checkpoints(run_dir))


class RunDirOwner:
    """What this process owns in its run dir: what it removes when the run fails before its first step.

    Under a launcher only rank 0 takes the lock and cleans up (the other ranks write only checkpoint
    shards, which exist only after a step). ``previous`` describes a dead holder whose lock this run
    took over (None: none)."""

    def __init__(self, run_dir: Path, rank0: bool) -> None:
        self.run_dir, self.rank0 = Path(run_dir), rank0
        self.previous: str | None = None
        self.created = not self.run_dir.exists()
        self.before = set() if self.created else {p.name for p in self.run_dir.iterdir()}
        ckpt = latest_checkpoint(self.run_dir)
        self.start = checkpoint_step(ckpt) if ckpt is not None else 0  # the step this run starts after
        record = self.run_dir / CHANGES_NAME
        self.record = record.read_bytes() if record.is_file() else None  # restored when no step ran

    def clean_up(self, *, keep_config: bool = False) -> None:
        """When no step finished: remove what this run added (``config.yaml`` kept for an
        interrupted run, so that ``--resume --fresh`` starts it again with the same config). A
        failed start puts the record of config changes back as it was (its changes never ran); an
        interrupted one keeps this resume's row, so the printed ``--resume`` goes on with them."""
        rows = read_jsonl(self.run_dir / "metrics.jsonl")
        if not self.rank0 or not self.run_dir.is_dir() or (rows and int(rows[-1]["step"]) > self.start):
            return
        keep = self.before | {LOCK_NAME} | ({"config.yaml", CHANGES_NAME} if keep_config else set())
        for p in self.run_dir.iterdir():
            if p.name not in keep:
                shutil.rmtree(p) if p.is_dir() else p.unlink()
        if self.record is not None and not keep_config:
            (self.run_dir / CHANGES_NAME).write_bytes(self.record)


@contextlib.contextmanager
def owned(run_dir: Path, *, rank0: bool | None = None) -> Iterator[RunDirOwner]:
    """Hold the run dir's lock (rank 0: ``RANK`` 0 unless ``rank0`` says) and handle SIGTERM like
    Ctrl-C while the block runs; a run dir this made and left empty is removed at the end. Raises
    :class:`RunDirBusy` (nothing taken) when another live run holds the dir."""
    rank0 = int(os.environ.get("RANK", "0")) == 0 if rank0 is None else rank0
    owner = RunDirOwner(run_dir, rank0)
    lock = None
    if owner.rank0:
        lock = lock_run_dir(run_dir)
        owner.previous = lock.previous
    previous = install_signal_handlers()
    try:
        yield owner
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if lock is not None:
            lock.release()
            if owner.created and owner.run_dir.is_dir() and not any(owner.run_dir.iterdir()):
                owner.run_dir.rmdir()


# ----------------------------------------------------------------------------- one name for all ranks


def default_run_dir(algorithm: str) -> Path:
    """``runs/<algorithm>-<time>``: the run dir a rank names when none is given (from its own clock:
    under a launcher rank 0's name is the run's, :func:`agree_run_dir`)."""
    return Path("runs") / f"{algorithm}-{time.strftime('%Y%m%d-%H%M%S')}"



def agree_run_dir(run_dir: Path, dp: Any) -> Path:
    """Rank 0's ``run_dir`` on every rank, checked to be the same folder everywhere.

    ``dp`` is a :class:`stapo.core.trainer.distributed.DataParallel`; with one rank this returns
    ``run_dir`` and touches nothing. Every rank calls it (two object gathers). Rank 0 writes a
    random token into the dir first and removes it after; a rank that cannot read it back is named
    in the :class:`SharedDirError` every rank raises.
    """
    if not dp.multi:
        return Path(run_dir)
    token = ""
    if dp.rank == 0:
        token = secrets.token_hex(16)
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        (Path(run_dir) / _TOKEN_NAME).write_text(token)
    name, token = dp.gather_objects((str(run_dir), token))[0]
    run_dir = Path(name)
    try:
        seen = (run_dir / _TOKEN_NAME).read_text() == token
    except OSError:
        seen = False
    views = dp.gather_objects((seen, socket.gethostname()))
    if dp.rank == 0:
        with contextlib.suppress(FileNotFoundError):
            (run_dir / _TOKEN_NAME).unlink()
    blind = [f"rank {r} on {host}" for r, (ok, host) in enumerate(views) if not ok]
    if blind:
        raise SharedDirError(
            f"{', '.join(blind)} cannot see the run dir {run_dir} that rank 0 ({views[0][1]}) writes: every rank "
            "writes its checkpoint shards there, so put --run-dir on a filesystem all nodes share (the same path "
            "on each)"
        )
    return run_dir


def open_run_dir(run_dir: Path, cfg: Any, *, resume: bool, main: bool) -> Path | None:
    """The loop's start in its (agreed) run dir: the checkpoint a resume continues from (None: the
    run starts at step 0). Rank 0 (``main``) creates the dir and writes ``config.yaml``; a resume
    keeps the run's first config (what changed is the record's: :func:`record_config_changes`)."""
    ckpt = latest_checkpoint(run_dir) if resume else None
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
        if ckpt is None or not (run_dir / "config.yaml").is_file():
            save_config(cfg, run_dir / "config.yaml")
    return ckpt


# ----------------------------------------------------------------------------- signals


class Stopped(KeyboardInterrupt):
    """The run was stopped by a signal; a KeyboardInterrupt so every Ctrl-C cleanup path runs for it.

    ``checkpointed``: the loop wrote a checkpoint at the step boundary where it stopped.
    """

    def __init__(self, signum: int, *, checkpointed: bool = False) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.checkpointed = checkpointed

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class _State:
    deferring = False
    pending: int | None = None


_STATE = _State()


def _on_signal(signum: int, frame: Any) -> None:
    if _STATE.deferring and _STATE.pending is None:
        _STATE.pending = signum  # the loop stops at the next step boundary
        return
    raise Stopped(signum)  # outside the steps, or a second signal: stop now


def install_signal_handlers() -> Any:
    """SIGTERM stops the process like Ctrl-C (as :class:`Stopped`); returns the handler it replaced
    (to give back with ``signal.signal``), or None off the main thread, where nothing changes."""
    if threading.current_thread() is threading.main_thread():
        return signal.signal(signal.SIGTERM, _on_signal)
    return None


def stop_at_step_boundary(enabled: bool) -> None:
    """From now on a SIGTERM waits for :func:`stop_requested` (the loop's step boundary) when
    ``enabled``; :func:`stop_at_once` ends that."""
    _STATE.deferring, _STATE.pending = enabled, None


def stop_at_once() -> None:
    """A SIGTERM stops the process at once again (the steps are over)."""
    _STATE.deferring = False


def stop_requested(dp: Any) -> int | None:
    """The signal that asked this run to stop, agreed by every rank (all ranks call it every step)."""
    local = _STATE.pending
    if not dp.multi:
        return local
    return signal.SIGTERM if dp.total(1.0 if local is not None else 0.0) > 0 else None


def stop_report(run_dir: Path, err: KeyboardInterrupt, max_steps: int, checkpoint_every: int) -> list[str]:
    """What a run stopped by Ctrl-C or SIGTERM (``err``) says, line by line: where it stopped, its
    last checkpoint and the command that continues it (only files that exist are named)."""
    metrics = Path(run_dir) / "metrics.jsonl"
    rows = read_jsonl(metrics)
    done = int(rows[-1]["step"]) if rows else 0
    what = f"stopped by {err}" if isinstance(err, Stopped) else "interrupted"
    if isinstance(err, Stopped) and err.checkpointed:
        where = f"after step {done} of {max_steps}"
    elif done == 0:
        where = "before the first step finished"
    else:
        where = f"during step {done + 1} of {max_steps}" if done < max_steps else "after the last step"
    files = f" (metrics: {metrics})" if metrics.exists() else ""
    lines = [f"{what} {where}; {done} step(s) done{files}"]
    ckpt = latest_checkpoint(run_dir)
    quoted = shlex.quote(str(run_dir))
    if ckpt is not None:
        lines += [f"last checkpoint: {ckpt}", f"resume with: stapo train --run-dir {quoted} --resume"]
    elif (Path(run_dir) / "config.yaml").is_file():
        every = checkpoint_every
        when = f"checkpoint.every={every} writes one every {every} steps" if every else (
            "checkpoint.every=0 writes one only at the end")
        lines += [f"no checkpoint yet ({when})", f"start it over with: stapo train --run-dir {quoted} --resume --fresh"]
    else:
        lines.append(f"nothing was kept in {run_dir}; run the same command to start again")
    return lines


# ----------------------------------------------------------------------------- the record of config changes

CHANGES_NAME = "config_changes.jsonl"

#: Keys a resume may change without ``--allow-changes`` (a trailing "." = the whole section): they
#: decide how long the run goes, what it logs, when it checkpoints and where services live, not what
#: it learns. Every other key (learning rate, method, batch, lengths, sampler, grader, backend,
#: micro-batching...) changes the run's numbers. Such changes are still recorded.
BOOKKEEPING_KEYS: tuple[str, ...] = (
    "trainer.max_steps", "logging.", "checkpoint.", "eval.every", "reward.urls", "reward.token",
    "reward.workers", "reward.retries", "reward.max_failure_frac", "trainer.dist_timeout_s",
    "trainer.gpu_memory_gib", "model.cache_dir", "rollout.server.urls", "rollout.server.timeout_s",
    "rollout.server.retries",
)


_SAME_MODEL = ("the checkpoint holds the weights of the model the run started from; train the other model "
               "in a new run (its model.name_or_path can be this run's final/ export)")

#: Keys a resume cannot change (a trailing "." = the whole section), each with why: the checkpoint
#: fixes what they decide. Every other key is read from the config when the run is built, or put
#: back after the checkpoint loads (the optimizer's settings and LR schedule:
#: ``stapo.core.trainer.base.apply_optimizer_settings``; the Goldilocks teacher's learning rate), so
#: the resumed run uses the new value from the step the record names.
FIXED_AT_START: dict[str, str] = {
    "model.name_or_path": _SAME_MODEL,
    "model.gguf_file": _SAME_MODEL,
    "model.tiny.": _SAME_MODEL,
    "trainer.backend": "a checkpoint loads into the backend that wrote it (torch: one state file; deepspeed: "
                       "ZeRO shards)",
    "trainer.zero_stage": "DeepSpeed loads ZeRO shards at the stage that wrote them",
    "trainer.offload_optimizer": "loading the optimizer state onto the other side of the offload is not "
                                 "checked by any test here",
    "data.goldilocks.teacher": "the checkpoint holds the Goldilocks teacher the run started with",
    "data.goldilocks.hidden_size": "the checkpoint holds the Goldilocks teacher at its first shape",
    "data.goldilocks.num_features": "the checkpoint holds the Goldilocks teacher at its first shape",
}

#: Fixed only while STARE's schedule adapts: (W, M) then continue from the checkpoint's values.
_STARE_SCHEDULE = ("algorithm.stare.w", "algorithm.stare.m")


def unappliable_changes(changes: list[ConfigChange], new: dict[str, Any]) -> list[str]:
    """One line per change in ``changes`` that a resume cannot apply, naming the key and why.

    ``new``: the resumed config's nested dump (whether STARE's schedule adapts decides two keys)."""
    lines = [f"{c} ({FIXED_AT_START[k]})" for c in changes
             for k in FIXED_AT_START if owned_by(c.key, (k,))]
    adaptive = bool(new.get("algorithm", {}).get("stare", {}).get("adaptive"))
    if adaptive:
        lines += [f"{c} (STARE's adaptive schedule continues W and M from the checkpoint; its initial values "
                  "apply at step 0 only)" for c in changes if c.key in _STARE_SCHEDULE]
    return lines


@dataclass(frozen=True)
class ConfigChange:
    """One config key a resume changed: ``old`` -> ``new`` (values as saved in ``config.yaml``)."""

    key: str
    old: Any
    new: Any

    @property
    def bookkeeping(self) -> bool:
        return owned_by(self.key, BOOKKEEPING_KEYS)

    def __str__(self) -> str:
        return f"{self.key} {_show(self.old)} -> {_show(self.new)}"


def _show(value: Any) -> str:
    return json.dumps(value) if isinstance(value, str | list | tuple | dict) or value is None else str(value)


def config_changes(before: dict[str, Any], after: dict[str, Any]) -> list[ConfigChange]:
    """Every key whose value differs between two config dumps (nested, as ``config.yaml``), by key."""
    return [ConfigChange(d.key, d.base, d.other) for d in config_differences(before, after)]


def read_config_changes(run_dir: Path) -> list[dict[str, Any]]:
    """The rows of ``RUN/config_changes.jsonl``, oldest first (no file: none).

    Each row: ``{"step": S, "time": unix seconds, "changes": [{"key", "old", "new", "bookkeeping"}]}``,
    S being the first step run with the changed values. ``stapo inspect`` and ``stapo compare`` show them.
    """
    return read_jsonl(Path(run_dir) / CHANGES_NAME)


def describe_config_changes(run_dir: Path, *, up_to: int | None = None, bookkeeping: bool = True) -> list[str]:
    """One line per recorded resume: ``from step 4: trainer.lr 1e-06 -> 0.5, ...`` (empty: none).

    ``up_to``: only the changes in effect at that step; ``bookkeeping=False``: only changes to
    what the run learns (not :data:`BOOKKEEPING_KEYS`)."""
    lines = []
    for row in read_config_changes(run_dir):
        if up_to is not None and int(row["step"]) > up_to:
            continue
        changes = [ConfigChange(c["key"], c.get("old"), c.get("new")) for c in row.get("changes", [])
                   if bookkeeping or not c.get("bookkeeping")]
        if changes:
            lines.append(f"from step {row['step']}: " + ", ".join(map(str, changes)))
    return lines


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    *sections, last = key.split(".")
    node = data
    for part in sections:
        nxt = node.get(part)
        if not isinstance(nxt, dict):
            nxt = node[part] = {}
        node = nxt
    node[last] = value


def resume_config_data(run_dir: Path, step: int) -> dict[str, Any]:
    """The config (nested dict) a resume from the checkpoint of ``step`` continues with.

    ``config.yaml`` with every recorded row up to ``step + 1`` replayed: the rows up to ``step`` ran
    and the checkpoint holds their effect; a row at ``step + 1`` belongs to a resume that was stopped
    before its next checkpoint, and its command's ``--resume`` goes on with those values.
    """
    import yaml

    data = yaml.safe_load((Path(run_dir) / "config.yaml").read_text(encoding="utf-8")) or {}
    for row in read_config_changes(run_dir):
        if int(row["step"]) <= step + 1:
            for change in row.get("changes", []):
                _set_dotted(data, change["key"], change.get("new"))
    return data


def record_config_changes(run_dir: Path, step: int, new: dict[str, Any]) -> list[ConfigChange]:
    """Record that the run continues from step ``step + 1`` with config ``new`` (a nested dump).

    The row holds ``new`` against the config that ran step ``step``; it replaces any row from an
    earlier resume of the same checkpoint (and rows past it, which that checkpoint does not cover).
    No change: no row. Written whole to a temporary file and renamed, so a reader never sees it torn.
    """
    run_dir = Path(run_dir)
    rows = [r for r in read_config_changes(run_dir) if int(r["step"]) <= step]
    before = resume_config_data(run_dir, step - 1)  # config.yaml + the rows up to ``step``
    changes = config_changes(before, new)
    if changes:
        rows.append({"step": step + 1, "time": time.time(), "changes": [
            {"key": c.key, "old": c.old, "new": c.new, "bookkeeping": c.bookkeeping} for c in changes]})
    path = run_dir / CHANGES_NAME
    if not rows:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        return changes
    tmp = run_dir / f".{CHANGES_NAME}.tmp"
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    tmp.replace(path)
    return changes
