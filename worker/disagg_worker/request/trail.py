"""The stages a traced request went through in the scheduler process, as timestamps.

The scheduler process runs no OpenTelemetry: a request sent with `GenerateReq.traced` gets a `Trail` on its
`engine.request.Req`, the queues and the scheduler mark its stages on it (`begin`/`end`, wall-clock
nanoseconds), and each `TokenOut` carries the stages completed since the last one back to the HTTP process,
which makes them spans of the request's trace with these start and end times (`disagg_worker.tracing`). An
untraced request holds `NO_TRAIL`, one `NoTrail` shared by all of them, which records nothing: the engine marks
every request's stages with plain calls, and an untraced one costs a call that does nothing where a stage
changes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

Attrs = dict[str, str | int | float | bool]


@dataclass(frozen=True)
class Stage:
    """One stage of a request: its name, wall-clock start and end (ns since the epoch) and attributes."""

    name: str
    start_ns: int
    end_ns: int
    attrs: Attrs = field(default_factory=dict)


class Trail:
    """The stages of one traced request: those begun and not yet ended, and those done and not yet sent.

    A name may be begun again before its earlier stage ended (a prompt's next chunk scheduled while the previous
    one is in flight): `end` ends the oldest."""

    __slots__ = ("_done", "_open")

    def __init__(self) -> None:
        self._open: dict[str, list[tuple[int, Attrs]]] = {}
        self._done: list[Stage] = []

    def begin(self, name: str, **attrs: str | int | float | bool) -> None:
        self._open.setdefault(name, []).append((time.time_ns(), attrs))

    def begin_once(self, name: str, **attrs: str | int | float | bool) -> None:
        """Begin `name` unless it is open already."""
        if name not in self._open:
            self.begin(name, **attrs)

    def end(self, name: str, **attrs: str | int | float | bool) -> None:
        """End the oldest open stage called `name` (nothing if none is open), adding `attrs` to it."""
        opened = self._open.get(name)
        if not opened:
            return
        start, begun = opened.pop(0)
        if not opened:
            del self._open[name]
        self._done.append(Stage(name, start, time.time_ns(), {**begun, **attrs}))

    def mark(self, name: str, **attrs: str | int | float | bool) -> None:
        """A moment: a stage that ends as it begins."""
        now = time.time_ns()
        self._done.append(Stage(name, now, now, attrs))

    def finish(self, **attrs: str | int | float | bool) -> None:
        """The request ended: every open stage ends now, with `attrs`."""
        for name in list(self._open):
            while name in self._open:
                self.end(name, **attrs)

    def take(self) -> tuple[Stage, ...]:
        """The stages done since the last take (each is sent once)."""
        done, self._done = tuple(self._done), []
        return done


class NoTrail(Trail):
    """The trail of an untraced request: it records nothing and has nothing to send (`take` is empty). It holds
    no state, so one (`NO_TRAIL`) serves every untraced request."""

    __slots__ = ()

    def __init__(self) -> None:
        pass

    def begin(self, name: str, **attrs: str | int | float | bool) -> None:
        pass

    def begin_once(self, name: str, **attrs: str | int | float | bool) -> None:
        pass

    def end(self, name: str, **attrs: str | int | float | bool) -> None:
        pass

    def mark(self, name: str, **attrs: str | int | float | bool) -> None:
        pass

    def finish(self, **attrs: str | int | float | bool) -> None:
        pass

    def take(self) -> tuple[Stage, ...]:
        return ()


NO_TRAIL = NoTrail()
