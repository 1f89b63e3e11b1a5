"""What a worker with ``install(app)`` runs: the signal receivers (``signals``, ``received``),
settling a finished job against its parent (``settle``), deadlines as they pass
(``deadlines``, ``deadline_poller``), and recovery by evidence (``recovery``).

Imports ``store`` and ``send``; nothing of ``ops``.
"""
