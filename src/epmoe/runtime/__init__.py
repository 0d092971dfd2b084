"""What runs processes: launch (spawn / torchrun), lockstep generation, live rebalancing with weight moves,
the ``epmoe run`` job and its report, and the calibration of collectives for ``plan``'s profiles."""
