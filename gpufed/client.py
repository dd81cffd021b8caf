"""A small async client of the broker's HTTP API, used by the CLI, the demo and the tests.

Given several replicas (`URL1,URL2,...`, as GPUFED_BROKER may hold them), a request that cannot
connect to one is sent to the next: nothing reached the first, so nothing is done twice. Any
replica answers the API (followers serve it from their cache, submits and cancels included).
"""

from __future__ import annotations

import json
import ssl
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp

# the bounds of `POST /v1/jobs:batch` (`broker.api.submits`, which this client does not import)
BATCH_ITEMS = 1000
PAGE = 1000  # jobs a list page asks for, at most (the broker's largest page)
BATCH_BYTES = 8 * 1024 * 1024


class BrokerError(Exception):
    """The broker answered with a problem (4xx/5xx) or could not be reached."""

    def __init__(self, status: int, detail: str, body: dict[str, Any] | None = None) -> None:
        super().__init__(f"{status}: {detail}" if status else detail)
        self.status = status
        self.detail = detail
        self.body = body or {}


def split_urls(urls: str) -> list[str]:
    """`URL1,URL2,...` as a list (no trailing slashes, no empty items)."""
    return [u.strip().rstrip("/") for u in urls.split(",") if u.strip()]


def trust(ca_file: str | Path | None) -> ssl.SSLContext | bool:
    """What verifies the broker's certificate: the CA of `ca_file` (--ca-file,
    GPUFED_CA_FILE), else the system's CAs (True)."""
    if ca_file is None:
        return True
    try:
        return ssl.create_default_context(cafile=str(ca_file))
    except (OSError, ssl.SSLError) as exc:
        raise BrokerError(0, f"cannot use the CA file {ca_file}: {exc}") from exc


def untrusted(url: str, exc: aiohttp.ClientConnectorCertificateError) -> BrokerError:
    """The error for a broker whose certificate does not verify: why, and what to do."""
    why = getattr(exc.certificate_error, "verify_message", None) or str(exc.certificate_error)
    return BrokerError(
        0,
        f"the broker at {url} has a certificate this client does not trust ({why}): give the "
        "CA that signed it with --ca-file or GPUFED_CA_FILE",
    )


async def replica_status(
    url: str, *, timeout: float = 5.0, ca_file: str | Path | None = None
) -> dict[str, Any] | BrokerError:
    """`GET /v1/status` of one replica (no token), or the error that stopped it."""
    try:
        async with (
            aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=timeout),
                connector=aiohttp.TCPConnector(ssl=trust(ca_file)),
            ) as session,
            session.get(f"{url.rstrip('/')}/v1/status") as response,
        ):
            text = await response.text()
            body = json.loads(text) if text else {}
            if response.status >= 400:
                return BrokerError(response.status, str(body.get("detail") or text), body)
            result: dict[str, Any] = body
            return result
    except aiohttp.ClientConnectorCertificateError as exc:
        return untrusted(url, exc)
    except BrokerError as exc:
        return exc
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        return BrokerError(0, f"cannot reach {url}: {str(exc) or type(exc).__name__}")


