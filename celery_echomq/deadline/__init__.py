"""Deadlines: a flow's fan-in kept by the store, failed or released exactly once when its
deadline passes while it still waits (see README, "Deadlines").

- ``spec``: the deadline as given, checked, in the one form plans and payloads carry (pure);
- ``store``: the scripts (``deadline_arm``, ``deadline``, ``deadline_cut``, ``deadline_done``,
  ``retry_deadline``) as typed calls;
- ``fire``: what a worker does for a due deadline, and what it does next (record the failure,
  dispatch the parent, revoke the children cut);
- ``poller``: the thread every worker with ``install(app)`` runs, polling each queue's
  deadline index;
- ``retry``: an operator's retry of a flow failed by its deadline, with a new one.
"""
