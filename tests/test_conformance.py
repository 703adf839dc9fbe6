"""The conformance kit over every installed implementation (see tops_core.testing)."""

from tops_core.testing.suite import *  # noqa: F401,F403
