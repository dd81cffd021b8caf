"""The cluster lease: how long an agent runs its jobs without word from the broker.

One rule both ends of the agent session follow, so that at no moment do two copies of a job
run (DESIGN.md, "State and failure"). Pure arithmetic: the agent's `session.leasing` keeps the
lease, the broker's settings check its grace against it at start.

- The agent's lease is renewed by every message the broker sends on a live session; the broker
  sends one at least every `heartbeat` seconds. An agent that has not heard from the broker for
  `fence_after` seconds fences itself: it creates no pods, and deletes the pods of its jobs
  whose `spec.failurePolicy.clusterLost` is `requeue` (they are reported `Cancelled` with
  `ClusterLost` once a broker welcomes it again). A `wait` job keeps running.
- The broker runs a lost cluster's jobs elsewhere only once the cluster's session has been gone
  for its grace, `--lost-after` (`lost_after`). The session ends no earlier than the agent's
  last renewal, so the agent's fence comes first when

      fence_after <= lost_after - margin,   margin = max(2 x heartbeat + 1 s, lost_after / 4)

  The margin covers the fence itself: deleting the pods and their stopping (with at most half
  the time left before the grace ends, `fence_grace`), and a heartbeat in flight; a quarter of
  a long grace leaves slow API servers room.
- An agent fences no sooner than it gives up a silent session itself (three heartbeats), so the
  broker refuses a grace of `minimum_lost_after(heartbeat)` = 5 x heartbeat + 1 s or less.
- A failover must reach the agents before they fence: the broker refuses a leader lease with
  which they would not (`check_leader_lease`).

The agent fences as late as the rule lets it, `lost_after` - margin (45 s of the default 60 s),
the broker's `lost_after` coming with its welcome (`messages.Welcome.lost_after_seconds`);
`--fence-after` makes it sooner, never later. With a broker that does not say its grace, the
agent's `--fence-after`, or 30 s (half the broker's default grace).

Fencing as late as it is safe matters because an agent cannot tell a partition from a broker
that is down: a broker that comes back counts its grace afresh (it requeues nothing it did not
see go), but an agent that hears nothing for its fence time stops its `requeue` jobs either
way. A broker outage shorter than the fence time stops nothing.
"""

from __future__ import annotations

DEFAULT_FENCE_AFTER_SECONDS = 30.0  # with a broker that does not say its grace
DEFAULT_LOST_AFTER_SECONDS = 60.0  # the broker's default grace, assumed when it sends none
SILENT_BEATS = 3  # heartbeats of silence after which either end gives up a session
MARGIN_BEATS = 2.0
MARGIN_SECONDS = 1.0
MARGIN_SHARE = 0.25  # of the grace, when that is more


def margin(heartbeat: float, lost_after: float) -> float:
    """Seconds between the agent's fence and the end of the broker's grace, at least."""
    return max(MARGIN_BEATS * heartbeat + MARGIN_SECONDS, MARGIN_SHARE * lost_after)


def minimum_lost_after(heartbeat: float) -> float:
    """The broker's grace must be above this: room for a fence after a silent session (the
    share of the grace never binds this short)."""
    return SILENT_BEATS * heartbeat + MARGIN_BEATS * heartbeat + MARGIN_SECONDS


def check_lost_after(lost_after: float, *, heartbeat: float) -> str | None:
    """Why a broker's grace is too short for its agents to fence themselves in time, in one
    line; None when it is long enough."""
    least = minimum_lost_after(heartbeat)
    if lost_after > least:
        return None
    return (
        f"--lost-after {lost_after:g} s must be above {least:g} s "
        f"({SILENT_BEATS + MARGIN_BEATS:g} x --heartbeat {heartbeat:g} s + {MARGIN_SECONDS:g} s): "
        f"agents fence themselves that long before the broker runs their jobs elsewhere"
    )


def check_leader_lease(lease: float, *, heartbeat: float, lost_after: float) -> str | None:
    """Why a leader's lease is too long for a failover to finish before agents fence, in one
    line; None when it is short enough.

    A leader that dies or freezes is replaced once its lease runs out; its agents notice the
    silence after `SILENT_BEATS` heartbeats, try the other replicas and reach the new leader
    about a heartbeat (a follower's Retry-After) and a second after both. That must come
    before they fence (`fence_after` with no `--fence-after`), or every failover stops every
    agent's `requeue` jobs."""
    fence = fence_after(None, heartbeat=heartbeat, lost_after=lost_after)
    reached = max(lease, SILENT_BEATS * heartbeat) + heartbeat + MARGIN_SECONDS
    if reached <= fence:
        return None
    return (
        f"--leader-lease-seconds {lease:g} is too long for --lost-after {lost_after:g} s and "
        f"--heartbeat {heartbeat:g} s: after a failover agents reach the new leader only "
        f"~{reached:g} s after the old one went quiet, and fence themselves at {fence:g} s; "
        f"shorten the lease or lengthen --lost-after"
    )


def fence_after(requested: float | None, *, heartbeat: float, lost_after: float | None) -> float:
    """Seconds without word from the broker after which the agent fences itself: `margin`
    before the end of the broker's grace when the broker said it, sooner if `requested`
    (`--fence-after`) is; without a grace, `requested` or 30 s. Never before a silent session
    is given up."""
    if lost_after is None:
        seconds = DEFAULT_FENCE_AFTER_SECONDS if requested is None else requested
    else:
        latest = lost_after - margin(heartbeat, lost_after)
        seconds = latest if requested is None else min(requested, latest)
    return max(seconds, SILENT_BEATS * heartbeat)


def fence_grace(fence: float, *, lost_after: float | None, failure_grace: float) -> float:
    """The grace period of the pods a fence deletes: at most half the time left between the
    fence and the end of the broker's grace, and at most the agent's failure grace."""
    left = (DEFAULT_LOST_AFTER_SECONDS if lost_after is None else lost_after) - fence
    return max(0.0, min(failure_grace, left / 2))
