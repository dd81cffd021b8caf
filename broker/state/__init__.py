"""Durable state of the broker: the Store protocol and its etcd and SQLite implementations."""
