"""Exit statuses of `epdq worker` (the CLI's own mapping; the worker's run is replaced)."""

from __future__ import annotations

from typer.testing import CliRunner

import epdq.launch as launch
from cli.main import app
from epdq.errors import EngineError


def test_a_worker_whose_engine_died_exits_1(monkeypatch, tmp_path):
    # README: "exits with status 1 for its supervisor to restart it"; `epdq worker` used to exit 3
    # (the client commands' "the cluster could not serve it")
    async def engine_dies(cfg):
        raise EngineError("the engine died (EngineCore gone); this worker left the broker")

    monkeypatch.setattr(launch, "serve_worker", engine_dies)
    res = CliRunner().invoke(app, ["worker", "--role", "pd", "--engine", "noop", "--broker", f"ipc://{tmp_path}/b"])
    assert res.exit_code == 1, res.output
    assert "error (engine): the engine died" in res.output

