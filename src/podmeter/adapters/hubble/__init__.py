"""Hubble's Observer gRPC API, spoken by the agent: `hubble observe`, Hubble Relay and Hubble UI read podmeter's
flows (docs/hubble.md).

- ``proto/``: the ``.proto`` definitions (packages ``flow``, ``observer``, ``relay``, ``grpc.health.v1``: the
  subset of Hubble's API podmeter fills and its clients send) and the stubs generated from them
  (``make proto``; committed, see docs/hubble.md for why).
- ``flows``: a flow record as a Hubble ``flow.Flow``.
- ``filters``: a ``GetFlows`` request's allow and deny lists as a filter of flow records.
- ``server``: the gRPC server (``observer.Observer``, ``grpc.health.v1.Health``), its address and access rule.
"""
