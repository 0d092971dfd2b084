"""What runs processes: launch (spawn / torchrun), live rebalancing with weight moves, the ``epmoe run``
job (the engine on every rank) and its report, and the calibration of collectives for ``plan``'s profiles."""
