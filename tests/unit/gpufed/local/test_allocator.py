"""The broker's allocator under the local supervisor: jemalloc when the loader finds it."""

from __future__ import annotations

from gpufed.local import allocator


def test_with_jemalloc_found_the_broker_preloads_it_with_the_purging_settings() -> None:
    env = allocator.service_env({}, find=lambda: "libjemalloc.so.2")
    assert env == {
        "PYTHONMALLOC": "malloc",
        "LD_PRELOAD": "libjemalloc.so.2",
        "MALLOC_CONF": allocator.JEMALLOC_CONF,
    }


def test_without_jemalloc_the_broker_runs_on_the_c_library_allocator() -> None:
    assert allocator.service_env({}, find=lambda: None) == {"PYTHONMALLOC": "malloc"}


def test_a_preload_or_an_opt_out_leaves_the_allocator_alone() -> None:
    found = lambda: "libjemalloc.so.2"  # noqa: E731
    assert "LD_PRELOAD" not in allocator.service_env({"LD_PRELOAD": "libother.so"}, find=found)
    assert "LD_PRELOAD" not in allocator.service_env({"GPUFED_JEMALLOC": "0"}, find=found)


def test_the_operators_own_settings_win() -> None:
    env = allocator.service_env(
        {"PYTHONMALLOC": "pymalloc", "MALLOC_CONF": "narenas:2"}, find=lambda: "libjemalloc.so.2"
    )
    assert env["PYTHONMALLOC"] == "pymalloc"
    assert env["MALLOC_CONF"] == "narenas:2"
