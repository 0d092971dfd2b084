"""The parts of ``benchmarks/multigpu.py``, one module each (see that script's docstring)."""
