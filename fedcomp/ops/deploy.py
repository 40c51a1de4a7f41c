"""Deployment on Flower's own engine: certificates, keys and the commands to start it.

One SuperLink serves the run; one SuperNode per client machine trains on that
machine's partition. Nothing is insecure by default: the SuperLink speaks TLS with a
certificate from our own CA and admits only SuperNodes whose public keys were
registered (``--enable-supernode-auth``). This module builds the files and argument
lists; it starts nothing itself (``fedcomp deploy ...`` in :mod:`fedcomp.ops.cli` does),
so it is tested without Flower running.

Keys and certificates are made with ``cryptography`` (already a dependency of
Flower), not hand-rolled: a CA (EC P-384), a server certificate whose subject
alternative names are the addresses the SuperLink serves, and one EC P-256 key pair
per node in OpenSSH format (128-bit security; Flower 1.42 sends the node's public key
and a signature in the headers of every request, which P-256 makes about 90 bytes
shorter than P-384: about 1 kB a round and node), which is what ``flower-supernode
--auth-supernode-private-key`` and ``flwr supernode register`` read. Private keys are
written with mode 0600.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import re
import signal
import socket
import subprocess
import sys
import time
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import tomli_w

__all__ = [
    "Certificates",
    "flower_tool",
    "make_certificates",
    "parse_address",
    "superlink_argv",
    "supernode_argv",
    "write_connection",
]

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOST = re.compile(rf"^{_LABEL}(\.{_LABEL})*$")


@dataclass(frozen=True)
class Certificates:
    """Where the files of one deployment live (all under one folder)."""

    folder: Path

    @property
    def ca_cert(self) -> Path:
        return self.folder / "ca.crt"

    @property
    def ca_key(self) -> Path:
        """The CA's private key: kept apart from the folder whose files go to machines
        (``<folder>-ca-private/ca.key``), for signing more certificates later."""
        return self.folder.with_name(self.folder.name + "-ca-private") / "ca.key"

    @property
    def server_cert(self) -> Path:
        return self.folder / "server.pem"

    @property
    def server_key(self) -> Path:
        return self.folder / "server.key"

    def node_key(self, node: int) -> Path:
        """A node's private key (OpenSSH format, mode 0600): stays on that node."""
        return self.folder / f"node-{node}"

    def node_public_key(self, node: int) -> Path:
        """A node's public key: registered on the SuperLink with ``flwr supernode register``."""
        return self.folder / f"node-{node}.pub"


def _write_private(path: Path, data: bytes) -> None:
    """Write a secret so that it is never readable by others, not even for a moment."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # an existing file keeps its old mode through O_CREAT
        os.write(fd, data)
    finally:
        os.close(fd)


def make_certificates(folder: str | Path, *, hosts: Sequence[str] = ("localhost", "127.0.0.1"),
                      nodes: int = 2, days: int = 365) -> Certificates:
    """Create a CA, a SuperLink certificate for ``hosts``, and ``nodes`` node key pairs.

    Parameters
    ----------
    folder
        Output folder (created). Existing files are replaced.
    hosts
        DNS names and IP addresses the SuperLink is reached at; they all go into the
        server certificate's subject alternative names, which clients check.
        ``localhost`` and ``127.0.0.1`` are always added: the SuperLink's own helpers
        (``flower-superexec``, the ServerApp) dial it on loopback with the same CA, and
        without them no run would start.
    nodes
        How many SuperNode key pairs to make (``node-0`` ...).
    days
        Validity of the certificates.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    if not hosts:
        raise ValueError("make_certificates needs at least one host for the SuperLink")
    if nodes < 0:
        raise ValueError(f"nodes must be >= 0, got {nodes}")
    certs = Certificates(Path(folder))
    certs.folder.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC)
    pem = serialization.Encoding.PEM
    plain_key = dict(encoding=pem, format=serialization.PrivateFormat.PKCS8,
                     encryption_algorithm=serialization.NoEncryption())

    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedcomp deployment CA")])
    ca_cert = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .sign(ca_key, hashes.SHA384())
    )
    _write_private(certs.ca_key, ca_key.private_bytes(**plain_key))
    certs.ca_cert.write_bytes(ca_cert.public_bytes(pem))

    alt_names: list[x509.GeneralName] = []
    for host in dict.fromkeys([*hosts, "localhost", "127.0.0.1"]):
        try:
            alt_names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            alt_names.append(x509.DNSName(host))
    server_key = ec.generate_private_key(ec.SECP384R1())
    server_cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_name).public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]),
                       critical=False)
        .sign(ca_key, hashes.SHA384())
    )
    _write_private(certs.server_key, server_key.private_bytes(**plain_key))
    certs.server_cert.write_bytes(server_cert.public_bytes(pem))

    for node in range(nodes):
        key = ec.generate_private_key(ec.SECP256R1())
        _write_private(certs.node_key(node), key.private_bytes(
            encoding=pem, format=serialization.PrivateFormat.OpenSSH,
            encryption_algorithm=serialization.NoEncryption()))
        certs.node_public_key(node).write_bytes(key.public_key().public_bytes(
            encoding=serialization.Encoding.OpenSSH,
            format=serialization.PublicFormat.OpenSSH) + b"\n")
    return certs


