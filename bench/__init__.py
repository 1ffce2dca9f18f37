"""GPU benchmarks and checks of ``nemo_gtp`` (a package: run ``python -m bench.<name>`` from the
repository root; ``bench/README.md`` maps each question to its script and current result).

The product never imports this package; its scripts import ``nemo_gtp`` and the test harnesses
(``tests.harness``), and share code through :mod:`bench.common`.
"""
