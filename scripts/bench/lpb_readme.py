"""The learning-per-byte tables of the README, written from the bench's results (never edited by hand).

The README holds each table between two markers::

    <!-- lpb:codecs-long begin -->
    ...
    <!-- lpb:codecs-long end -->

``diloco_vs_ddp.py --readme README.md`` replaces what is between the markers named after its ``--plan`` with the
script's table of that sweep and a line naming the commit(s) its runs were measured on and the command that reproduces
it (a run reused from ``--results`` keeps the commit it ran on). A README without the plan's markers is an error: the
script names the markers to add.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterable
from pathlib import Path


def current_commit(root: Path) -> str:
    """The checkout's commit (12 hex digits), with "+dirty" when tracked files differ from it; "unknown" outside git."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True, text=True, timeout=30, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def markers(name: str) -> tuple[str, str]:
    return f"<!-- lpb:{name} begin -->", f"<!-- lpb:{name} end -->"


def replace_block(text: str, name: str, body: str) -> str:
    """``text`` with the lines between the markers of ``name`` replaced by ``body``.

    Raises:
        ValueError: the markers are missing, repeated or out of order (the message shows the lines to add).
    """
    begin, end = markers(name)
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise ValueError(f"the README needs exactly one '{begin}' line followed by one '{end}' line around the table")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{body.strip()}\n{end}{tail}"


def block(table: str, commits: Iterable[str], command: str) -> str:
    """The text between the markers: the table, then where it came from."""
    known = sorted(set(commits))
    which = ", ".join(known) if known else "unknown"
    return f"{table}\n\nMeasured on commit {which} (`{command}`; written by the script, not by hand)."


def write(readme: Path, name: str, table: str, commits: Iterable[str], command: str) -> None:
    """Replace the block ``name`` of ``readme`` (see ``replace_block`` for what is raised)."""
    readme.write_text(replace_block(readme.read_text(), name, block(table, commits, command)))
