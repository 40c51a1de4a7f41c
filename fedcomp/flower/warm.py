"""A ClientApp process that lives for a whole run: one per SuperNode, warm between messages.

Flower 1.42 starts a fresh ``flwr-clientapp`` process for every message a SuperNode
receives (``--isolation subprocess``). Each one imports torch and the app and loads
its data partition again, which costs seconds per message and dominates a deployed
round. Flower has no option to keep a ClientApp alive, but it has a mode in which
the SuperNode starts nothing itself (``--isolation process``) and waits for an
outside process to claim its tasks on the node's local Runtime API. This module is
that process: it claims ``flwr-clientapp`` tasks one after another and runs each with
the same loaded ClientApp, so imports, the model's construction and partition loading
happen once per run instead of once per message.

It does per task what Flower's own ``flwr-clientapp`` does
(``flwr/supernode/runtime/run_clientapp.py``): pull the task input (message, context,
run, FAB), install the FAB, run the ClientApp, push the reply and the updated
context. It reuses Flower's functions for each step, which are internal to Flower.
That is why it runs only on the Flower version it was written against
(:data:`SUPPORTED_FLOWER`) and refuses any other with a clear error, and why a test
(``tests/test_flower_warm.py``) exercises every internal it uses.

What differs from Flower's per-message process:

- A task's heartbeat that the SuperNode answers with "task no longer valid", or a
  token it refuses (Flower's client then sends its own process SIGINT), ends that
  task (its reply is dropped), not the worker; Flower's process exits instead, and
  the SuperNode starts a new one for the next message. SIGTERM, or SIGINT between
  tasks, stops the worker.
- A ClientApp is loaded once per FAB hash. A run with a different FAB (new app code)
  gets a fresh load of the FAB's modules; the library installed on the node
  (``fedcomp``) is the one this worker imported.
- An exception in the ClientApp becomes an error reply, as in Flower, and the worker
  carries on with the next task.
- Given the SuperLink's address, it meters the SuperNode's connections to it
  (:class:`fedcomp.ops.netmeter.TcpByteMeter`) and adds the bytes sent and received so
  far to every reply's metrics (:func:`fedcomp.flower.stamp_wire_counts`): the server
  turns them into wire bytes per round and node (``rounds.csv``, ``clients.csv``).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import flwr

#: The Flower release whose internal task protocol this worker speaks.
SUPPORTED_FLOWER = "1.42."

logger = logging.getLogger("fedcomp.warm")


class UnsupportedFlowerError(RuntimeError):
    """The installed Flower is not the release this worker was written against."""


def check_flower_version(version: str = flwr.__version__) -> None:
    """Refuse any Flower but :data:`SUPPORTED_FLOWER`, naming both versions."""
    if not version.startswith(SUPPORTED_FLOWER):
        raise UnsupportedFlowerError(
            f"the warm ClientApp worker speaks Flower {SUPPORTED_FLOWER}x's internal task "
            f"protocol, but Flower {version} is installed; start the SuperNode with "
            "--clientapp per-message (Flower's own process per message) instead")


@dataclass
class TaskOutcome:
    """What one claimed task came to, for logs and tests."""

    task_id: int
    run_id: int
    status: str
    seconds: float
    details: str = ""


@dataclass
class WarmClientAppWorker:
    """Claims the ClientApp tasks of one SuperNode and runs them in this process.

    Parameters
    ----------
    runtime_api_address
        The SuperNode's local Runtime API (``flower-supernode --port``), host:port.
    poll_seconds
        Pause between two claims when no task is waiting. The SuperNode itself polls
        the SuperLink every 3 s (fixed in Flower 1.42), so 0.1 s here adds at most a
        tenth of a second to a message's latency.
    root_certificates
        PEM bytes when the node's Runtime API uses TLS; None for the loopback default.
    meter
        Counts the SuperNode's bytes on the wire; its totals go into every reply.
    """

    runtime_api_address: str
    poll_seconds: float = 0.1
    root_certificates: bytes | None = None
    meter: Any = None
    _apps: dict[str, Any] = field(default_factory=dict, init=False, repr=False)
    _fab_modules: dict[str, set[str]] = field(default_factory=dict, init=False, repr=False)
    _stop: threading.Event = field(default_factory=threading.Event, init=False, repr=False)
    #: The running task's "abandon" flag (None between tasks): see :meth:`interrupt`.
    _running: threading.Event | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        check_flower_version()
        if not 0.0 < self.poll_seconds <= 60.0:
            raise ValueError(f"poll_seconds must be in (0, 60], got {self.poll_seconds}")

    # -- the Runtime API ------------------------------------------------------------
    def _client(self, component: str, token: str | None = None, *, retry: bool = True):
        from flwr.supercore.interceptors import (
            RuntimeTokenHttpInterceptor,
            RuntimeVersionHttpInterceptor,
        )
        from flwr.supercore.retry import make_simple_http_retry_invoker
        from flwr.supercore.runtime import RuntimeHttpClient

        interceptors: list[Any] = [RuntimeVersionHttpInterceptor(component_name=component)]
        if token is not None:
            interceptors.append(RuntimeTokenHttpInterceptor(token))
        retry_invoker = make_simple_http_retry_invoker()
        if not retry:  # the claim loop retries itself, and must notice stop() promptly
            retry_invoker.max_tries = 1
        return RuntimeHttpClient.from_server_address(
            server_address=self.runtime_api_address,
            insecure=self.root_certificates is None,
            root_certificates=self.root_certificates,
            interceptors=interceptors,
            retry_invoker=retry_invoker,
        )

    def claim(self, client) -> tuple[str, Any] | None:
        """One ``AcquireTask`` for a ClientApp task: (token, task) or None."""
        from flwr.proto.runtime_pb2 import AcquireTaskRequest  # pylint: disable=E0611
        from flwr.supercore.constant import TaskType

        response = client.AcquireTask(AcquireTaskRequest(
            supported_task_types=[str(TaskType.CLIENT_APP)], agentapp_fab_hashes=[]))
        if response.HasField("task") and response.token:
            return response.token, response.task
        return None

    # -- one task ---------------------------------------------------------------------
    def _load_app(self, run, fab):
        """The ClientApp of this FAB: installed and imported once per FAB hash."""
        from flwr.cli.install import install_from_fab
        from flwr.clientapp.utils import get_load_client_app_fn
        from flwr.common.config import get_project_dir

        app = self._apps.get(fab.hash_str)
        if app is not None:
            return app
        install_from_fab(fab.content, skip_prompt=True)
        project_dir = Path(get_project_dir(run.fab_id, run.fab_version, fab.hash_str))
        self._forget_other_fabs(project_dir)
        before = set(sys.modules)
        app = get_load_client_app_fn(default_app_ref="", app_path=None, multi_app=True)(
            run.fab_id, run.fab_version, fab.hash_str)
        self._fab_modules[fab.hash_str] = {
            name for name in set(sys.modules) - before
            if _module_under(sys.modules[name], project_dir)}
        self._apps[fab.hash_str] = app
        logger.info("loaded ClientApp of FAB %s (%s %s)", fab.hash_str[:12], run.fab_id,
                    run.fab_version)
        return app

    def _forget_other_fabs(self, keep: Path) -> None:
        """Drop other FABs' apps and their modules, so a new FAB imports its own code."""
        for fab_hash in list(self._apps):
            for name in self._fab_modules.pop(fab_hash, set()):
                sys.modules.pop(name, None)
            del self._apps[fab_hash]
        sys.path[:] = [entry for entry in sys.path
                       if not _is_flwr_app_dir(entry) or Path(entry) == keep]

    def run_task(self, token: str, task_id: int = -1) -> TaskOutcome:
        """Run one claimed task to its end, as Flower's ``flwr-clientapp`` would.

        Never raises for the task's own failures: they become an error reply (when the
        message was pulled) and a FAILED task status, as in Flower.
        """
        from flwr.app import Message
        from flwr.app.error import Error
        from flwr.clientapp.client_app import LoadClientAppError
        from flwr.common.constant import ErrorCode, SubStatus
        from flwr.proto.runtime_pb2 import SendTaskHeartbeatRequest  # pylint: disable=E0611
        from flwr.supercore.heartbeat import HeartbeatSender
        from flwr.supernode.runtime.run_clientapp import (
            pull_task_input,
            push_message,
            push_task_output,
        )

        started = time.perf_counter()
        client = self._client("flwr-clientapp", token)
        abandoned = threading.Event()
        self._running = abandoned

        def heartbeat() -> bool:
            import httpx

            try:
                response = client.SendTaskHeartbeat(SendTaskHeartbeatRequest())
            except (httpx.TransportError, httpx.HTTPStatusError):
                return False
            if not response.success:
                abandoned.set()
            return True

        beats = HeartbeatSender(heartbeat)
        beats.start()
        message = reply = context = None
        run_id = -1
        status, details = SubStatus.FAILED, "ClientApp task failed due to unknown reason"
        try:
            message, context, run, fab = pull_task_input(client)
            run_id = run.run_id
            app = self._load_app(run, fab)
            reply = app(message=message, context=context)
            status, details = SubStatus.COMPLETED, ""
            if self.meter is not None and not reply.has_error():
                self._stamp(reply)
        except Exception as exc:  # every failure becomes an error reply
            code = ErrorCode.CLIENT_APP_RAISED_EXCEPTION
            reason = f"{type(exc)}:<'{exc}'>"
            if isinstance(exc, LoadClientAppError):
                code = ErrorCode.LOAD_CLIENT_APP_EXCEPTION
                reason = "An exception was raised when attempting to load `ClientApp`"
            logger.exception("ClientApp raised an exception")
            details = reason
            if message is not None:
                reply = Message(Error(code=code, reason=reason), reply_to=message)
        finally:
            try:
                if abandoned.is_set():
                    status, details = SubStatus.FAILED, "task no longer valid on the SuperNode"
                elif reply is not None and context is not None:
                    push_message(client, reply, context)
            except Exception:  # the node may be gone: logged, not raised
                logger.exception("could not push the reply")
                status, details = SubStatus.FAILED, "could not push the reply"
            try:
                push_task_output(client=client, context=context, sub_status=status,
                                 details=details)
            except Exception:  # a revoked token or a node that is gone: not the worker's end
                logger.exception("could not report the task's status")
            if beats.is_running:
                beats.stop()
            client.close()
            self._running = None
        return TaskOutcome(task_id=task_id, run_id=run_id, status=str(status),
                           seconds=time.perf_counter() - started, details=details)

    def _stamp(self, reply) -> None:
        """The node's wire counts so far into the reply (a failed read is logged)."""
        from fedcomp.flower import stamp_wire_counts

        try:
            counts = self.meter.totals()
        except OSError as exc:
            logger.warning("could not read the node's wire bytes: %s", exc)
            return
        stamp_wire_counts(reply.content, counts.sent, counts.received, self.meter.started_at)

    # -- the loop ---------------------------------------------------------------------
    def stop(self) -> None:
        self._stop.set()

    def interrupt(self) -> None:
        """SIGINT: drop the running task, or stop when idle.

        Flower's Runtime API client signals its own process with SIGINT when the
        SuperNode refuses a task's token (HTTP 401: the task was revoked, e.g. after
        late heartbeats on an overloaded machine); its per-message process then exits
        and the SuperNode starts another for the next message. Here one process serves
        every message, so the revoked task is dropped (no reply is pushed) and the
        worker goes on; a SIGINT between tasks (Ctrl-C) stops it.
        """
        running = self._running
        if running is None:
            self.stop()
            return
        running.set()
        logger.warning("the SuperNode revoked the running task (SIGINT from Flower's "
                       "client): its reply is dropped, the worker goes on")

    def serve(self, max_tasks: int | None = None) -> list[TaskOutcome]:
        """Claim and run tasks until :meth:`stop` (or ``max_tasks`` tasks ran).

        Waits for the SuperNode's Runtime API to come up and survives its restarts:
        an unreachable API is retried every ``poll_seconds`` (with a log line a minute).
        """
        import httpx

        outcomes: list[TaskOutcome] = []
        client = self._client("SuperExec", retry=False)
        last_warning = 0.0
        try:
            while not self._stop.is_set():
                try:
                    claimed = self.claim(client)
                except httpx.HTTPError as exc:
                    if time.monotonic() - last_warning > 60.0:
                        logger.warning("SuperNode Runtime API %s not reachable (%s); retrying",
                                       self.runtime_api_address, type(exc).__name__)
                        last_warning = time.monotonic()
                    claimed = None
                if claimed is None:
                    self._stop.wait(self.poll_seconds)
                    continue
                token, task = claimed
                try:
                    outcome = self.run_task(token, task.task_id)
                except Exception as exc:  # one task's trouble never ends the worker
                    logger.exception("task %d could not be run", task.task_id)
                    outcome = TaskOutcome(task_id=task.task_id, run_id=-1, status="failed",
                                          seconds=0.0, details=f"{type(exc).__name__}: {exc}")
                logger.info("task %d (run %d): %s in %.2f s%s", outcome.task_id,
                            outcome.run_id, outcome.status, outcome.seconds,
                            f" ({outcome.details})" if outcome.details else "")
                outcomes.append(outcome)
                if max_tasks is not None and len(outcomes) >= max_tasks:
                    break
        finally:
            client.close()
        return outcomes