def flower_tool(name: str) -> str:
    """A Flower command from the same environment as this Python (the project's venv)."""
    candidate = Path(sys.executable).with_name(name)
    return str(candidate) if candidate.exists() else name


def superlink_argv(certs: Certificates | None, *, host: str = "127.0.0.1", port: int = 8000,
                   database: str | Path | None = None) -> list[str]:
    """``flower-superlink`` with TLS and node authentication (insecure if ``certs`` is None).

    ``database`` keeps the SuperLink's state (runs, registered nodes) in a file so that
    a restarted SuperLink still knows them; without it the state is in memory.
    """
    argv = [flower_tool("flower-superlink"), "--host", host, "--port", str(port)]
    if certs is None:
        argv.append("--insecure")
    else:
        argv += ["--ssl-ca-certfile", str(certs.ca_cert), "--ssl-certfile",
                 str(certs.server_cert), "--ssl-keyfile", str(certs.server_key),
                 "--enable-supernode-auth"]
    if database is not None:
        argv += ["--database", str(database)]
    return argv


def supernode_argv(certs: Certificates | None, node: int, *, superlink: str,
                   partition_id: int, num_partitions: int, port: int = 9094,
                   state_dir: str | Path | None = None, data_dir: str | Path | None = None,
                   log_message_size: bool = False, clientapp: str = "warm") -> list[str]:
    """``flower-supernode`` for one node: its key, its partition, its own disk.

    The node config tells the ClientApp which partition to load (from ``data_dir`` on
    this machine: the data never crosses the network) and where to keep its state
    between rounds (``state_dir``), so that a restarted SuperNode carries on.

    ``clientapp`` is ``"warm"`` (the node starts no ClientApp itself: one
    :func:`clientapp_worker_argv` process runs them all, see
    :mod:`fedcomp.flower.warm`) or ``"per-message"`` (Flower's default: a fresh
    ``flwr-clientapp`` process per message).
    """
    if clientapp not in CLIENTAPP_MODES:
        raise ValueError(f"clientapp must be one of {CLIENTAPP_MODES}, got {clientapp!r}")
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"partition-id must be in [0, {num_partitions}), got {partition_id}")
    node_config = [f"partition-id={partition_id}", f"num-partitions={num_partitions}"]
    for key, value in (("state-dir", state_dir), ("data-dir", data_dir)):
        if value is not None:
            text = str(Path(value).resolve())
            if '"' in text or "'" in text:
                raise ValueError(f"{key} must not contain quotes: {text!r}")
            node_config.append(f'{key}="{text}"')
    if log_message_size:
        node_config.append("log-message-size=true")
    argv = [flower_tool("flower-supernode"), "--superlink", superlink, "--port", str(port),
            "--node-config", " ".join(node_config)]
    if clientapp == "warm":
        argv += ["--isolation", "process"]
    if certs is None:
        argv.append("--insecure")
    else:
        argv += ["--root-certificates", str(certs.ca_cert),
                 "--auth-supernode-private-key", str(certs.node_key(node))]
    return argv


#: How a SuperNode runs its ClientApp: one long-lived process, or Flower's one per message.
CLIENTAPP_MODES = ("warm", "per-message")


def clientapp_worker_argv(port: int, *, parent_pid: int | None = None,
                          superlink: str | None = None) -> list[str]:
    """The long-lived ClientApp process of the SuperNode whose Runtime API is ``port``.

    With the SuperNode's pid and the address it dials, the worker also counts the
    node's bytes on the wire and reports them with every reply.
    """
    argv = [sys.executable, "-m", "fedcomp.flower.warm",
            "--runtime-api-address", f"127.0.0.1:{port}"]
    if parent_pid is not None:
        argv += ["--parent-pid", str(parent_pid)]
    if superlink is not None:
        parse_address(superlink)
        argv += ["--superlink", superlink]
    return argv


