"""Old module paths that still import for one release, with a DeprecationWarning naming the new path.

A package that moves its modules keeps a table ``old path -> new path`` and hands it to
:func:`register` with the reason (``stapo.core.MOVED``: "stapo.core is laid out by layer";
``stapo.verifier_service.MOVED``: "stapo.verifier_service is laid out by role"). One finder,
:class:`OldPaths`, answers every registered table; stapo 0.2 drops them.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import warnings
from collections.abc import Mapping

_OLD: dict[str, tuple[str, str]] = {}
"""Every registered old path -> (its new path, why it moved)."""


class OldPaths:
    """Import finder for the registered tables: an old path gives the module at its new path (the
    same object, so its classes, registries and monkeypatches are the ones the rest of stapo uses)
    and warns where the user's import stands.

    It stands first on ``sys.meta_path`` and answers only the registered names, none of which is a
    file (the tables' tests check it): a moved package's submodule (``stapo.verifier_service.rules.table``)
    would otherwise be found a second time, as a new module object, through the moved package's
    ``__path__``."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> object:
        return importlib.util.spec_from_loader(name, self) if name in _OLD else None

    def create_module(self, spec: object) -> object:
        old, (new, why) = spec.name, _OLD[spec.name]
        # stacklevel 2 skips the import system's own frames: the warning names the user's import line
        warnings.warn(f"{old} is an old path of {new} ({why}): import {new}; the old path goes in stapo 0.2",
                      DeprecationWarning, stacklevel=2)
        module = importlib.import_module(new)
        spec.loader_state = module.__spec__  # the import system sets __spec__ to this spec; exec_module restores it
        return module

    def exec_module(self, module: object) -> None:
        module.__spec__ = module.__spec__.loader_state


def register(moved: Mapping[str, str], why: str) -> None:
    """Make every old path of ``moved`` import its new module with a warning that says ``why``."""
    _OLD.update({old: (new, why) for old, new in moved.items()})
    if not any(isinstance(f, OldPaths) for f in sys.meta_path):
        sys.meta_path.insert(0, OldPaths())
