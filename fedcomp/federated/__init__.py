"""The federated round, without Flower: what a client does with a message and what the
server does with the replies.

* client side: :mod:`~fedcomp.federated.client_round` (train, encode, keep state);
* server side: strict reply fields (:mod:`~fedcomp.federated.replies`), decoding and
  bounded aggregation (:mod:`~fedcomp.federated.aggregation`,
  :mod:`~fedcomp.federated.robust`), the server optimizer
  (:mod:`~fedcomp.federated.server_opt`), model averaging
  (:mod:`~fedcomp.federated.averaging`), the downlink
  (:mod:`~fedcomp.federated.downlink`), reproducible sampling
  (:mod:`~fedcomp.federated.sampling`);
* both: checkpoints (:mod:`~fedcomp.federated.checkpoint`) and injected faults and
  attacks for experiments (:mod:`~fedcomp.federated.faults`).

The Flower apps (``clients/``, ``server/``, ``strategies/``) call these.
"""
