"""What operators use: the flow tree and its reads (``views``, ``timing``, ``listing``), the
repairs (``repair``, ``release``, ``cancel``, ``forget``), the ``celery echomq``
command (``cli``, ``cli_common``, ``rendering``, ``progress``) and the
dashboard (``dashboard``).

Imports ``store``, ``send`` and ``worker``; the top-level modules import it.
"""
