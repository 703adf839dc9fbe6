import os

import pytest

from tops_core import registry as registry_module


@pytest.fixture
def clean_env(monkeypatch):
    """No TOPS_* variable from the caller's shell leaks into a test."""
    for name in list(os.environ):
        if name.startswith("TOPS_"):
            monkeypatch.delenv(name)
    return monkeypatch


@pytest.fixture
def registry(clean_env):
    """A fresh, empty process-wide registry (no entry points) for the duration of one test."""
    fresh = registry_module.Registry(autoload=False)
    previous = registry_module.swap_default_registry(fresh)
    yield fresh
    registry_module.swap_default_registry(previous)
