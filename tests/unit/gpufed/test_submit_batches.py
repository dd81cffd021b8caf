"""`gpufed submit -f` reading several documents and cutting them into batches (no broker):
what is one job and what is several, the order of a directory, keys K-<i>, the bounds of a
batch, and the line each job gets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from gpufed import batches
from tests.builders import make_job


def _doc(name: str) -> dict[str, object]:
    return make_job(name).document()


def test_one_document_is_sent_as_written_and_several_are_named_in_their_file(
    tmp_path: Path,
) -> None:
    one = tmp_path / "one.yaml"
    one.write_text("# a comment kept\n" + yaml.safe_dump(_doc("one")))
    [only] = batches.read_documents(str(one))
    assert only.text == one.read_text() and not only.is_json and only.source == str(one)

    several = tmp_path / "several.yaml"
    several.write_text(yaml.safe_dump_all([_doc("a"), None, _doc("b")]))
    found = batches.read_documents(str(several))
    assert [d.source for d in found] == [f"{several}#1", f"{several}#2"]
    assert [json.loads(d.text)["metadata"]["name"] for d in found] == ["a", "b"]

    trailing = tmp_path / "trailing.yaml"
    trailing.write_text(yaml.safe_dump(_doc("t")) + "---\n")
    [alone] = batches.read_documents(str(trailing))
    assert alone.is_json and json.loads(alone.text)["metadata"]["name"] == "t"


def test_a_directory_is_its_job_files_sorted_by_name(tmp_path: Path) -> None:
    (tmp_path / "b.json").write_text(json.dumps(_doc("b")))
    (tmp_path / "a.yml").write_text(yaml.safe_dump_all([_doc("a1"), _doc("a2")]))
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(_doc("c")))
    (tmp_path / "README.md").write_text("not a job")
    (tmp_path / "sub.yaml").mkdir()
    names = [d.job["metadata"]["name"] for d in batches.read_documents(str(tmp_path))]
    assert names == ["a1", "a2", "b", "c"]


def test_a_file_that_does_not_parse_is_the_brokers_to_judge_alone_and_stops_a_directory(
    tmp_path: Path,
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [b")
    [sent] = batches.read_documents(str(bad))
    assert sent.text == "a: [b" and sent.job is None
    (tmp_path / "good.yaml").write_text(yaml.safe_dump(_doc("good")))
    with pytest.raises(batches.DocumentError, match=r"bad\.yaml: not YAML or JSON"):
        batches.read_documents(str(tmp_path))
    dated = tmp_path / "dated.yaml"
    dated.write_text("when: 2024-01-01\n---\nwhen: 2024-01-02\n")
    with pytest.raises(batches.DocumentError, match=r"dated\.yaml#1: not a JSON value"):
        batches.read_documents(str(dated))


def test_keys_are_k_dash_index_and_batches_keep_both_bounds() -> None:
    docs = [batches.Document(f"f#{i}", _doc(f"j{i}"), "", True) for i in range(5)]
    items = batches.items_of(docs, key="K")
    assert [i["idempotencyKey"] for i in items] == [f"K-{i}" for i in range(5)]
    assert "idempotencyKey" not in batches.items_of(docs, key=None)[0]
    assert [len(c) for c in batches.chunks(items, max_items=2)] == [2, 2, 1]
    size = len(json.dumps(items[0]))
    by_bytes = list(batches.chunks(items, max_bytes=batches.ENVELOPE_BYTES + 2 * size + 10))
    assert [len(c) for c in by_bytes] == [2, 2, 1]
    assert [i for c in by_bytes for i in c] == items, "in order, nothing lost"


@pytest.mark.parametrize(
    ("result", "line"),
    [
        pytest.param(
            {"source": "a.yaml", "index": 0, "status": 202, "id": "a-1", "state": "Queued"},
            "a.yaml: a-1 Queued",
            id="queued",
        ),
        pytest.param(
            {"source": "a.yaml", "index": 0, "status": 200, "id": "a-1", "state": "Running"},
            "a.yaml: a-1 Running (replayed: its key's job)",
            id="replayed",
        ),
        pytest.param(
            {
                "source": "b.yaml#2",
                "index": 7,
                "status": 422,
                "problem": {"detail": "items[7].job.spec.colour: unknown field"},
            },
            "b.yaml#2: error 422: job.spec.colour: unknown field",
            id="refused",
        ),
    ],
)
def test_each_job_gets_one_line(result: dict[str, object], line: str) -> None:
    assert batches.line_of(result) == line
