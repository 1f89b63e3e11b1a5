"""Celery's and kombu's wire formats, owned in one place: what the extension writes where a
worker without it, or Celery's own ``AsyncResult``, reads it back.

kombu's Redis message: what one is built from (``envelope``), one built once per kind of job
and reused with its JSON in pieces (``templates``), kombu's own steps for each with every
queue's messages in one LPUSH (``pushes``), and stored jobs sent in one batch, or handed to the
enqueue script to push itself (``publish``). Celery's result record as the store writes it: the
key, the encoded meta, its expiry and the channel it is published on (``results``), which
``complete.lua`` writes as given.

The store's scripts hard-code neither format: they take each piece from their KEYS and ARGV,
computed here (``store/lua/README.md``). Imports ``store`` and nothing of ``send``, ``worker``
or ``ops``.
"""
