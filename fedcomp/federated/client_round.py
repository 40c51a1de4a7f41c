"""One client round, without Flower: sync the replica, train, compress the delta.

The ClientApp (``clients/app.py``) only moves records in and out of Flower messages;
everything it does is here, so it can be tested by calling a function.

State that must survive between rounds, per client: the replica of the shared model
(downlink), the error-feedback memory (uplink) and the last update sent, until the
server says whether it applied it (if not, it goes back into the memory:
:func:`settle_unconfirmed`). It travels as a flat dict of
numpy arrays (:meth:`ClientState.to_arrays`), which the Flower adapter stores in
``context.state``. State that does not match the run (another codec, another model)
is dropped with a warning and the client starts clean.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedcomp.codecs.feedback import ErrorFeedback, NoFeedback, StateMismatchError, make_feedback
from fedcomp.codecs.policy import EncodedUpdate, encode_update, encode_within_budget
from fedcomp.codecs.wire import unpack_payload
from fedcomp.config import RunConfig
from fedcomp.errors import PayloadError
from fedcomp.federated.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from fedcomp.federated.downlink import DownlinkMessage, Replica, model_digest
from fedcomp.privacy import PrivacyAccountant, clip_update, noise_source, update_norm
from fedcomp.privacy.accounting import dp_sgd_plan
from fedcomp.privacy.release import released_client_metrics
from fedcomp.tasks import get_task
from fedcomp.tasks.data import ArrayDataset
from fedcomp.tasks.models import build_model, model_shapes
from fedcomp.tasks.training import load_arrays, state_arrays

__all__ = ["ClientResult", "ClientState", "RoundSettings", "SettingsUnknown", "encode_delta",
           "load_state_file", "model_shapes", "resolve_settings", "run_client_round",
           "save_state_file", "saved_replica_digest", "settle_unconfirmed", "state_file"]

log = logging.getLogger(__name__)

_REPLICA_PREFIX = "replica/"
_ROUND_KEY = "replica-round"
_UNCONFIRMED_PAYLOAD_KEY = "payload"
_UNCONFIRMED_ROUND_KEY = "round"


@dataclass
class ClientState:
    """What a client keeps between rounds."""

    replica: Replica
    feedback: Any
    #: dp = "sample": the client's Opacus accountant history (noise, rate, steps),
    #: one accountant for the client's whole life.
    dp_history: list[tuple[float, float, int]] = field(default_factory=list)
    #: The payload last sent and its round, kept until the server says whether it
    #: applied it (error feedback only). The payload, not its decoded values: a few kB
    #: against a model's worth of floats, decoded only if it was lost.
    unconfirmed: bytes = b""
    unconfirmed_round: int | None = None

    @classmethod
    def fresh(cls, cfg: RunConfig) -> ClientState:
        return cls(Replica(), make_feedback(cfg.feedback, cfg.uplink_policy.description))

    def to_arrays(self) -> dict[str, dict[str, np.ndarray]]:
        replica = {_REPLICA_PREFIX + k: v for k, v in (self.replica.model or {}).items()}
        replica[_ROUND_KEY] = np.array([-1 if self.replica.round is None
                                        else self.replica.round], dtype=np.int64)
        groups = {"replica": replica, "feedback": self.feedback.state_dict()}
        if self.dp_history:
            groups["privacy"] = {"history": np.array(self.dp_history, dtype=np.float64)}
        # Always written (round -1 when settled), so that a settled update never
        # lingers in a context.state that is updated group by group.
        groups["unconfirmed"] = {
            _UNCONFIRMED_PAYLOAD_KEY: np.frombuffer(self.unconfirmed, dtype=np.uint8).copy(),
            _UNCONFIRMED_ROUND_KEY: np.array(
                [-1 if self.unconfirmed_round is None else self.unconfirmed_round],
                dtype=np.int64)}
        return groups

    @classmethod
    def from_arrays(cls, cfg: RunConfig, saved: Mapping[str, Mapping[str, np.ndarray]],
                    shapes: Mapping[str, tuple[int, ...]]) -> ClientState:
        """Restore saved state; anything that does not fit this run is dropped."""
        state = cls.fresh(cfg)
        history = (saved.get("privacy") or {}).get("history")
        if history is not None:
            rows = np.asarray(history, dtype=np.float64).reshape(-1, 3)
            state.dp_history = [(float(a), float(b), int(c)) for a, b, c in rows]
        replica = saved.get("replica") or {}
        if replica:
            model = {k[len(_REPLICA_PREFIX):]: np.array(v, dtype=np.float32)
                     for k, v in replica.items() if k.startswith(_REPLICA_PREFIX)}
            if {k: v.shape for k, v in model.items()} == dict(shapes):
                state.replica = Replica(model, int(np.asarray(replica[_ROUND_KEY])[0]))
            else:
                log.warning("saved replica does not match the model; full sync next")
        try:
            state.feedback.load_state_dict(saved.get("feedback") or {}, shapes=shapes)
        except (StateMismatchError, TypeError) as exc:
            log.warning("dropping saved error-feedback state: %s", exc)
            return state  # an unconfirmed update belongs with the memory it left
        except (KeyError, ValueError) as exc:
            log.warning("dropping unusable error-feedback state: %s", exc)
            return state
        unconfirmed = saved.get("unconfirmed") or {}
        if (isinstance(state.feedback, ErrorFeedback) and _UNCONFIRMED_ROUND_KEY in unconfirmed
                and _UNCONFIRMED_PAYLOAD_KEY in unconfirmed
                and int(np.asarray(unconfirmed[_UNCONFIRMED_ROUND_KEY])[0]) >= 0):
            state.unconfirmed = np.asarray(unconfirmed[_UNCONFIRMED_PAYLOAD_KEY],
                                           dtype=np.uint8).tobytes()
            state.unconfirmed_round = int(np.asarray(unconfirmed[_UNCONFIRMED_ROUND_KEY])[0])
        return state


def saved_replica_digest(saved: Mapping[str, Mapping[str, np.ndarray]]) -> str:
    """The digest of the replica in saved state ("" if there is none).

    A node tells the server this when it (re)connects, so that a per-client downlink
    sends a catch-up only to a node that still holds the replica it applies to.
    """
    replica = saved.get("replica") or {}
    model = {k[len(_REPLICA_PREFIX):]: np.asarray(v, dtype=np.float32)
             for k, v in replica.items() if k.startswith(_REPLICA_PREFIX)}
    return model_digest(model) if model else ""


def state_file(state_dir: str | Path, run_id: int, partition_id: int) -> Path:
    """Where a node keeps its state for one run and partition (never shared)."""
    return Path(state_dir) / f"fedcomp-run{run_id}-partition{partition_id}.npz"


def save_state_file(path: Path, groups: Mapping[str, Mapping[str, np.ndarray]], *,
                    run_id: int, partition_id: int, server_round: int) -> None:
    """Persist a client's state atomically (temporary file, then rename)."""
    arrays = {f"{group}/{key}": value for group, values in groups.items()
              for key, value in values.items()}
    save_checkpoint(path, arrays, {"run_id": run_id, "partition_id": partition_id,
                                   "round": server_round, "groups": sorted(groups)})


