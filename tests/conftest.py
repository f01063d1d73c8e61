"""Test configuration: 8 simulated CPU devices (must be set before jax is imported)."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def pytest_configure(config):
    """One persistent XLA compilation cache for the whole session, shared by the xdist workers and every
    ``train_lm`` subprocess the tests start (through the environment): the suite compiles the same tiny
    models' programs many times, and all but the first of each become cache hits. Set here, in the
    controlling process, before the workers start; ``LEVANTER_TEST_XLA_CACHE=0`` turns it off."""
    import tempfile

    if hasattr(config, "workerinput") or os.environ.get("LEVANTER_TEST_XLA_CACHE") == "0":
        return
    if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        config._levanter_xla_cache = tempfile.mkdtemp(prefix="levanter-test-xla-cache-")
        os.environ["JAX_COMPILATION_CACHE_DIR"] = config._levanter_xla_cache
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")


def pytest_unconfigure(config):
    import shutil

    directory = getattr(config, "_levanter_xla_cache", None)
    if directory:
        shutil.rmtree(directory, ignore_errors=True)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Report the size of the bad-input catalogue (tests/test_bad_inputs.py) when it was collected."""
    import sys

    module = sys.modules.get("test_bad_inputs") or sys.modules.get("tests.test_bad_inputs")
    cases = getattr(module, "CASES", None)
    if cases is not None:
        areas = sorted({c.area for c in cases})
        terminalreporter.write_line(f"bad-input catalogue: {len(cases)} cases ({len(areas)} areas)")


# ------------------------------------------------------------------ local object stores (tests/object_store.py)
# One moto server and one GCS emulator per test session, started on first use and stopped at the end. While
# a server is active its environment (AWS_ENDPOINT_URL + keys, STORAGE_EMULATOR_HOST) is set in os.environ
# for in-process clients; ``.env`` holds the same variables for subprocesses.

import pytest  # noqa: E402


def _object_store_module():
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)
    import object_store

    return object_store


@pytest.fixture(scope="session")
def s3_server():
    """A moto S3 server with the bucket ``levanter-test``: ``.url(path)`` -> ``s3://levanter-test/path``."""
    server = _object_store_module().S3Server()
    server.activate()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def gcs_server():
    """A GCS emulator with the bucket ``levanter-test``: ``.url(path)`` -> ``gs://levanter-test/path``."""
    server = _object_store_module().GcsServer()
    server.activate()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def fault_proxy():
    """``fault_proxy(server, fail_fraction=0.1, delay_s=(0.02, 0.05), seed=0, fail_status=503)`` starts a
    :class:`object_store.FaultProxy` in front of ``server`` and points this process's environment at it for
    the rest of the test (``proxy.env_for(server)`` gives the same for subprocesses)."""
    module = _object_store_module()
    started = []
    saved: dict[str, str | None] = {}

    def start(server, fail_fraction=0.1, delay_s=(0.02, 0.05), seed=0, fail_status=503):
        proxy = module.FaultProxy(server.port, fail_fraction=fail_fraction, delay_s=delay_s, seed=seed,
                                  fail_status=fail_status)
        started.append(proxy)
        for k, v in proxy.env_for(server).items():
            saved.setdefault(k, os.environ.get(k))
            os.environ[k] = v
        return proxy

    try:
        yield start
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        for proxy in started:
            proxy.close()
