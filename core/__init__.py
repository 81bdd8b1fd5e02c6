"""core: the leaf every other package may import (and which imports none of them).

- `core.events`: structured events, the only machine-readable record (the chaos harness, tests and
  metrics read events, never log text).
- `core.deadline`: one deadline type for every bounded wait.
- `core.procfs`: the one place that parses `/proc`.
- `core.owned_dir`: directories in shared tmpfs that one process owns, and the sweep of those left by dead ones.
- `core.numbers`: numbers read from names and keys that others may have written.
"""
