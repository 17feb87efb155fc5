"""The adversary launcher's pure parts: finding a peer's address in its log, summarizing the adversary's output.

The attack itself needs py-libp2p in a separate interpreter; the bundled scenario ``adversary-state-server`` runs it
against real peers (scripts/chaos_full).
"""

import ast

from hivetrain.chaos import adversary


def test_peer_maddr_is_read_from_the_join_line(tmp_path):
    log = tmp_path / "peer0.log"
    log.write_text(
        "06:11:40 INFO x: starting\n"
        "06:11:49 INFO hivetrain.join_swarm: peer QmAbc joined run 'chaos' (model tiny, 426fa4d1cd0e) at "
        "/ip4/127.0.0.1/tcp/45531/p2p/QmAbc, /ip4/10.0.0.1/tcp/1/p2p/QmAbc\n"
    )
    assert adversary.peer_maddr(log) == "/ip4/127.0.0.1/tcp/45531/p2p/QmAbc"
    assert adversary.peer_maddr(tmp_path / "missing.log") is None


def test_summarize_counts_outcomes(tmp_path):
    out = tmp_path / "adv.jsonl"
    out.write_text(
        '{"attack": "dial", "outcome": "connected", "t_s": 0.1}\n'
        '{"attack": "garbage", "outcome": "closed (StreamEOF)", "t_s": 1}\n'
        '{"attack": "huge_length", "outcome": "closed", "t_s": 1}\n'
        '{"attack": "unknown_op", "outcome": "error:unknown op", "t_s": 1}\n'
        "torn line"
    )
    assert adversary.summarize(out) == "dial connected; 3 hostile requests: closed 2, error 1"


def test_attack_script_imports_nothing_from_hivetrain_or_hivemind():
    tree = ast.parse(adversary.ATTACK_SCRIPT.read_text())
    modules = {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    modules |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not any(m.startswith(("hivetrain", "hivemind")) for m in modules)
    assert "libp2p" in modules
