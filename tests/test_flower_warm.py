"""The warm ClientApp worker: pinned to Flower's internals, and its claim loop.

The worker reuses functions that are internal to Flower 1.42. The first tests fail as
soon as one of them moves, is renamed or changes its parameters, so that a Flower
upgrade cannot silently break deployments; the loopback tests in ``test_deploy.py``
run real runs through the worker.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from fedcomp.flower import warm
from fedcomp.flower.warm import (
    UnsupportedFlowerError,
    WarmClientAppWorker,
    check_flower_version,
)
from fedcomp.ops.deploy import clientapp_worker_argv, flower_tool, supernode_argv


def _parameters(function) -> list[str]:
    return list(inspect.signature(function).parameters)


def test_any_other_flower_release_is_refused_by_name():
    check_flower_version()  # the installed one is the pinned one
    with pytest.raises(UnsupportedFlowerError, match=r"1\.42\.x.*1\.43\.0.*per-message"):
        check_flower_version("1.43.0")
    with pytest.raises(UnsupportedFlowerError):
        check_flower_version("2.0.0")


def test_the_flower_internals_the_worker_uses_are_where_and_as_it_expects():
    from flwr.app import Context, Message
    from flwr.cli.install import install_from_fab
    from flwr.clientapp.client_app import ClientApp, LoadClientAppError
    from flwr.clientapp.utils import get_load_client_app_fn
    from flwr.common.config import get_project_dir
    from flwr.common.constant import ErrorCode, SubStatus
    from flwr.proto.runtime_pb2 import (  # pylint: disable=E0611
        AcquireTaskRequest,
        AcquireTaskResponse,
        SendTaskHeartbeatRequest,
        SendTaskHeartbeatResponse,
    )
    from flwr.supercore.app_utils import start_parent_process_monitor
    from flwr.supercore.constant import TaskType
    from flwr.supercore.heartbeat import HeartbeatSender
    from flwr.supercore.interceptors import (
        RuntimeTokenHttpInterceptor,
        RuntimeVersionHttpInterceptor,
    )
    from flwr.supercore.retry import make_simple_http_retry_invoker
    from flwr.supercore.runtime import RuntimeHttpClient
    from flwr.supernode.runtime.run_clientapp import (
        pull_task_input,
        push_message,
        push_task_output,
    )

    assert _parameters(pull_task_input) == ["client"]
    assert _parameters(push_message) == ["client", "message", "context"]
    assert _parameters(push_task_output) == ["client", "context", "sub_status", "details"]
    assert {"skip_prompt"} <= set(_parameters(install_from_fab))
    assert _parameters(get_load_client_app_fn) == ["default_app_ref", "app_path", "multi_app"]
    assert _parameters(get_project_dir)[:3] == ["fab_id", "fab_version", "fab_hash"]
    assert _parameters(HeartbeatSender) == ["heartbeat_fn"]
    assert _parameters(start_parent_process_monitor) == ["parent_pid"]
    assert "component_name" in _parameters(RuntimeVersionHttpInterceptor)
    assert len(_parameters(RuntimeTokenHttpInterceptor)) == 1
    assert _parameters(make_simple_http_retry_invoker) == []
    assert {"server_address", "insecure", "root_certificates", "interceptors",
            "retry_invoker"} <= set(_parameters(RuntimeHttpClient.from_server_address))
    for method in ("AcquireTask", "SendTaskHeartbeat", "PullTaskInput", "PushTaskOutput",
                   "PullMessages", "PushMessages", "PullObject", "PushObject", "close"):
        assert callable(getattr(RuntimeHttpClient, method)), method
    assert set(AcquireTaskRequest.DESCRIPTOR.fields_by_name) == {
        "supported_task_types", "agentapp_fab_hashes"}
    assert {"task", "token"} <= set(AcquireTaskResponse.DESCRIPTOR.fields_by_name)
    assert "success" in SendTaskHeartbeatResponse.DESCRIPTOR.fields_by_name
    assert SendTaskHeartbeatRequest() is not None
    assert str(TaskType.CLIENT_APP) == "flwr-clientapp"
    assert SubStatus.COMPLETED and SubStatus.FAILED
    assert ErrorCode.CLIENT_APP_RAISED_EXCEPTION != ErrorCode.LOAD_CLIENT_APP_EXCEPTION
    assert issubclass(LoadClientAppError, Exception)
    assert _parameters(ClientApp.__call__)[1:] == ["message", "context"]
    assert Message and Context


def test_the_supernode_has_the_isolation_mode_the_worker_needs():
    help_text = subprocess.run([flower_tool("flower-supernode"), "--help"],
                               capture_output=True, text=True, check=True).stdout
    assert "--isolation {subprocess,process}" in help_text
    argv = supernode_argv(None, 0, superlink="127.0.0.1:1", partition_id=0,
                          num_partitions=1, port=9200)
    assert argv[argv.index("--isolation") + 1] == "process"
    per_message = supernode_argv(None, 0, superlink="127.0.0.1:1", partition_id=0,
                                 num_partitions=1, port=9200, clientapp="per-message")
    assert "--isolation" not in per_message
    with pytest.raises(ValueError, match="clientapp must be one of"):
        supernode_argv(None, 0, superlink="127.0.0.1:1", partition_id=0,
                       num_partitions=1, clientapp="threads")


def test_the_worker_command_line_names_the_node_port_and_parent():
    argv = clientapp_worker_argv(9200, parent_pid=7)
    assert argv[:3] == [sys.executable, "-m", "fedcomp.flower.warm"]
    assert argv[argv.index("--runtime-api-address") + 1] == "127.0.0.1:9200"
    assert argv[argv.index("--parent-pid") + 1] == "7"
    assert "--superlink" not in argv
    metered = clientapp_worker_argv(9200, parent_pid=7, superlink="link.example:9092")
    assert metered[metered.index("--superlink") + 1] == "link.example:9092"
    with pytest.raises(ValueError, match="host:port"):
        clientapp_worker_argv(9200, parent_pid=7, superlink="link.example")


def test_replies_carry_the_nodes_wire_counters_in_a_record_they_have_anyway():
    from types import SimpleNamespace

    from flwr.app import MetricRecord, RecordDict

    from fedcomp.flower import reply_content, reply_parts
    from fedcomp.ops.netmeter import TcpCounts

    class Meter:
        started_at = 1.7e9

        def totals(self):
            return TcpCounts(sent=12_345, received=67_890)

    worker = WarmClientAppWorker("127.0.0.1:1", meter=Meter())
    stamped = {"wire-sent-bytes": 12_345, "wire-received-bytes": 67_890,
               "wire-counted-since": 1.7e9}
    train_reply = reply_content(b"x", "d" * 64, {"num-examples": 3})
    worker._stamp(SimpleNamespace(content=train_reply))  # a reply, as the app returns it
    assert reply_parts(train_reply)[1] == {"num-examples": 3, **stamped}
    assert list(train_reply) == ["update"]  # no record of their own
    query_reply = RecordDict({"node": MetricRecord({"partition-id": 3})})
    worker._stamp(SimpleNamespace(content=query_reply))
    assert dict(query_reply["node"]) == {"partition-id": 3, **stamped}
    assert list(query_reply) == ["node"]


class _FakeTask:
    def __init__(self, task_id: int) -> None:
        self.task_id = task_id


class _FakeClient:
    closed = False

    def close(self) -> None:
        self.closed = True


def test_the_claim_loop_runs_each_task_once_and_survives_an_unreachable_node(monkeypatch):
    """Claims: node down, nothing waiting, two tasks; every claimed task runs once."""
    worker = WarmClientAppWorker("127.0.0.1:1", poll_seconds=0.01)
    answers = iter([httpx.ConnectError("down"), None, ("t1", _FakeTask(1)), None,
                    ("t2", _FakeTask(2))])
    client = _FakeClient()
    monkeypatch.setattr(worker, "_client", lambda component, token=None, retry=True: client)

    def claim(_client):
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    ran: list[tuple[str, int]] = []
    monkeypatch.setattr(worker, "claim", claim)
    monkeypatch.setattr(worker, "run_task", lambda token, task_id: (
        ran.append((token, task_id)) or warm.TaskOutcome(task_id, 5, "completed", 0.0)))
    outcomes = worker.serve(max_tasks=2)
    assert ran == [("t1", 1), ("t2", 2)]
    assert [o.task_id for o in outcomes] == [1, 2]
    assert client.closed


def test_a_revoked_or_failing_task_never_ends_the_worker(monkeypatch):
    """Flower's client sends its own process SIGINT when the SuperNode refuses a task's
    token (seen on an overloaded machine): that task is dropped and the worker claims
    the next; a task whose running raises is logged and the worker goes on too."""
    worker = WarmClientAppWorker("127.0.0.1:1", poll_seconds=0.01)
    answers = iter([("t1", _FakeTask(1)), ("t2", _FakeTask(2)), ("t3", _FakeTask(3))])
    monkeypatch.setattr(worker, "_client", lambda component, token=None, retry=True: (
        _FakeClient()))
    monkeypatch.setattr(worker, "claim", lambda _client: next(answers))
    flags = {}

    def run_task(token, task_id):
        flags[task_id] = worker._running = threading.Event()
        try:
            if task_id == 1:
                worker.interrupt()  # what the SIGINT handler calls
                return warm.TaskOutcome(task_id, 5, "failed", 0.0)
            if task_id == 2:
                raise RuntimeError("the node went away")
            return warm.TaskOutcome(task_id, 5, "completed", 0.0)
        finally:
            worker._running = None

    monkeypatch.setattr(worker, "run_task", run_task)
    outcomes = worker.serve(max_tasks=3)
    assert [(o.task_id, o.status) for o in outcomes] == [(1, "failed"), (2, "failed"),
                                                          (3, "completed")]
    assert flags[1].is_set() and not flags[3].is_set()
    assert "RuntimeError: the node went away" in outcomes[1].details
    assert not worker._stop.is_set()
    worker.interrupt()  # between tasks, SIGINT (Ctrl-C) stops the worker
    assert worker._stop.is_set()


def test_stop_ends_an_idle_worker_promptly(monkeypatch):
    worker = WarmClientAppWorker("127.0.0.1:1", poll_seconds=0.05)
    monkeypatch.setattr(worker, "_client", lambda component, token=None, retry=True: _FakeClient())
    monkeypatch.setattr(worker, "claim", lambda _client: None)
    thread = threading.Thread(target=worker.serve)
    thread.start()
    worker.stop()
    thread.join(timeout=5)
    assert not thread.is_alive()


def test_a_bad_poll_interval_is_refused_by_value():
    with pytest.raises(ValueError, match="poll_seconds must be in"):
        WarmClientAppWorker("127.0.0.1:1", poll_seconds=0.0)


def test_only_flower_app_folders_are_taken_off_the_import_path(tmp_path):
    home = tmp_path / "flwr-home"
    assert warm._is_flwr_app_dir(str(home / "apps" / "fedcomp.fedcomp.1.0.0.abc"))
    assert warm._is_flwr_app_dir(str(Path.home() / ".flwr" / "apps" / "x"))
    assert not warm._is_flwr_app_dir(str(tmp_path / "apps"))
    assert not warm._is_flwr_app_dir(sys.prefix)
