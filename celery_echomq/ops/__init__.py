"""What operators use: the flow tree and its reads (``views``, ``timing``, ``listing``), the
repairs (``repair``, ``retry_deadline``, ``cancel``, ``forget``), the ``celery echomq``
command (``cli``, ``cli_common``, ``cli_repair``, ``rendering``, ``progress``) and the
dashboard (``dashboard``).

Imports ``store``, ``send`` and ``worker``; the top-level modules import it.
"""
