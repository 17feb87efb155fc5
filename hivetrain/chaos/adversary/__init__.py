"""Launching the py-libp2p adversary (``attack.py``) in its own interpreter, and reading what it reported.

py-libp2p cannot be imported next to hivemind, so ``attack.py`` runs under a separate Python that has it:
``$HIVETRAIN_ADVERSARY_PYTHON``, else ``.venv-adversary/bin/python`` at the repository root
(``scripts/setup_adversary`` creates it). Nothing here imports libp2p.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections import Counter
from pathlib import Path

ATTACK_SCRIPT = Path(__file__).with_name("attack.py")
_MADDR = re.compile(r"/ip4/[0-9.]+/tcp/\d+/p2p/\w+")


def adversary_python() -> str | None:
    """The interpreter with py-libp2p, or None when none is installed."""
    candidates = [os.environ.get("HIVETRAIN_ADVERSARY_PYTHON", "")]
    candidates.append(str(Path(__file__).resolve().parents[3] / ".venv-adversary" / "bin" / "python"))
    return next((c for c in candidates if c and Path(c).exists()), None)


def peer_maddr(log_path: Path) -> str | None:
    """The first full multiaddr (with /p2p/ID) a join-swarm peer logged when it joined."""
    if not log_path.exists():
        return None
    for line in log_path.read_text(errors="replace").splitlines():
        if " joined run " in line and (match := _MADDR.search(line)):
            return match.group(0)
    return None


def launch(
    python: str, target: str, run_id: str, duration_s: float, slowloris: int, seed: int, out_path: Path
) -> subprocess.Popen:
    """Start the adversary in its own process group; its JSON lines go to ``out_path``."""
    with open(out_path, "ab") as out:
        return subprocess.Popen(
            [python, str(ATTACK_SCRIPT), target, run_id, "--duration-s", str(duration_s),
             "--slowloris", str(slowloris), "--seed", str(seed)],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip


def summarize(out_path: Path) -> str:
    """ "N attacks: outcome counts" from the adversary's JSON lines."""
    outcomes: Counter[str] = Counter()
    dial = "not dialed"
    for line in out_path.read_text(errors="replace").splitlines() if out_path.exists() else []:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("attack") == "dial":
            dial = record.get("outcome", "")
        else:
            outcomes[record.get("outcome", "").split(":")[0].split(" (")[0]] += 1
    total = sum(outcomes.values())
    return f"dial {dial}; {total} hostile requests: " + ", ".join(f"{k} {v}" for k, v in outcomes.most_common())
