"""The fast loop: one replica more or fewer on the latency measured at the SLO's percentile.

The slow loop trusts the capacity model; the measurement says whether the model is right now. Over the target:
at least one more than now, whatever the model says (it is optimistic, or a burst is queued). Under SHRINK_BELOW
of the target while the model asks for exactly the current count: one fewer (the model is pessimistic). In
between nothing: the wide band keeps the two loops from taking turns. A target found infeasible is not corrected
upward: no replica count meets it, so adding one only spends. Neither step goes against the slow loop's direction
(it never shrinks what the model grows), so the decision stays monotone in the load.
"""

from .sizing import Need

SHRINK_BELOW = 0.5


def correct(need: Need, current: int, measured: float | None, target: float, what: str) -> Need:
    if measured is None or not need.feasible:
        return need
    if measured > target and need.replicas <= current:
        return Need(current + 1, f"{need.reason}; measured {what} {measured:.0f} ms over {target:g} ms -> one more")
    if measured < SHRINK_BELOW * target and need.replicas == current and current > 0:
        return Need(
            current - 1, f"{need.reason}; measured {what} {measured:.0f} ms under half of {target:g} ms -> one fewer"
        )
    return need
