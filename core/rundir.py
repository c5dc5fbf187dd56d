"""A run directory belongs to one run: its lock, one name for every rank, and how a signal stops it.

* **The lock** (:func:`lock_run_dir`): ``RUN/.lock`` is held with the OS's advisory lock
  (``flock``) for the whole run and names its holder (host, pid, start time). A second ``stapo
  train`` or ``--resume`` into the dir is refused with the holder's name. The kernel drops the lock
  when its process dies, however it dies, so a ``kill -9`` never blocks the next run: that run takes
  the lock over and says whose it was. Released, the file is removed. Under a launcher only rank 0
  takes it. On NFS, ``flock`` is carried by NFS byte-range locks (Linux >= 2.6.12), so ranks and
  runs on other nodes see it too.
* **One name** (:func:`agree_run_dir`): under a launcher every rank names a default run dir from its
  own clock; rank 0's name wins, broadcast over the process group before any rank writes a file.
  Rank 0 then writes a token file there and every rank reads it back: a rank that does not see it
  (a multi-node launch whose nodes do not share the run dir's filesystem) stops the run at start,
  naming the ranks and hosts, not at the first checkpoint whose shards would land elsewhere.
* **Signals** (:class:`Stopped`, :func:`stop_at_step_boundary`): SIGTERM (Slurm, Kubernetes,
  ``docker stop``) is handled like Ctrl-C, with exit status 143. While the loop runs steps and
  ``checkpoint.on_signal`` is on, the signal only raises a flag; at the next step boundary every rank
  agrees on it (a sum over ranks: a signal that reached one rank stops all of them at the same
  step), a checkpoint is written and the run stops. Elsewhere (start-up, validation, export) it
  stops the process at once, like Ctrl-C.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import signal
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "LOCK_NAME", "RunDirBusy", "RunLock", "check_not_busy", "lock_run_dir", "agree_run_dir", "SharedDirError", "Stopped",
    "install_signal_handlers", "stop_at_step_boundary", "stop_at_once", "stop_requested",
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


# ----------------------------------------------------------------------------- one name for all ranks


def agree_run_dir(run_dir: Path, dp: Any) -> Path:
    """Rank 0's ``run_dir`` on every rank, checked to be the same folder everywhere.

    ``dp`` is a :class:`stapo.core.distributed.DataParallel`; with one rank this returns
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