class BrokerClient:
    def __init__(
        self,
        url: str,
        token: str,
        *,
        timeout: float = 30.0,
        ca_file: str | Path | None = None,
    ) -> None:
        self.urls = split_urls(url) or [url.rstrip("/")]
        self.url = self.urls[0]
        self.token = token
        self._session = aiohttp.ClientSession(
            headers={"Authorization": f"Bearer {token}"},
            timeout=aiohttp.ClientTimeout(total=timeout),
            connector=aiohttp.TCPConnector(ssl=trust(ca_file)),  # an https:// broker's CA
        )

    async def __aenter__(self) -> BrokerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._session.close()

    async def _call(
        self,
        method: str,
        path: str,
        *,
        data: str | None = None,
        headers: dict[str, str] | None = None,
        params: dict[str, str] | None = None,
    ) -> Any:
        for _ in range(len(self.urls)):
            try:
                async with self._session.request(
                    method, f"{self.url}{path}", data=data, headers=headers, params=params
                ) as response:
                    text = await response.text()
                    body = json.loads(text) if text else {}
                    if response.status >= 400:
                        detail = body.get("detail") or body.get("title") or text
                        raise BrokerError(response.status, str(detail), body)
                    return body
            except aiohttp.ClientConnectorCertificateError as exc:  # no replica will do better
                raise untrusted(self.url, exc) from exc
            except aiohttp.ClientConnectorError as exc:  # nothing was sent: the next replica
                if len(self.urls) == 1:
                    raise BrokerError(0, f"cannot reach the broker at {self.url}: {exc}") from exc
                failed = exc
                self.url = self.urls[(self.urls.index(self.url) + 1) % len(self.urls)]
            except aiohttp.ClientConnectionError as exc:
                raise BrokerError(0, f"cannot reach the broker at {self.url}: {exc}") from exc
        raise BrokerError(0, f"cannot reach any broker of {', '.join(self.urls)}: {failed}")

    async def submit(
        self, document: str, *, yaml: bool = False, idempotency_key: str | None = None
    ) -> dict[str, Any]:
        headers = {"Content-Type": "application/yaml" if yaml else "application/json"}
        if idempotency_key:
            headers["Idempotency-Key"] = idempotency_key
        result: dict[str, Any] = await self._call(
            "POST", "/v1/jobs", data=document, headers=headers
        )
        return result

    async def submit_batch(self, items: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """`POST /v1/jobs:batch`: `items` as the wire has them (`{"job": {...},
        "idempotencyKey": "k"}`, the key optional), at most `BATCH_ITEMS` and `BATCH_BYTES`.
        The answer has one entry per item, in order: `status` 202 (queued) or 200 (its key's
        job replayed) with `id`, `state`, `traceId`; or a 4xx/5xx with its `problem`."""
        result: dict[str, Any] = await self._call(
            "POST",
            "/v1/jobs:batch",
            data=json.dumps({"items": list(items)}),
            headers={"Content-Type": "application/json"},
        )
        return result

    async def get(self, job_id: str) -> dict[str, Any]:
        result: dict[str, Any] = await self._call("GET", f"/v1/jobs/{job_id}")
        return result

    async def why(self, job_id: str) -> dict[str, Any]:
        result: dict[str, Any] = await self._call("GET", f"/v1/jobs/{job_id}/why")
        return result

    async def job_page(
        self,
        *,
        queue: str | None = None,
        state: str | None = None,
        cluster: str | None = None,
        selector: str | None = None,
        search: str | None = None,
        sort: str | None = None,
        limit: int = PAGE,
        cont: str | None = None,
    ) -> tuple[list[dict[str, Any]], str | None]:
        """One page of `GET /v1/jobs`: the jobs and the token of the next page (None: the
        last). `search` is the text a name or id holds (`q`); `sort` newest or oldest."""
        params = {"limit": str(limit)}
        for name, value in (
            ("queue", queue),
            ("state", state),
            ("cluster", cluster),
            ("labelSelector", selector),
            ("q", search),
            ("sort", sort),
            ("continue", cont),
        ):
            if value:
                params[name] = value
        body = await self._call("GET", "/v1/jobs", params=params)
        items: list[dict[str, Any]] = body["items"]
        token = (body.get("metadata") or {}).get("continue")
        return items, token if isinstance(token, str) and token else None

    async def jobs(
        self,
        *,
        queue: str | None = None,
        state: str | None = None,
        cluster: str | None = None,
        selector: str | None = None,
        search: str | None = None,
        sort: str | None = None,
        limit: int | None = 1000,
    ) -> list[dict[str, Any]]:
        """Up to `limit` jobs (None: every one), newest first (`sort="oldest"`: oldest), a
        page at a time."""
        items: list[dict[str, Any]] = []
        cont: str | None = None
        while limit is None or len(items) < limit:
            size = PAGE if limit is None else min(PAGE, limit - len(items))
            page, cont = await self.job_page(
                queue=queue,
                state=state,
                cluster=cluster,
                selector=selector,
                search=search,
                sort=sort,
                limit=size,
                cont=cont,
            )
            items += page
            if cont is None:
                break
        return items

    async def cancel(self, job_id: str) -> dict[str, Any]:
        result: dict[str, Any] = await self._call("DELETE", f"/v1/jobs/{job_id}")
        return result

    async def cancel_array(self, array: str, *, index: int | None = None) -> dict[str, Any]:
        """Cancel an array's jobs (its id, or its newest of that name), or one index."""
        params = {"index": str(index)} if index is not None else None
        result: dict[str, Any] = await self._call("DELETE", f"/v1/arrays/{array}", params=params)
        return result

    async def queues(self) -> dict[str, Any]:
        result: dict[str, Any] = await self._call("GET", "/v1/queues")
        return result

    async def queue(self, name: str) -> dict[str, Any]:
        result: dict[str, Any] = await self._call("GET", f"/v1/queues/{name}")
        return result

    async def put_queue(self, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        result: dict[str, Any] = await self._call(
            "PUT",
            f"/v1/queues/{name}",
            data=json.dumps(spec),
            headers={"Content-Type": "application/json"},
        )
        return result

    async def delete_queue(self, name: str) -> dict[str, Any]:
        """Delete a queue stored through the API: {} once gone, or the queue as the queues
        file has it again (an override removed)."""
        result: dict[str, Any] = await self._call("DELETE", f"/v1/queues/{name}")
        return result

    async def clusters(self) -> list[dict[str, Any]]:
        body = await self._call("GET", "/v1/clusters")
        items: list[dict[str, Any]] = body["items"]
        return items
