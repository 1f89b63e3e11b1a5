"""The web dashboard and Prometheus metrics (``pip install 'celery-echomq[dashboard]'``)."""

from __future__ import annotations

from .app import make_app, serve
from .guard import Exposure

__all__ = ["Exposure", "make_app", "serve"]
