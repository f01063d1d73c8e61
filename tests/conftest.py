"""Test configuration: 8 simulated CPU devices (must be set before jax is imported)."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Report the size of the bad-input catalogue (tests/test_bad_inputs.py) when it was collected."""
    import sys

    module = sys.modules.get("test_bad_inputs") or sys.modules.get("tests.test_bad_inputs")
    cases = getattr(module, "CASES", None)
    if cases is not None:
        areas = sorted({c.area for c in cases})
        terminalreporter.write_line(f"bad-input catalogue: {len(cases)} cases ({len(areas)} areas)")
