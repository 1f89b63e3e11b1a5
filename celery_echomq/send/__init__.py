"""Sending a flow, from one entry (``producer.send_flow``, which ``canvas.flow`` hands its
shape to): what ``flow()`` accepts checked (``accepts``), any canvas shaped into nested flows
of single tasks (``shape``, ``ids``), planned (``plan``), started (``start``), its messages
published (through ``wire``, which owns their format), grown while it runs (``grow``), and its
parent dispatched once released (``dispatch``). ``tasks``: the internal tasks a canvas parent
runs.

Imports ``store`` and ``wire``, and nothing of ``worker`` or ``ops``.
"""