def _module_under(module: Any, folder: Path) -> bool:
    path = getattr(module, "__file__", None)
    if not path:
        return False
    try:
        return Path(path).resolve().is_relative_to(folder.resolve())
    except OSError:
        return False


def _is_flwr_app_dir(entry: str) -> bool:
    """A FAB's install folder (``$FLWR_HOME/apps/...``), as Flower's loader adds them."""
    parts = Path(entry).parts
    return "apps" in parts and any(part.startswith(".flwr") or part == "flwr-home"
                                   for part in parts)


def _meter(pid: int | None, superlink: str | None):
    """A started byte meter of the SuperNode's connections to the SuperLink, or None
    (no address given, or a host whose kernel does not report byte counts)."""
    from fedcomp.ops.deploy import parse_address
    from fedcomp.ops.netmeter import TcpByteMeter, meter_available

    if pid is None or superlink is None:
        return None
    if not meter_available():
        logger.warning("this host's kernel does not report TCP byte counts: the node's "
                       "wire bytes are not recorded")
        return None
    return TcpByteMeter(pid, parse_address(superlink)[1]).start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fedcomp.flower.warm",
        description="Run a SuperNode's ClientApp tasks in one long-lived process "
                    "(start the SuperNode with --isolation process).")
    parser.add_argument("--runtime-api-address", required=True,
                        help="the SuperNode's local Runtime API, host:port")
    parser.add_argument("--root-certificates", default=None,
                        help="CA (PEM) of the node's Runtime API when it uses TLS")
    parser.add_argument("--poll-seconds", type=float, default=0.1)
    parser.add_argument("--parent-pid", type=int, default=None,
                        help="exit when this process (the SuperNode) exits")
    parser.add_argument("--superlink", default=None,
                        help="the address the SuperNode dials (host:port): with "
                             "--parent-pid, its bytes to it go into every reply")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(name)s:%(levelname)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per poll otherwise
    for handler in logging.getLogger().handlers:  # Flower's logger passes DEBUG records on
        handler.setLevel(logging.INFO)
    try:
        check_flower_version()
    except UnsupportedFlowerError as exc:
        print(f"fedcomp: {exc}", file=sys.stderr)
        return 2
    certificates = (Path(args.root_certificates).read_bytes()
                    if args.root_certificates else None)
    worker = WarmClientAppWorker(args.runtime_api_address, poll_seconds=args.poll_seconds,
                                 root_certificates=certificates,
                                 meter=_meter(args.parent_pid, args.superlink))
    if args.parent_pid is not None:
        from flwr.supercore.app_utils import start_parent_process_monitor

        start_parent_process_monitor(args.parent_pid)
    signal.signal(signal.SIGTERM, lambda *_: worker.stop())
    signal.signal(signal.SIGINT, lambda *_: worker.interrupt())
    worker.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
