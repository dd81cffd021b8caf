"""`gpufed submit` of several jobs: the documents of a file or a directory, through the batch
route.

A file holds one or more YAML documents (`---` between them) or one JSON document; a
directory, every `*.yaml`, `*.yml` and `*.json` directly in it, sorted by name. One document in
all is sent to `POST /v1/jobs` as written, as `gpufed submit` always did. Several go to `POST
/v1/jobs:batch` in chunks of at most `client.BATCH_ITEMS` jobs and `client.BATCH_BYTES`; with
`--idempotency-key K` the job at index i (from 0, in that order) has the key `K-<i>`, so the
same command run again replays its jobs instead of making new ones. Each job gets one line:
its id, or why the broker refused it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from gpufed import client

SUFFIXES = (".yaml", ".yml", ".json")
ENVELOPE_BYTES = 64  # `{"items": [` ... `]}` and the commas, with room to spare


class DocumentError(Exception):
    """A file of a directory that cannot be read as jobs: nothing is submitted."""


@dataclass(frozen=True)
class Document:
    """One job document: where it is (`jobs.yaml`, `jobs.yaml#2` for the file's second),
    the job, and the text to send if it is the only one (the file as written)."""

    source: str
    job: Any
    text: str
    is_json: bool


def read_documents(path: str, *, stdin_text: str | None = None) -> list[Document]:
    """The documents of `path` ('-': `stdin_text`), in order. A single file that does not
    parse is one document, its text as written: the broker says what is wrong with it.
    DocumentError (nothing is to be sent): a file of a directory that does not parse, or one
    of several documents that is no JSON value (a YAML date)."""
    if path != "-" and Path(path).is_dir():
        files = sorted(p for p in Path(path).iterdir() if p.suffix in SUFFIXES and p.is_file())
        found: list[Document] = []
        for file in files:
            text = file.read_text()
            try:
                found.extend(_parse(str(file), text))
            except (yaml.YAMLError, json.JSONDecodeError) as exc:
                raise DocumentError(f"{file}: not YAML or JSON: {exc}") from exc
        return found
    text = stdin_text if path == "-" and stdin_text is not None else Path(path).read_text()
    source = "stdin" if path == "-" else path
    try:
        return _parse(source, text)
    except (yaml.YAMLError, json.JSONDecodeError):
        return [Document(source, None, text, text.lstrip().startswith("{"))]


def _parse(source: str, text: str) -> list[Document]:
    if text.lstrip().startswith("{"):
        return [Document(source, json.loads(text), text, True)]
    stream = list(yaml.safe_load_all(text))
    jobs = [doc for doc in stream if doc is not None]
    if len(stream) == 1:
        return [Document(source, jobs[0], text, False)] if jobs else []
    if len(jobs) == 1:  # and empty documents around it (a `---` at the end)
        return [Document(source, jobs[0], _json(source, jobs[0]), True)]
    named = [(f"{source}#{n + 1}", job) for n, job in enumerate(jobs)]
    return [Document(name, job, _json(name, job), True) for name, job in named]


def _json(source: str, job: Any) -> str:
    try:
        return json.dumps(job)
    except (TypeError, ValueError) as exc:  # a YAML date, a set: the broker takes JSON values
        raise DocumentError(f"{source}: not a JSON value: {exc}") from exc


def items_of(documents: Sequence[Document], *, key: str | None) -> list[dict[str, Any]]:
    """The batch items of `documents`: the job at index i keyed `key-<i>` (none: no key)."""
    items = []
    for index, document in enumerate(documents):
        item: dict[str, Any] = {"job": document.job}
        if key:
            item["idempotencyKey"] = f"{key}-{index}"
        items.append(item)
    return items


def chunks(
    items: Sequence[dict[str, Any]],
    *,
    max_items: int = client.BATCH_ITEMS,
    max_bytes: int = client.BATCH_BYTES,
) -> Iterator[list[dict[str, Any]]]:
    """`items` in order, in bodies of at most `max_items` items and `max_bytes` bytes."""
    chunk: list[dict[str, Any]] = []
    size = ENVELOPE_BYTES
    for item in items:
        cost = len(json.dumps(item).encode()) + 2
        if chunk and (len(chunk) >= max_items or size + cost > max_bytes):
            yield chunk
            chunk, size = [], ENVELOPE_BYTES
        chunk.append(item)
        size += cost
    if chunk:
        yield chunk


async def submit_all(
    api: client.BrokerClient, documents: Sequence[Document], *, key: str | None
) -> AsyncIterator[list[dict[str, Any]]]:
    """Send `documents` through the batch route, a chunk at a time; yields each chunk's
    answers, each with the `source` of its document and `index` its place among all."""
    start = 0
    for chunk in chunks(items_of(documents, key=key)):
        answer = await api.submit_batch(chunk)
        results = []
        for item in answer["items"]:
            local = int(item["index"])
            index = start + local
            result = {**item, "index": index, "source": documents[index].source}
            if isinstance(item.get("problem"), dict):  # named among all, not in the chunk
                result["problem"] = _renumbered(item["problem"], local, index)
            results.append(result)
        start += len(chunk)
        yield results


def line_of(result: dict[str, Any]) -> str:
    """One line of a job's answer: `SOURCE: ID STATE`, or `SOURCE: error STATUS: DETAIL`."""
    status = int(result["status"])
    if status < 400:
        replayed = " (replayed: its key's job)" if status == 200 else ""
        trace = f" (trace {result['traceId']})" if result.get("traceId") else ""
        return f"{result['source']}: {result['id']} {result['state']}{trace}{replayed}"
    problem = result.get("problem") or {}
    detail = str(problem.get("detail") or problem.get("title") or "refused")
    # the broker names the field from the batch's root; the line names the document already
    detail = detail.removeprefix(f"items[{result['index']}].")
    return f"{result['source']}: error {status}: {detail}"


def _renumbered(problem: dict[str, Any], local: int, index: int) -> dict[str, Any]:
    old, new = f"items[{local}]", f"items[{index}]"
    renamed = dict(problem)
    for name in ("field", "detail"):
        value = renamed.get(name)
        if isinstance(value, str) and value.startswith(old):
            renamed[name] = new + value[len(old) :]
    instance = renamed.get("instance")
    if isinstance(instance, str) and instance.endswith(f"#/items/{local}"):
        renamed["instance"] = instance.removesuffix(str(local)) + str(index)
    if isinstance(renamed.get("errors"), list):
        renamed["errors"] = [
            {**e, "field": new + e["field"][len(old) :]}
            if isinstance(e, dict) and str(e.get("field", "")).startswith(old)
            else e
            for e in renamed["errors"]
        ]
    return renamed
