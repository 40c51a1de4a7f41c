"""The ClientApp handler called directly with messages built in memory."""

from __future__ import annotations

import logging

import pytest
from flwr.app import Context, Message, MessageType, RecordDict

from clients.app import train
from fedcomp.config import RunConfig
from fedcomp.federated.downlink import Broadcaster
from fedcomp.flower import reply_parts, train_content
from fedcomp.tasks.models import build_model
from fedcomp.tasks.training import state_arrays

CFG = RunConfig(local_steps=2, local_epochs=0)


@pytest.fixture(autouse=True)
def _task_identity(monkeypatch):
    # A Message reads the run and node of the current process, which Flower sets.
    from flwr.supercore.task_identity import TaskIdentity
    for name, value in (("_run_id", 7), ("_node_id", 1), ("_task_id", 0)):
        monkeypatch.setattr(TaskIdentity, name, value)


def _message(server: Broadcaster, server_round: int, replica_round: int | None) -> Message:
    content = train_content({**CFG.to_mapping(), "server-round": server_round},
                            server.message_for(replica_round), {})
    return Message(content=content, message_type=MessageType.TRAIN, dst_node_id=1)


def _context(state_dir, run_id: int = 7) -> Context:
    return Context(run_id=run_id, node_id=1, state=RecordDict(), run_config={},
                   node_config={"partition-id": 0, "num-partitions": 3,
                                "state-dir": str(state_dir)})


def test_a_restarted_node_resumes_its_residual_from_its_state_dir(tmp_path, caplog):
    server = Broadcaster(state_arrays(build_model("digits", seed=0)), CFG.downlink_policy)
    first = train(_message(server, 1, None), _context(tmp_path))
    assert reply_parts(first.content)[1]["residual-norm-in"] == 0.0
    files = list(tmp_path.iterdir())
    assert [f.name for f in files] == ["fedcomp-run7-partition0.npz"]

    # The SuperNode restarts: context.state is empty, the file is not.
    second = train(_message(server, 2, 0), _context(tmp_path))
    assert reply_parts(second.content)[1]["residual-norm-in"] > 0

    # A corrupt file is refused with a log line and the client starts clean.
    files[0].write_bytes(b"garbage")
    with caplog.at_level(logging.WARNING):
        third = train(_message(server, 3, None), _context(tmp_path))
    assert reply_parts(third.content)[1]["residual-norm-in"] == 0.0
    assert "ignoring unreadable client state" in caplog.text

    # Another run never picks up this run's state.
    other = train(_message(server, 1, None), _context(tmp_path, run_id=8))
    assert reply_parts(other.content)[1]["residual-norm-in"] == 0.0
    assert len(list(tmp_path.iterdir())) == 2


def test_a_node_whose_partition_is_empty_says_so_instead_of_training(tmp_path, monkeypatch):
    import numpy as np

    import clients.app as client_app
    from fedcomp.tasks.data import ArrayDataset

    empty = ArrayDataset(np.zeros((0, 64), np.float32), np.zeros(0, np.int64))
    monkeypatch.setattr(client_app, "_load_data", lambda cfg, context: empty)
    server = Broadcaster(state_arrays(build_model("digits", seed=0)), CFG.downlink_policy)
    with pytest.raises(client_app.EmptyPartitionError,
                       match=r"partition 0 of 3 holds no training examples"):
        train(_message(server, 1, None), _context(tmp_path))
    assert not list(tmp_path.iterdir())  # nothing trained, nothing saved
