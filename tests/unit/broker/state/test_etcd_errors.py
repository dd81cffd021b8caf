"""Which etcd and gRPC failures are temporary (try again, maybe on another member) and which
are not: `state.etcd.translate_error`, on the errors gRPC itself raises."""

from __future__ import annotations

import grpc
import pytest
from grpc import aio

from broker.state import errors, etcd, etcd_sharing


def rpc_error(code: grpc.StatusCode, details: str) -> aio.AioRpcError:
    return aio.AioRpcError(code, aio.Metadata(), aio.Metadata(), details=details)


@pytest.mark.parametrize(
    ("code", "details", "temporary"),
    [
        pytest.param(grpc.StatusCode.UNAVAILABLE, "connection refused", True, id="unavailable"),
        pytest.param(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline", True, id="deadline"),
        pytest.param(
            grpc.StatusCode.INTERNAL,
            "Internal error from Core",
            True,
            id="gRPC core failing to send on a broken connection (a member killed mid-call)",
        ),
        pytest.param(
            grpc.StatusCode.UNKNOWN,
            "context deadline exceeded",
            True,
            id="etcd gave up at the request's deadline (no quorum)",
        ),
        pytest.param(
            grpc.StatusCode.UNKNOWN, "etcdserver: request timed out", True, id="etcd timed out"
        ),
        pytest.param(grpc.StatusCode.UNKNOWN, "etcdserver: no leader", True, id="no leader"),
        pytest.param(
            grpc.StatusCode.INTERNAL, "etcdserver: corrupt cluster", False, id="etcd's own"
        ),
        pytest.param(
            grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: request is too large", False, id="bad"
        ),
    ],
)
def test_a_failure_is_temporary_only_where_another_try_can_succeed(
    code: grpc.StatusCode, details: str, temporary: bool
) -> None:
    found = etcd.translate_error(rpc_error(code, details), "watch '/x/' from 5")
    assert isinstance(found, errors.TemporaryStoreError) is temporary
    assert isinstance(found, errors.StoreError)
    assert details in str(found) and "watch '/x/' from 5" in str(found)


def test_a_compacted_revision_is_its_own_error() -> None:
    found = etcd.translate_error(
        rpc_error(
            grpc.StatusCode.OUT_OF_RANGE, "etcdserver: mvcc: required revision has been compacted"
        ),
        "watch",
    )
    assert isinstance(found, errors.CompactedError)


def test_a_write_refused_for_etcds_space_alarm_is_a_full_store_not_a_temporary_fault() -> None:
    """etcd answers RESOURCE_EXHAUSTED, a code otherwise temporary: retrying cannot help until
    an operator frees space, so it is the store-full error (507), with what to do."""
    found = etcd.translate_error(
        rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "etcdserver: mvcc: database space exceeded"),
        "commit",
    )
    assert isinstance(found, errors.StoreFullError)
    assert not isinstance(found, errors.TemporaryStoreError)
    assert "space quota alarm" in str(found) and "disarm" in str(found)


@pytest.mark.parametrize(
    ("code", "details", "refused"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: too many operations in txn request", True),
        (grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: request is too large", True),
        (grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: duplicate key given in txn request", True),
        (grpc.StatusCode.UNAVAILABLE, "connection refused", False),  # may have landed: no
        (grpc.StatusCode.UNKNOWN, "context deadline exceeded", False),
    ],
)
def test_a_request_refused_for_its_shape_never_landed(
    code: grpc.StatusCode, details: str, refused: bool
) -> None:
    with pytest.raises(errors.StoreError) as caught, etcd.translating_errors("txn"):
        raise rpc_error(code, details)
    # refused before any of it applied: the commits it carried are sent again, one each
    assert etcd_sharing.refused_for_shape(caught.value) is refused
