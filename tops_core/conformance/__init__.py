"""The engine of the conformance kit, free of pytest: case grids from capability declarations,
the test data of docs/ops.md, the tolerance table, and the checks. ``tops_core.testing`` is its pytest
front end; ``tops bench`` uses the same data and tolerances."""
