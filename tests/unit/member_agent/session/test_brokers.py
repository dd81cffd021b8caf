"""Which broker URL the agent connects to next: the list, failures, and the leader a follower
names."""

from __future__ import annotations

import pytest

from member_agent.session import brokers

A, B, C = "http://a:8080", "http://b:8080", "http://c:8080"


@pytest.mark.parametrize(
    ("text", "urls"),
    [
        pytest.param("http://a:8080", (A,), id="one"),
        pytest.param("http://a:8080, http://b:8080,http://c:8080", (A, B, C), id="three"),
        pytest.param("https://x/,wss://y", ("https://x/", "wss://y"), id="schemes"),
    ],
)
def test_broker_urls_are_comma_separated(text: str, urls: tuple[str, ...]) -> None:
    assert brokers.parse_urls(text) == urls


@pytest.mark.parametrize(
    ("text", "complaint"),
    [
        pytest.param("", "at least one", id="none"),
        pytest.param("http://a:8080,b:8080", "'b:8080' is not a broker URL", id="no scheme"),
    ],
)
def test_a_bad_broker_url_is_named(text: str, complaint: str) -> None:
    with pytest.raises(ValueError, match=complaint):
        brokers.parse_urls(text)


def test_a_connection_failure_moves_to_the_next_url_round_the_list() -> None:
    urls = brokers.BrokerList((A, B, C))
    assert urls.current == A
    assert [urls.failed(), urls.failed(), urls.failed()] == [B, C, A]


def test_a_welcomed_session_keeps_its_url() -> None:
    urls = brokers.BrokerList((A, B))
    urls.failed()
    urls.welcomed()
    assert urls.current == B


def test_a_follower_that_names_the_leader_sends_the_agent_there_even_off_the_list() -> None:
    urls = brokers.BrokerList((A, B, C))
    assert urls.not_leader("http://d:8080")
    assert urls.current == "http://d:8080"
    assert urls.hops == 1
    # the leader it named fails: back to the list, after the follower that named it
    assert urls.failed() == B


@pytest.mark.parametrize(
    "leader",
    [
        pytest.param(None, id="no leader known"),
        pytest.param(A, id="names itself"),
        pytest.param(A + "/", id="names itself, with a slash"),
        pytest.param("not a url", id="not a URL"),
    ],
)
def test_a_follower_that_names_no_other_leader_sends_the_agent_down_the_list(
    leader: str | None,
) -> None:
    urls = brokers.BrokerList((A, B))
    assert not urls.not_leader(leader)
    assert urls.current == B


@pytest.mark.parametrize(
    ("code", "refused"),
    [
        pytest.param(4003, True, id="4003: another cluster's token"),
        pytest.param(4001, True, id="4001: not authenticated"),
        pytest.param(4009, False, id="4009: not the leader, retried"),
        pytest.param(1001, False, id="going away, retried"),
        pytest.param(None, False, id="no close frame, retried"),
    ],
)
def test_a_session_closed_before_its_welcome_is_an_auth_failure_only_for_its_credentials(
    code: int | None, refused: bool
) -> None:
    if refused:
        with pytest.raises(brokers.AuthError, match=f"closed the session with {code}: why"):
            brokers.check_close(code, "why")
    else:
        brokers.check_close(code, "why")
