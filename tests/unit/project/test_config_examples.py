"""The example jobs a newcomer submits name a queue that the token their comment gives may use
once the broker runs with `--queues config/queues.yaml` (the README's quick start)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from broker.api import jobs

CONFIG = Path(__file__).resolve().parents[3] / "config"
EXAMPLES = sorted((CONFIG / "examples").glob("*.yaml"))


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_an_example_names_a_queue_of_the_tenant_whose_token_it_says_to_use(
    example: Path,
) -> None:
    text = example.read_text()
    said = re.search(r"GPUFED_TOKEN=(\S+?)\)?[.,]?$", text, flags=re.M)
    assert said is not None, f"{example.name}: say which token submits it (GPUFED_TOKEN=...)"
    tokens = yaml.safe_load((CONFIG / "tokens.yaml").read_text())["tokens"]
    [tenant] = [t["tenant"] for t in tokens if t.get("token") == said.group(1)]
    queue = jobs.GPUJob.model_validate(yaml.safe_load(text)).spec.queue
    declared = yaml.safe_load((CONFIG / "queues.yaml").read_text())["queues"]
    assert {"name": queue, "tenant": tenant}.items() <= next(
        (q for q in declared if q["name"] == queue), {}
    ).items(), f"{example.name}: queue {queue} is not {tenant}'s"
