"""The listener's connection cap (`broker.http.listening.ConnectionCap`): who the client is
behind trusted proxies, and which connection gives way when an address is full."""

from __future__ import annotations

import asyncio

import pytest

from broker.http import listening

PROXIES = ("10.0.0.0/8", "192.0.2.1")


@pytest.mark.parametrize(
    ("peer", "forwarded", "client"),
    [
        pytest.param("198.51.100.4", None, "198.51.100.4", id="no header: the peer"),
        pytest.param(
            "198.51.100.4", "203.0.113.7", "198.51.100.4", id="an untrusted peer's header ignored"
        ),
        pytest.param("10.1.2.3", "203.0.113.7", "203.0.113.7", id="a trusted proxy names it"),
        pytest.param(
            "10.1.2.3",
            "6.6.6.6, 203.0.113.7",
            "203.0.113.7",
            id="what the client wrote itself is not believed",
        ),
        pytest.param(
            "10.1.2.3",
            "203.0.113.7, 192.0.2.1, 10.9.9.9",
            "203.0.113.7",
            id="through a chain of trusted proxies",
        ),
        pytest.param(
            "10.1.2.3", "10.4.4.4, 10.5.5.5", "10.4.4.4", id="all trusted: the farthest one"
        ),
        pytest.param(
            "10.1.2.3", "203.0.113.7, junk", "10.1.2.3", id="not an address: the proxy itself"
        ),
        pytest.param("::ffff:10.1.2.3", "203.0.113.7", "203.0.113.7", id="an IPv4-mapped proxy"),
        pytest.param("10.1.2.3", " 2001:db8::1 ", "2001:db8::1", id="an IPv6 client"),
    ],
)
def test_the_client_behind_trusted_proxies(peer: str, forwarded: str | None, client: str) -> None:
    cap = listening.ConnectionCap(4, trusted_proxies=PROXIES)
    assert cap.client_of(peer, forwarded) == client


def test_without_trusted_proxies_the_header_is_never_read() -> None:
    cap = listening.ConnectionCap(4)
    assert cap.client_of("127.0.0.1", "203.0.113.7") == "127.0.0.1"


def test_a_bad_proxy_is_named() -> None:
    with pytest.raises(ValueError, match=r"'10\.0\.0\.300'"):
        listening.parse_networks(["10.0.0.0/8", "10.0.0.300"])


class _Transport(asyncio.BaseTransport):
    def __init__(self) -> None:
        super().__init__()
        self.closed = False

    def close(self) -> None:
        self.closed = True


def test_a_full_address_closes_its_longest_idle_then_reserves_then_refuses() -> None:
    cap = listening.ConnectionCap(2, reserve=1)
    first, second = (cap.admit("a", _Transport()) for _ in range(2))
    assert first is not None and second is not None
    cap.begin(second, "a", counted=True)
    cap.end(second, "a", counted=True)  # second was busy last: first is the longest idle
    third = cap.admit("a", _Transport())
    assert third is not None and not third.reserved
    assert isinstance(first.transport, _Transport) and first.transport.closed
    for connection in (second, third):
        cap.begin(connection, "a", counted=True)
    reserved = cap.admit("a", _Transport())
    assert reserved is not None and reserved.reserved  # every slot busy: the reserve's
    cap.begin(reserved, "a", counted=True)
    assert cap.admit("a", _Transport()) is None
    assert cap.admit("b", _Transport()) is not None  # another address: its own slots


def test_a_probe_or_agent_in_progress_takes_no_slot() -> None:
    cap = listening.ConnectionCap(1, reserve=0)
    agent = cap.admit("a", _Transport())
    assert agent is not None
    cap.begin(agent, "a", counted=False)  # the agent's session
    user = cap.admit("a", _Transport())
    assert user is not None and not user.reserved
