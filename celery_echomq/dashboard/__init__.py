"""The web dashboard and Prometheus metrics (``pip install 'celery-echomq[dashboard]'``)."""

from __future__ import annotations

from .app import make_app, serve

__all__ = ["make_app", "serve"]