def load_state_file(path: Path, *, run_id: int, partition_id: int
                    ) -> dict[str, dict[str, np.ndarray]]:
    """Read a state file; a missing, corrupt or foreign one gives ``{}`` (and a log line)."""
    if not path.exists():
        return {}
    try:
        arrays, meta = load_checkpoint(path)
    except CheckpointError as exc:
        log.warning("ignoring unreadable client state %s (%s); starting clean", path, exc)
        return {}
    if meta.get("run_id") != run_id or meta.get("partition_id") != partition_id:
        log.warning("ignoring client state %s: it is for run %s partition %s; starting clean",
                    path, meta.get("run_id"), meta.get("partition_id"))
        return {}
    groups: dict[str, dict[str, np.ndarray]] = {g: {} for g in meta.get("groups", [])}
    for key, value in arrays.items():
        group, _, name = key.partition("/")
        if group not in groups:
            log.warning("ignoring client state %s: unexpected entry %r", path, key)
            return {}
        groups[group][name] = value
    log.info("restored client state from %s (saved after round %s)", path, meta.get("round"))
    return groups


def settle_unconfirmed(state: ClientState, outcomes: Mapping[int, bool] | None,
                       cfg: RunConfig, shapes: Mapping[str, tuple[int, ...]]) -> float:
    """Settle the last update sent: give it back to the memory if it was never applied.

    ``outcomes`` is what the server says of this node's recent rounds: round -> whether
    the node's update went into the model. An update that arrived after the round's
    timeout, was rejected, or whose round was abandoned (fewer than min-clients) was
    not applied. Returns the norm of what was given back (0 if nothing). Where the
    server says nothing of the unconfirmed update's round (it restarted, say), the
    update is dropped unconfirmed, as plain error feedback would: giving back an update
    the server did apply would count it twice. The kept payload is decoded as the
    server would have (with ``shared-randk``, lifted from that round's subspace); one
    that no longer decodes (saved state from another codec) is dropped with a warning.
    """
    given_back = 0.0
    lost_round = state.unconfirmed_round
    if (lost_round is not None and outcomes and outcomes.get(lost_round) is False
            and isinstance(state.feedback, ErrorFeedback)):
        try:
            lost = unpack_payload(state.unconfirmed, expected=cfg.uplink_expected(shapes)).tensors
        except PayloadError as exc:
            log.warning("dropping the unconfirmed update of round %d: %s", lost_round, exc)
        else:
            subspace = cfg.subspace(lost_round)
            if subspace is not None:
                lost = subspace.lift(lost, shapes)
            state.feedback.give_back(lost)
            given_back = update_norm(lost)
    state.unconfirmed, state.unconfirmed_round = b"", None
    return given_back


