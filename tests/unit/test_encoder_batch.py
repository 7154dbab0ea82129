"""An encoder's credit (`capacity`, jobs held) and its batch (`max_batch`, images per forward)
are separate settings: by default it holds two batches of 8, so the next batch waits at the
encoder while a forward runs. Only encoders batch images; a batch larger than the jobs held could
never fill and is refused."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from cli.main import app
from epdq.benchmarks import costmodel
from epdq.worker.runner import ENCODER_MAX_BATCH, WorkerConfig

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("kw", "capacity", "max_batch"),
    [
        ({}, 2 * ENCODER_MAX_BATCH, ENCODER_MAX_BATCH),
        ({"capacity": 1}, 1, 1),  # a credit smaller than the default batch bounds the batch
        ({"capacity": 12}, 12, ENCODER_MAX_BATCH),
        ({"max_batch": 4}, 8, 4),
        ({"max_batch": 32}, 64, 32),
        ({"max_batch": 4096}, 4096, 4096),  # twice would pass the credit's bound
        ({"capacity": 5, "max_batch": 5}, 5, 5),
    ],
)
def test_an_encoders_credit_and_batch_default_from_each_other(kw, capacity, max_batch):
    cfg = WorkerConfig(role="encoder", **kw)
    assert (cfg.capacity, cfg.max_batch) == (capacity, max_batch)


@pytest.mark.parametrize("role", ["pd", "both"])
def test_other_roles_keep_their_credit_and_have_no_batch(role):
    cfg = WorkerConfig(role=role)
    assert (cfg.capacity, cfg.max_batch) == (16, 0)
    with pytest.raises(ValueError, match="max_batch is an encoder's setting"):
        WorkerConfig(role=role, max_batch=2)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"capacity": 8, "max_batch": 9}, r"max_batch \(9\) cannot exceed capacity \(8\)"),
        ({"max_batch": -1}, r"max_batch must be in \[0, 4096\]"),
        ({"max_batch": 4097}, r"max_batch must be in \[0, 4096\]"),
    ],
)
def test_a_batch_that_could_never_fill_or_is_out_of_range_is_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        WorkerConfig(role="encoder", **kw)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--role", "encoder", "--capacity", "4", "--max-batch", "8"], "--max-batch (8) cannot exceed --capacity (4)"),
        (["--role", "pd", "--max-batch", "8"], "--max-batch is an encoder's setting"),
    ],
)
def test_the_cli_names_its_flags_in_the_refusal(argv, message):
    res = CliRunner().invoke(app, ["worker", "--broker", "ipc:///nonexistent-epdq-dir/b.sock", *argv])
    assert res.exit_code == 2, res.output
    assert message in " ".join(res.output.replace("│", " ").split()), res.output


def test_the_cost_models_encoder_batches_as_the_worker_does():
    # the simulated encoder mirrors EncoderWorker: credit two batches, a forward at most one
    assert costmodel.ENCODER_MAX_BATCH == ENCODER_MAX_BATCH
    assert costmodel.ENCODER_CREDIT == WorkerConfig(role="encoder").capacity
    with pytest.raises(ValueError, match="encoder_max_batch"):
        costmodel.Simulation("epd", costmodel.CostModel(), encoder_credit=4, encoder_max_batch=8)
