"""State download in an invite-only run, between real peers on loopback: a non-member donor is never asked, and a
state server refuses a requester that is not a member."""

import pytest

from hivetrain.diloco.state_sync import StateDownloadFailed, StateServer
from tests.diloco.test_state_sync import _fetch, _register, _state, _swarm, loop  # noqa: F401 - fixture


@pytest.mark.slow
def test_a_non_member_donor_is_never_asked(make_node, loop):  # noqa: F811 - the fixture
    member, outsider, joiner = _swarm(make_node, loop, 3)
    good = _state(3, seed=1)
    servers = {n.peer_id: _register(loop, n, StateServer(lambda: good)) for n in (member, outsider)}
    result, _ = _fetch(loop, joiner, [outsider, member], {3: good.state_hash()}, admits=lambda p: p != outsider.peer_id)
    assert result.state is not None and result.state.state_hash() == good.state_hash()
    assert result.dropped_donors == {outsider.peer_id: "not a member of the run"}
    assert servers[outsider.peer_id].bytes_served == 0 and servers[member.peer_id].bytes_served >= good.num_bytes()
    with pytest.raises(StateDownloadFailed, match="none of the 1 donor"):
        _fetch(loop, joiner, [outsider], {3: good.state_hash()}, admits=lambda p: p != outsider.peer_id)


@pytest.mark.slow
def test_a_state_server_refuses_a_non_member_requester(make_node, loop):  # noqa: F811 - the fixture
    donor, stranger = _swarm(make_node, loop, 2)
    good = _state(3, seed=2)
    server = StateServer(lambda: good)
    server.admits = lambda peer_id: peer_id != stranger.peer_id
    _register(loop, donor, server)
    with pytest.raises(StateDownloadFailed):
        _fetch(loop, stranger, [donor], {3: good.state_hash()})
    assert server.requests_refused >= 1 and server.bytes_served == 0
