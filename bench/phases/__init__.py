"""The phases of a benchmark run, each a ``BenchContext`` subclass over the shared context
(``bench.context``); ``bench.runner.Bench`` is all of them."""
