"""Scheduling: the pure planning core (which cluster for each job) and its async shell."""
