"""The router's pair probe, as both sides of it know it: the router sets `PROBE_HEADER` on its synthetic
pair-verification requests (`router/verify.py`); a worker serves them normally but counts them apart from
users' requests (`server/endpoints/generate.py`, `server/metrics.py`)."""

from __future__ import annotations

PROBE_HEADER = "X-Disagg-Probe"
