"""Tracing, metrics and logging setup."""
