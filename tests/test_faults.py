"""FaultInjector and HookPoint: one enumeration of hook points, refused names, on_fire, call faults that replace."""

import ast
import inspect

import pytest

from hivetrain import faults
from hivetrain.faults import Fault, FaultInjected, FaultInjector, HookPoint, hook_point, parse_fault_spec


def test_a_hook_point_is_its_name_as_a_string():
    assert HookPoint.AVERAGING_VOTE == "averaging.vote" and str(HookPoint.AVERAGING_VOTE) == "averaging.vote"
    assert f"{HookPoint.SWARM_SERVER_MID_FORWARD}" == "swarm.server.mid_forward"
    assert hook_point("checkpoint.mid_write") is HookPoint.CHECKPOINT_MID_WRITE


def test_every_hook_point_has_a_docstring():
    """An attribute docstring (read by Sphinx and people) right after each member of HookPoint."""
    tree = ast.parse(inspect.getsource(faults))
    (enum_class,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "HookPoint"]
    body = enum_class.body
    members = [
        (i, s.targets[0].id) for i, s in enumerate(body) if isinstance(s, ast.Assign) and s.targets[0].id.isupper()
    ]
    assert {name for _, name in members} == {p.name for p in HookPoint}
    for i, name in members:
        doc = body[i + 1] if i + 1 < len(body) else None
        assert isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant), f"HookPoint.{name} has no docstring"


def test_unknown_hook_names_are_refused_listing_the_valid_ones():
    with pytest.raises(
        ValueError, match=r"unknown hook point 'averaging\.before_sned'; valid .*averaging\.before_send"
    ):
        Fault("averaging.before_sned", "raise")
    with pytest.raises(ValueError, match=r"fault spec 'state\.mid_dl:exit': unknown hook point .*state\.mid_download"):
        parse_fault_spec("state.mid_dl:exit")
    unarmed = FaultInjector()
    with pytest.raises(ValueError, match=r"unknown hook point 'diloco\.before_outer'"):
        unarmed.check("diloco.before_outer", epoch=1)  # refused even with nothing armed: a typo fails its first test
    unarmed.check("swarm.server.mid_backward", stage=0)  # a name given as a string still validates


def test_on_fire_hears_point_action_and_context_before_the_action_runs():
    heard = []
    injector = FaultInjector(on_fire=lambda point, action, ctx: heard.append((point, action, dict(ctx))))
    injector.arm(Fault(HookPoint.AVERAGING_VOTE, "raise", when={"epoch": 2}))
    injector.check(HookPoint.AVERAGING_VOTE, epoch=1, to="b")
    assert heard == []
    with pytest.raises(FaultInjected):
        injector.check(HookPoint.AVERAGING_VOTE, epoch=2, to="b")
    assert heard == [(HookPoint.AVERAGING_VOTE, "raise", {"epoch": 2, "to": "b"})]
    assert injector.fired_count("averaging.vote") == 1


def test_a_failing_on_fire_does_not_change_what_the_fault_does():
    def broken(point, action, ctx):
        raise RuntimeError("metrics file closed")

    injector = FaultInjector(on_fire=broken)
    injector.arm(Fault(HookPoint.STATE_MID_DOWNLOAD, "raise"))
    with pytest.raises(FaultInjected):
        injector.check(HookPoint.STATE_MID_DOWNLOAD, epoch=3, index=0)


def test_check_returns_the_context_a_call_fault_left():
    injector = FaultInjector()
    assert injector.check(HookPoint.DILOCO_ROUND_INPUT, tensors=[1.0], weight=8.0) == {"tensors": [1.0], "weight": 8.0}

    def halve(ctx):
        ctx["weight"] = ctx["weight"] / 2

    armed = injector.arm(Fault(HookPoint.DILOCO_ROUND_INPUT, "call", callback=halve, times=0))
    assert injector.check(HookPoint.DILOCO_ROUND_INPUT, tensors=[1.0], weight=8.0)["weight"] == 4.0
    assert injector.check(HookPoint.DILOCO_ROUND_INPUT, tensors=[1.0], weight=6.0)["weight"] == 3.0
    assert armed.fired == 2