def parse_address(address: str) -> tuple[str, int]:
    """``host:port`` (a DNS name, an IPv4 address or a bracketed IPv6 address) or
    ``ValueError`` naming what is wrong."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"address must be host:port with a port in 1-65535, got {address!r}")
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise ValueError(f"address host {host!r} is not an IPv6 address") from None
    elif not _HOST.match(host):
        raise ValueError(f"address host must be a DNS name or an IP address, got {host!r}")
    return host, int(port)


def write_connection(flwr_home: str | Path, name: str, address: str,
                     certs: Certificates | None) -> Path:
    """Add (or replace) a ``[superlink.NAME]`` connection in ``FLWR_HOME/config.toml``.

    ``flwr run . NAME``, ``flwr supernode register ... NAME`` and ``flwr ls NAME`` use
    it. With ``certs`` the CLI checks the SuperLink's certificate against our CA. The
    file is read and written with a TOML library (as Flower does), never edited as
    text, and the address must be ``host:port``.
    """
    if not _NAME.match(name):
        raise ValueError(f"connection name must be letters, digits, '-', '_' or '.': {name!r}")
    parse_address(address)
    path = Path(flwr_home) / "config.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    config = tomllib.loads(path.read_text()) if path.exists() else {}
    connection: dict[str, object] = {"address": address}
    if certs is None:
        connection["insecure"] = True
    else:
        connection["root-certificates"] = str(certs.ca_cert.resolve())
    config.setdefault("superlink", {})[name] = connection
    path.write_text(tomli_w.dumps(config))
    return path


# ---------------------------------------------------------------------- on one machine
def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Loopback:
    """A SuperLink and SuperNodes as processes on this machine, for tests and laptops.

    The same commands as a real deployment (TLS and node authentication unless
    ``secure=False``), with every port picked free, every file under ``workdir``
    (``FLWR_HOME`` included) and every process stopped on exit, also after an error.

    Parameters
    ----------
    workdir
        Folder for certificates, FLWR_HOME, node state, logs.
    env
        Environment for the Flower processes (:func:`fedcomp.ops.cli.flower_env`);
        ``FLWR_HOME`` is set to ``workdir/flwr-home``.
    nodes
        How many SuperNodes; node ``i`` trains on partition ``i`` of ``nodes``. Their
        keys are registered; one spare key pair (``nodes``) is made but not registered.
    start_nodes
        Start the SuperNodes on entry (else call :meth:`start_node`).
    clientapp
        ``"warm"`` (one long-lived ClientApp process per node, ``clientapp-<i>``) or
        ``"per-message"`` (Flower's process per message); see :func:`supernode_argv`.
    """

    connection = "loopback"

    def __init__(self, workdir: str | Path, env: dict[str, str], *, nodes: int = 2,
                 secure: bool = True, start_nodes: bool = True,
                 node_config: dict[str, str] | None = None, clientapp: str = "warm") -> None:
        self.clientapp = clientapp
        self.workdir = Path(workdir)
        self.env = {**env, "FLWR_HOME": str(self.workdir / "flwr-home")}
        self.nodes = nodes
        self.secure = secure
        self.start_nodes = start_nodes
        self.log_message_size = bool((node_config or {}).get("log-message-size"))
        self.port = free_port()
        self.node_ports = [free_port() for _ in range(nodes)]
        self.certs: Certificates | None = None
        self.processes: dict[str, subprocess.Popen] = {}
        #: Where node ``i`` dials the SuperLink, if not directly (e.g. a counting proxy).
        self.node_superlink: dict[int, str] = {}

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def state_dir(self, node: int) -> Path:
        return self.workdir / f"node-{node}-state"

    def log_path(self, name: str) -> Path:
        return self.workdir / f"{name}.log"

    def _start(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = self.log_path(name).open("ab")
        process = subprocess.Popen(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True, cwd=self.workdir)
        self.processes[name] = process
        return process

    def __enter__(self) -> Loopback:
        try:
            self.workdir.mkdir(parents=True, exist_ok=True)
            if self.secure:
                self.certs = make_certificates(self.workdir / "certs", nodes=self.nodes + 1)
            write_connection(self.env["FLWR_HOME"], self.connection, self.address, self.certs)
            self._start("superlink", superlink_argv(self.certs, port=self.port))
            self._wait_for_port(self.port, "superlink")
            if self.secure:
                for node in range(self.nodes):
                    self.register(node)
            for node in range(self.nodes if self.start_nodes else 0):
                self.start_node(node)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _wait_for_port(self, port: int, name: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            process = self.processes[name]
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited with {process.returncode}; "
                                   f"see {self.log_path(name)}")
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", port)) == 0:
                    return
            time.sleep(0.2)
        raise TimeoutError(f"{name} did not open port {port} within {timeout:.0f} s")

    def register(self, node: int) -> None:
        """``flwr supernode register``: admit a node's public key."""
        assert self.certs is not None
        proc = subprocess.run([flower_tool("flwr"), "supernode", "register",
                               str(self.certs.node_public_key(node)), self.connection],
                              env=self.env, capture_output=True, text=True, check=False,
                              cwd=self.workdir)
        if proc.returncode != 0:
            raise RuntimeError(f"registering node {node} failed (exit {proc.returncode}):\n"
                               f"{proc.stdout}\n{proc.stderr}")

    def start_node(self, node: int, *, key: int | None = None) -> subprocess.Popen:
        """Start (or restart) SuperNode ``node``; ``key`` picks another node's key pair."""
        argv = supernode_argv(self.certs, node if key is None else key,
                              superlink=self.node_superlink.get(node, self.address),
                              partition_id=node,
                              num_partitions=self.nodes, port=self.node_ports[node],
                              state_dir=self.state_dir(node),
                              log_message_size=self.log_message_size,
                              clientapp=self.clientapp)
        process = self._start(f"supernode-{node}", argv)
        if self.clientapp == "warm":
            self.stop(f"clientapp-{node}")
            self._start(f"clientapp-{node}",
                        clientapp_worker_argv(self.node_ports[node], parent_pid=process.pid,
                                              superlink=self.node_superlink.get(
                                                  node, self.address)))
        return process

    def restart_node(self, node: int, timeout: float = 180.0) -> None:
        """Start SuperNode ``node`` again, retrying until the SuperLink accepts it.

        A SuperNode that was killed (not stopped) stays "online" on the SuperLink until
        it misses its heartbeats (about 60 s in Flower 1.42), and the SuperLink refuses
        a second activation of the same node until then (exit code 305).
        """
        import time

        deadline = time.monotonic() + timeout
        log = self.log_path(f"supernode-{node}")
        while True:
            offset = log.stat().st_size if log.exists() else 0
            process = self.start_node(node)
            while process.poll() is None:
                with log.open("rb") as handle:
                    handle.seek(offset)
                    if b"SuperNode ID:" in handle.read():
                        return
                time.sleep(0.5)
            self.processes.pop(f"supernode-{node}", None)
            if time.monotonic() > deadline:
                raise TimeoutError(f"SuperNode {node} was not accepted again within "
                                   f"{timeout:.0f} s; see {log}")
            time.sleep(5)

    def stop(self, name: str, sig: int | None = None, timeout: float = 20.0) -> int | None:
        """Stop one process group (SIGTERM, or ``sig``); SIGKILL if it lingers."""
        process = self.processes.pop(name, None)
        if process is None:
            return None
        for attempt in (sig if sig is not None else signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(process.pid, attempt)
            except ProcessLookupError:
                pass
            try:
                return process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                continue
        return None

    def close(self) -> None:
        """Stop every process this deployment started (nodes first), helpers included.

        Flower's servers start their helpers (``flower-superexec``, ``flwr-serverapp``,
        ``flwr-clientapp``) in sessions of their own, out of reach of a process-group
        signal; they name the server's address on their command line, which is how
        they are found here.
        """
        for name in sorted(self.processes, key=lambda n: (n == "superlink", n.startswith("s"))):
            self.stop(name)
        addresses = [f"127.0.0.1:{port}".encode() for port in [self.port, *self.node_ports]]
        for pid in _processes_mentioning(addresses):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _processes_mentioning(needles: Sequence[bytes]) -> list[int]:
    """Ids of this user's processes whose command line contains one of ``needles`` (Linux)."""
    found = []
    proc = Path("/proc")
    if not proc.is_dir():
        return found
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            command = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if any(needle + b"\0" in command or command.endswith(needle) for needle in needles):
            found.append(int(entry.name))
    return found
