"""Reference implementations of the planner's dependencies (README.md).

Who owns what:

- ``server``: ``DevStack``/``DevStackConfig``, the composition root: one grpc.aio server
  with the tracker, skills and knowledge backends (and, through ``extra_services``, the
  LLM gateway), gRPC health and reflection. ``__main__``: ``python -m devstack``.
- ``tracker``, ``skills``, ``knowledge``: the servicers (request and proto conversion).
- ``rpc``: what every backend RPC does around its work (identity, faults, the call
  record, errors as ``google.rpc.Status``); ``auth``: tokens, actor, roles;
  ``errors``: the error family; ``pages``: AIP-158 page sizes and tokens;
  ``calls`` and ``faults``: the call record and fault injector tests use.
- ``store``: the SQL store (SQLite or PostgreSQL) and its queries.
- ``importers``: beads ``issues.jsonl``, ADR folders, skill folders.
- ``demo``: the built-in demo project and the scripted model's demo scenario.
- ``gateway``: the LLM gateway and its providers.
"""
