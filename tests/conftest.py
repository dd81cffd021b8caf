"""Shared fixtures. Plugins with more fixtures are registered here."""

pytest_plugins = ["tests.conftest_etcd", "tests.conftest_kube", "tests.conftest_postgres"]