def encode_delta(cfg: RunConfig, feedback: Any, delta: Mapping[str, np.ndarray], *,
                 server_round: int, clip_norm: float, rng: np.random.Generator,
                 shapes: Mapping[str, tuple[int, ...]],
                 model: Mapping[str, np.ndarray] | None = None
                 ) -> tuple[EncodedUpdate, dict[str, float]]:
    """Encode a client's delta into the round's payload; return it and any DP metric.

    The plain path is :func:`fedcomp.codecs.policy.encode_update` with the error-feedback
    memory; with ``uplink-budget`` it is
    :func:`fedcomp.codecs.policy.encode_within_budget`. Under ``dp = "client"`` or with
    a shared subspace the compensated update is transformed as a whole before coding:
    ``u = delta + residual``, restricted to the round's subspace, clipped to
    ``clip_norm`` (client-level DP), then coded. The new
    residual is what the server will not get of ``u``: the coordinates outside the
    subspace and the codec's error. What clipping cut off is dropped, not remembered:
    kept, every excess would come back in later rounds and crowd out new updates.
    ``model`` is the model the delta starts from (the replica), which
    ``budget-worth = "relative"`` measures each tensor's change against.
    """
    subspace = cfg.subspace(server_round)
    meta = {"round": server_round}
    budget = cfg.uplink_budget_bytes(shapes)
    if budget is not None:  # config refuses a budget with a subspace or client-level DP
        return encode_within_budget(delta, cfg.uplink_policy, budget, feedback=feedback,
                                    rng=rng, meta=meta, model=model), {}
    if subspace is None and cfg.dp != "client":
        return encode_update(delta, cfg.uplink_policy, feedback=feedback, rng=rng, meta=meta), {}
    compensated = feedback.compensate(delta)
    projected = subspace.project(compensated) if subspace is not None else compensated
    sent, metrics = projected, {}
    if cfg.dp == "client":
        sent, norm = clip_update(projected, clip_norm)
        # Adaptive clipping's bit: was the update under the clip? (noised on the server)
        metrics["dp-unclipped"] = float(norm <= clip_norm)
    update = encode_update(sent, cfg.uplink_policy, rng=rng, meta=meta,
                           selection=shapes if subspace is not None else None)
    accounted = {name: projected[name] - sent[name] + np.asarray(update.decoded[name])
                 for name in projected}
    if subspace is not None:
        accounted = subspace.lift(accounted, shapes)
    feedback.keep({name: compensated[name] - accounted[name] for name in compensated})
    return update, metrics


class SettingsUnknown(ValueError):
    """A train message named the run config by digest and this node does not hold it."""


@dataclass(frozen=True)
class RoundSettings:
    """What a train message's config says: the run config and this round's values."""

    cfg: RunConfig
    server_round: int
    #: DP-FedAvg's clipping norm C for this round (it moves with adaptive clipping).
    clip_now: float | None
    #: The full run config when the message carried it: the node keeps it for the
    #: rounds that send only its digest.
    to_keep: dict[str, Any] | None


