"""Moved to `core.procfs` (the one place that parses /proc). Kept only for the importers not yet
switched (tests/conftest.py, tests/integration/test_elastic_faults.py, bench/recovery_bench.py);
delete this file once they import `core.procfs`."""

from core.procfs import descendants, kill_tree

__all__ = ["descendants", "kill_tree"]
