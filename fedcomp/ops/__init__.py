"""Running and reading experiments: the ``fedcomp`` command line
(:mod:`~fedcomp.ops.cli`), results files (:mod:`~fedcomp.ops.results`), sweeps
(:mod:`~fedcomp.ops.sweep`), reports and plots (:mod:`~fedcomp.ops.report`) and
deployment helpers (:mod:`~fedcomp.ops.deploy`).
"""