def resolve_settings(sent: Mapping[str, Any], *, kept: Mapping[str, Any] | None,
                     run_config: Mapping[str, Any] | None) -> RoundSettings:
    """The run config of a train message, sent in full or as ``settings-digest``.

    A digest alone is resolved from the settings this node kept from an earlier
    message, else from Flower's own ``context.run_config`` (which ``flwr run`` fills
    with the run's config), whichever has that digest; otherwise
    :class:`SettingsUnknown` (the reply is an error, and the server sends the settings
    in full next time).
    """
    settings = dict(sent)
    server_round = int(settings.pop("server-round"))
    clip_now = settings.pop("dp-clip-current", None)
    digest = settings.pop("settings-digest", None)
    clip = None if clip_now is None else float(clip_now)
    if settings:
        return RoundSettings(RunConfig.from_mapping(settings), server_round, clip, settings)
    for source in (kept, run_config):
        if source:
            try:
                cfg = RunConfig.from_mapping(dict(source))
            except ValueError:
                continue
            if cfg.settings_digest() == digest:
                return RoundSettings(cfg, server_round, clip, None)
    raise SettingsUnknown(f"round {server_round}: this node does not hold the run config "
                          f"of digest {digest!r} (a restarted node); the server sends it "
                          "in full next time")


def dp_sgd_plan_reply(cfg: RunConfig, data: ArrayDataset) -> dict[str, float | str]:
    """What a node tells the server of its DP-SGD before round 1 (``dp = "sample"``).

    Its sampling rate, steps a round and example count, so that the server can refuse
    a target epsilon that one round already exceeds; or, if ``dp-delta`` is not below
    1/n for its n examples, an ``error`` naming the key.
    """
    if len(data) == 0:
        return {"error": "a client has no examples: DP-SGD cannot run on it"}
    if cfg.dp_delta >= 1 / len(data):
        return {"error": f"run config 'dp-delta' = {cfg.dp_delta:g} must be below 1/n = "
                         f"{1 / len(data):.3g} for a client's n = {len(data)} examples"}
    rate, steps = dp_sgd_plan(len(data), batch_size=cfg.batch_size, epochs=cfg.local_epochs,
                              steps=cfg.local_steps)
    return {"rate": rate, "steps": steps, "examples": len(data)}


@dataclass
class ClientResult:
    """A client's reply: the payload and the metrics it reports."""

    payload: bytes
    metrics: dict[str, float] = field(default_factory=dict)
    replica_digest: str = ""


def run_client_round(
    cfg: RunConfig,
    state: ClientState,
    message: DownlinkMessage,
    data: ArrayDataset,
    *,
    server_round: int,
    client_seed: int,
    delta_scale: float = 1.0,
    clip_norm: float | None = None,
    outcomes: Mapping[int, bool] | None = None,
) -> ClientResult:
    """Sync the replica, train locally, and encode the delta with error feedback.

    ``client_seed`` (the partition id) seeds the client's shuffling and codec
    randomness and orders the server's sum. ``delta_scale`` multiplies the delta
    before encoding; fault injection uses it to play a poisoned message. That message
    is encoded without error feedback and leaves the client's memory untouched, so
    one poisoned round does not turn the client into a permanent poisoner.
    ``clip_norm`` is this round's DP-FedAvg clipping norm (it moves with adaptive
    clipping); ``cfg.dp_clip_norm`` if None. ``outcomes`` is what the server says of
    this node's recent updates (see :func:`settle_unconfirmed`).

    Raises
    ------
    fedcomp.federated.downlink.ReplicaOutOfSync
        If the message cannot bring the replica up to date (the server then sends
        the full model next time).
    fedcomp.errors.PayloadError
        If a downlink payload is invalid.
    """
    torch.set_num_threads(1)  # two threads per client collapse when clients share 2 cores
    shapes = model_shapes(cfg.task_name)
    model, sync_s = _sync_replica(cfg, state, message, shapes)
    replica_digest = model_digest(state.replica.model)
    loss, train_s, dp_metrics = _train_locally(cfg, state, model, data, shapes,
                                               server_round=server_round,
                                               client_seed=client_seed)
    after = state_arrays(model)
    delta = {k: after[k] - v for k, v in state.replica.model.items()}
    feedback = state.feedback
    delta_norm = update_norm(delta)
    if delta_scale != 1.0:
        delta = {k: v * np.float32(delta_scale) for k, v in delta.items()}
        feedback = NoFeedback()

    given_back = settle_unconfirmed(state, outcomes, cfg, shapes)
    residual_in = (state.feedback.residual_norm()
                   if isinstance(state.feedback, ErrorFeedback) else 0.0)
    update, clip_metrics = encode_delta(
        cfg, feedback, delta, server_round=server_round,
        clip_norm=cfg.dp_clip_norm if clip_norm is None else clip_norm,
        rng=np.random.default_rng([cfg.seed, client_seed, server_round]), shapes=shapes,
        model=state.replica.model)
    dp_metrics.update(clip_metrics)
    if isinstance(feedback, ErrorFeedback):  # a poisoned message leaves memory alone
        state.unconfirmed = update.payload
        state.unconfirmed_round = server_round
    metrics = {
        "num-examples": float(len(data)),
        "partition-id": float(client_seed),
        "train-loss": float(loss),
        "train-s": train_s,
        "encode-s": update.encode_s,
        "payload-bytes": float(len(update.payload)),
        "downlink-bytes": float(message.nbytes),
        "downlink-decode-s": sync_s,
        "replica-round": float(state.replica.round or 0),
        "residual-norm-in": residual_in,
        "given-back-norm": given_back,
        "delta-norm": delta_norm,
        **dp_metrics,
    }
    if cfg.dp != "none":  # nothing measured on the client's data leaves it un-noised
        metrics = released_client_metrics(metrics)
    return ClientResult(update.payload, metrics, replica_digest)


