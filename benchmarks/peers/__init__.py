"""flow beside its peers end to end (``python3 dev.py bench --peers``): the runner, and each
peer's driver in a module of its own (the Python ones run in the peers' own virtualenv)."""
