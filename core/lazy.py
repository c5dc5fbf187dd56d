"""A name -> ``"module:Class"`` registry whose targets are imported only when used.

Why: heavy optional backends (vLLM, DeepSpeed) must not be imported by ``import stapo``; configs
name them by string, so a typo must list the valid names and a second registration of a name must
fail instead of silently winning. Rollout engines and trainer backends both register here.

    ENGINES = LazyRegistry("rollout engine", {"hf": "stapo.core.rollout.hf:HFRolloutEngine"})
    ENGINES.add("mine", "my_pkg.engine:MyEngine")
    ENGINES.load("hf")   # imports stapo.core.rollout.hf and returns the class

The same backends' known noise lives here too: :func:`quiet_known_noise` filters the log lines of
:data:`KNOWN_NOISE` (``stapo`` commands and :meth:`stapo.core.train.run.Run.build` call it, so a run
built from Python prints what the command prints), and :func:`no_progress_bars` holds transformers'
progress bars off around a library call whose bar says nothing (writing a one-shard export).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Iterator, Mapping


class LazyRegistry(dict[str, str]):
    """A dict of name -> "module:Class" targets with checked registration and lazy loading."""

    def __init__(self, kind: str, targets: Mapping[str, str], *, hints: Mapping[str, str] | None = None) -> None:
        super().__init__()
        self.kind = kind
        self.hints = dict(hints or {})  # name -> how to install what it needs
        for name, target in targets.items():
            self.add(name, target)

    def add(self, name: str, target: str) -> None:
        """Register ``name -> "module:Class"``; a taken name is an error."""
        if name in self:
            raise ValueError(f"{self.kind} {name!r} is already registered ({self[name]})")
        if target.count(":") != 1:
            raise ValueError(f"{self.kind} target must look like 'package.module:Class', got {target!r}")
        self[name] = target

    def load(self, name: str) -> type:
        """Import and return the class registered as ``name`` (a miss lists the valid names)."""
        if name not in self:
            raise KeyError(f"unknown {self.kind} {name!r}; valid names: {', '.join(sorted(self))}")
        module_name, attr = self[name].split(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            hint = f" ({self.hints[name]})" if name in self.hints else ""
            raise ImportError(f"{self.kind} {name!r} needs {err.name or err}{hint}") from err
        return getattr(module, attr)


class _DropMessages:
    """A ``logging`` filter that drops records whose message starts with one of ``prefixes``."""

    def __init__(self, prefixes: tuple[str, ...]) -> None:
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefixes)


# Library messages that say nothing to a stapo user, by logger name (not ours to fix, so filtered):
# on the torch backend DeepSpeed is imported only for its helpers (checkpoint/export code paths ask
# whether ZeRO-3 is on), and its accelerator probe warns that it "falls back" to the CPU it was
# never asked to use.
KNOWN_NOISE: dict[str, dict[str, tuple[str, ...]]] = {
    "torch": {"DeepSpeed": ("Setting accelerator to CPU",)},
}


def quiet_known_noise(backend: str) -> None:
    """Install the filters of :data:`KNOWN_NOISE` for this trainer backend (idempotent)."""
    for name, prefixes in KNOWN_NOISE.get(backend, {}).items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessages) for f in logger.filters):
            logger.addFilter(_DropMessages(prefixes))


@contextlib.contextmanager
def no_progress_bars() -> Iterator[None]:
    """transformers' tqdm bars off inside the block, as they were after it (``save_pretrained``'s
    "Writing model shards" redraws a line per shard into a run's log)."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()

