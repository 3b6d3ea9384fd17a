"""What the worker and the operator both spell, and nothing else: standard library only.

The two are installed apart: the operator's image holds `disagg_operator` and this package, never the worker
(torch); the worker needs no kopf. What both must name the same way lives here, so that neither imports the
other: the engine's settings (`settings`), from which the worker makes its command line and configuration and
the operator the workers' arguments.
"""
