"""Pure planning: which cluster for each queued job, over a snapshot. No await, no clock, no I/O."""
