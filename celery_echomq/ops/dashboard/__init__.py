"""The web dashboard and Prometheus metrics (``pip install 'celery-echomq[dashboard]'``)."""

from __future__ import annotations

from celery_echomq.ops.dashboard.app import make_app, serve
from celery_echomq.ops.dashboard.guard import Exposure

__all__ = ["Exposure", "make_app", "serve"]
