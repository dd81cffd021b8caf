"""The backlog: the queued jobs between cycles, which of them a cycle plans, and which sit out
unplanned until a change could admit them. Built on `planning.plan_cycle`, which knows nothing
of it."""