def _sync_replica(cfg: RunConfig, state: ClientState, message: DownlinkMessage,
                  shapes: Mapping[str, tuple[int, ...]]) -> tuple[Any, float]:
    """Apply the downlink message to the replica; return the model, loaded with the
    replica's weights, and the seconds it took.

    The model is built once: its round-0 weights seed an empty replica (shared-init),
    or a per-client catch-up the server sends from round 0 (a node it has not seen,
    such as a restarted one), then it takes the replica's weights for training.
    """
    model = build_model(cfg.task_name, seed=cfg.seed)
    start = time.perf_counter()
    initial = (state_arrays(model) if cfg.shared_init and (
        state.replica.model is None or message.kind == "catchup") else None)
    state.replica.apply(message, shapes, cfg.downlink_policy, initial)
    sync_s = time.perf_counter() - start
    assert state.replica.model is not None
    load_arrays(model, state.replica.model)
    return model, sync_s


def _train_locally(cfg: RunConfig, state: ClientState, model: Any, data: ArrayDataset,
                   shapes: Mapping[str, tuple[int, ...]], *, server_round: int,
                   client_seed: int) -> tuple[float, float, dict[str, float]]:
    """Train ``model`` on the client's data; return the loss (NaN under DP-SGD), the
    seconds it took and, under ``dp = "sample"``, the DP-SGD figures the server
    replays in its accountant."""
    start = time.perf_counter()
    dp_metrics: dict[str, float] = {}
    loss = math.nan
    if cfg.dp == "sample":
        from fedcomp.privacy.dpsgd import train_dp_sgd  # torch and Opacus only when needed

        subspace = cfg.subspace(server_round)
        accountant = PrivacyAccountant(cfg.dp_accountant, list(state.dp_history))
        rate, steps_taken = train_dp_sgd(
            model, data.x, data.y, epochs=cfg.local_epochs, steps=cfg.local_steps,
            batch_size=cfg.batch_size, lr=cfg.lr, momentum=cfg.momentum,
            noise_multiplier=cfg.dp_noise_multiplier, max_grad_norm=cfg.dp_clip_norm,
            accountant=accountant, delta=cfg.dp_delta,
            noise=noise_source(cfg.dp_reproducible_noise,
                               [cfg.seed, client_seed, server_round, 0xD5]),
            target_epsilon=cfg.dp_target_epsilon,
            masks=subspace.masks(shapes) if subspace is not None else None)
        state.dp_history = list(accountant.history)
        dp_metrics.update({"dp-sample-rate": rate, "dp-steps": float(steps_taken)})
    else:
        loss = get_task(cfg.task_name).train(
            model, data.x, data.y, epochs=cfg.local_epochs, steps=cfg.local_steps,
            batch_size=cfg.batch_size, lr=cfg.lr, momentum=cfg.momentum,
            proximal_mu=cfg.proximal_mu, seed=client_seed * 100_003 + server_round)
    return loss, time.perf_counter() - start, dp_metrics
