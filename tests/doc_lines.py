"""The documented command lines of one stapo subcommand, for tests that run each of them. Imported by
tests (``from doc_lines import documented``; tests/ is on sys.path through its conftest)."""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def documented(name: str, help_doc: str, is_command: Callable[[list[str]], bool]) -> list[tuple[str, list[str]]]:
    """(where, argv) of every ``stapo NAME`` line in README.md and docs/*.md (fenced-block lines and
    inline code spans) and in the command's --help examples (``help_doc``), argv without ``stapo``.
    ``is_command(rest)`` gets the words after ``stapo NAME`` (at least one) and tells a command line from prose that
    starts the same way (a listing's ``stapo probe     does ...``, a mention in backticks). One entry
    per distinct line, named by every place that shows it."""
    texts = [(str(p.relative_to(ROOT)), p.read_text()) for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]]
    found = []
    for where, text in [*texts, (f"stapo {name} --help", help_doc)]:
        for n, raw in enumerate(text.splitlines(), 1):
            line = raw.strip()
            spans = re.findall(rf"`(stapo {name} [^`]+)`", line)
            if line.startswith(f"stapo {name} "):
                spans.append(line)
            for cmd in spans:
                if is_command(cmd.split()[2:]):  # prose may hold what shlex cannot split (an apostrophe)
                    found.append((f"{where}:{n}", shlex.split(cmd, comments=True)[1:]))
    same: dict[tuple[str, ...], list[str]] = {}
    for where, argv in found:
        same.setdefault(tuple(argv), []).append(where)
    return [(" + ".join(w), list(a)) for a, w in same.items()]
