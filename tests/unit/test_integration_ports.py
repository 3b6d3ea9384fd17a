"""The integration tier's ports: pytest-xdist workers hand out disjoint shares of one range, so a server one worker
is still starting never meets a port the other gave out (each worker remembers only what it gave itself)."""

from __future__ import annotations

from tests.integration.procs import PORT_RANGE, worker_ports


def test_outside_xdist_the_whole_range_is_handed_out():
    assert worker_ports(PORT_RANGE, "", "1") == PORT_RANGE


def test_the_workers_shares_are_disjoint_and_inside_the_range():
    shares = [set(worker_ports(PORT_RANGE, f"gw{i}", "3")) for i in range(3)]
    assert all(len(s) == len(PORT_RANGE) // 3 for s in shares)
    assert not (shares[0] & shares[1] or shares[0] & shares[2] or shares[1] & shares[2])
    assert set().union(*shares) <= set(PORT_RANGE)
