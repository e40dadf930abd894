"""The twenty structured-output schemas (structured_schemas.py) on three presets and three
deployments: a colocated worker behind a gateway, and `pdserve up` (registry, prefill, decode,
gateway) over mooncake and over nixl. Through the official openai client every schema comes back
as a parsed object, and each schema's greedy answer is the same text in all three deployments.

`make test` runs the schemas on the tiny preset colocated against PD over mooncake
(test_structured_outputs.py, on its shared deployment); this whole matrix, a deployment per preset
and backend, runs with --long.
"""

from __future__ import annotations

import socket
from pathlib import Path

import openai
import pytest

from tests.e2e.cluster import Cluster, pdserve_up, worker_args
from tests.e2e.structured_schemas import SCHEMAS
from tools.models.tiny_model import write_tiny_model

pytestmark = [pytest.mark.e2e, pytest.mark.long, pytest.mark.timeout(900)]

PRESETS = {"tiny": 0, "tiny-moe": 4, "tiny-deepseek": 3}  # preset: weights' seed
MESSAGES = [{"role": "user", "content": "Answer in JSON."}]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def parse_all(base_url: str, model: str) -> dict[str, str | None]:
    """Each schema's greedy answer through `parse`, by schema name; fails unless it parsed."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    answers = {}
    for schema in SCHEMAS:
        completion = client.chat.completions.parse(model=model, messages=MESSAGES, response_format=schema,
                                                   max_tokens=300, temperature=0)
        choice = completion.choices[0]
        assert choice.finish_reason == "stop", (schema.__name__, choice.message.content)
        assert isinstance(choice.message.parsed, schema), (schema.__name__, choice.message.content)
        answers[schema.__name__] = choice.message.content
    return answers


@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_schema_parses_and_pd_over_each_backend_equals_colocated(preset: str, tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / preset, preset=preset, seed=PRESETS[preset])
    with Cluster(tmp_path / "colocated") as cluster:
        worker = cluster.start("colocated", worker_args(model, "null"))
        gateway = cluster.start("gateway", ["launch-router", "--port", "0", "--worker",
                                            f"http://{worker.address}"])
        try:
            colocated = parse_all(f"http://{gateway.address}/v1", model.name)
        except BaseException:
            print(cluster.logs())
            raise
    for backend in ("mooncake", "nixl"):
        port = free_port()
        with pdserve_up(["--model-path", str(model), "--port", str(port), "--transfer-backend", backend,
                         "--worker-threads", "1", "--log-dir", str(tmp_path / f"logs-{backend}")]) as up:
            assert "Press Ctrl-C to stop." in up.output, up.output
            pd = parse_all(f"http://127.0.0.1:{port}/v1", model.name)
            rest = up.interrupt()
            assert up.popen.returncode == 0, up.output + rest
        differing = [name for name in colocated if pd[name] != colocated[name]]
        assert not differing, {name: (colocated[name], pd[name]) for name in differing}
