"""Code, tests and docs speak of the present: no "issue N" references.

A reader of a docstring, a test or a doc wants what the code does now, not which tracker item
changed it; the history is in git. This scans the text files of the folders a user reads and fails
naming each ``file:line`` that cites an issue by number (this file excluded). Data files (``*.jsonl``: graded model
outputs, benchmark problems) are not prose of ours and are skipped.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("cli", "core", "evals", "verifier_service", "tests", "docs")
SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".txt", ".sh", ".cfg", ".ini"}
ISSUE = re.compile(r"issue [0-9]+", re.IGNORECASE)


def issue_references(root: Path = ROOT) -> list[str]:
    """Every ``path:line: text`` under FOLDERS that matches ISSUE, this file excluded."""
    me = Path(__file__).resolve()
    hits = []
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*")):
            if path.suffix not in SUFFIXES or not path.is_file() or path.resolve() == me:
                continue
            for n, line in enumerate(path.read_text("utf-8", errors="replace").splitlines(), 1):
                if ISSUE.search(line):
                    hits.append(f"{path.relative_to(root)}:{n}: {line.strip()[:120]}")
    return hits


def test_no_issue_numbers_in_code_tests_or_docs():
    hits = issue_references()
    assert not hits, "say what the code does now, not which issue changed it:\n" + "\n".join(hits)


def test_the_scan_finds_a_reference(tmp_path):
    """The scan can fail: a planted reference is reported with its file and line."""
    (tmp_path / "docs").mkdir()
    planted = "as of Issue " + "12 this works"  # split so that a grep of this file finds nothing
    (tmp_path / "docs" / "x.md").write_text(f"fine\n{planted}\n", "utf-8")
    assert issue_references(tmp_path) == [f"docs/x.md:2: {planted}"]
