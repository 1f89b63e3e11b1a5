"""The store: everything that touches Redis.

Keys and the id gate (``keyspace``), the connection (``connection``), the Lua scripts, one per
transition (``lua/``, read by ``loader``, run by ``runner``, called as typed methods of
``scripts.Scripts`` with their replies in ``replies``), the stored-message codec (``codec``),
the message headers a flow job carries (``headers``), the process's handle on all of it
(``state``), pure reads (``reads``) and deadlines (``deadline_spec``, ``deadlines``). What the
scripts write in Celery's and kombu's formats (a result record, a queue's messages) they take
from their callers' arguments, computed in ``wire``.

Imports only ``errors``, ``config`` and ``tracing`` from above it.
"""
