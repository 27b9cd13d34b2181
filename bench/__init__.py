"""Benchmarks and load tests of the planner (docs/performance.md); not part of the test run
(``tests/unit/test_fixed_prompt.py`` imports ``prompt`` and ``cl100k``).

``python -m bench`` runs everything in one process tree and one run, prints a markdown
table and writes ``bench/results/latest.json`` and ``latest.md``. Module map:

- ``__main__``: the command line.
- ``runner``: the process tree (``Environment``) and a run of every phase (``Bench``).
- ``context``: what the phases share (``BenchContext``, ``Rotating``, ``log``); ``phases/``:
  one module per phase (baselines, counts, concurrency, history, deltas, streams,
  profiling), each a ``BenchContext`` subclass.
- ``bare``: the bare gRPC echo server (``python -m bench.bare``) and its client.
- ``stack``: the dependencies in their own process (``python -m bench.stack``): devstack
  backends on PostgreSQL, the scripted LLM gateway, and a small control service.
- ``client``: Chat streams as a client drives them; direct dependency calls.
- ``database``: bare INSERT + COMMIT, PostgreSQL counters, seeded transcripts (T3).
- ``scenarios``: the scripted model's scenario.
- ``procs``: child processes, CPU seconds and memory from /proc.
- ``profile``: py-spy on the planner and the analysis of its samples.
- ``stats``, ``report``: percentiles, repeated runs, the table and the JSON.
- ``prompt``: ``python -m bench prompt``, the fixed prompt's cl100k_base tokens per part
  (T8, decision 0295); ``cl100k``: that tokenizer, built offline.

The method and its reasons: docs/performance.md and docs/decisions/0090-0092.
"""
