"""Process launch, lockstep generation and the ``epmoe run`` job."""
