"""Test configuration: 8 simulated CPU devices (must be set before jax is imported).

``JAX_PLATFORMS=tpu python -m pytest -m "not slow" -p no:xdist`` runs the suite on one TPU chip instead:
tests/accelerator.py says what changes there (tolerances, skips) and why."""

import os
import sys

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# On CPU the suite compiles far more than it runs (hundreds of tiny programs, each run a few times), so its
# programs are compiled without LLVM's backend optimizations: the same HLO and the same float semantics (no
# fast-math either way) in much less time (docs/contributing.md). Exported,
# so the train_lm subprocesses the tests start compile the same way; a run of the guides
# (scripts/run_guides.py) clears XLA_FLAGS as a user's shell has it, and XLA_FLAGS naming its own level keeps
# that level.
if os.environ["JAX_PLATFORMS"] == "cpu" and "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"


# The tests live in one folder per part of the library (tests/data, tests/checkpoint, ...), and the support
# modules (helpers, accelerator, object_store, the workers) beside this file. Test modules import those and
# each other's builders by module name (``from test_train_lm import tiny_config``), so tests/ and each of its
# folders are importable whichever test is collected first.
_TESTS = os.path.dirname(os.path.abspath(__file__))
for _folder in [_TESTS] + sorted(entry.path for entry in os.scandir(_TESTS) if entry.is_dir()
                                 and any(name.startswith("test_") for name in os.listdir(entry.path))):
    if _folder not in sys.path:
        sys.path.insert(0, _folder)


from crash_rerun import pytest_handlecrashitem, pytest_report_teststatus  # noqa: E402,F401 -- hooks


def _tests_module(name):
    import importlib

    return importlib.import_module(name)


def pytest_configure(config):
    config.addinivalue_line("markers", "devices(n): needs n JAX devices; skipped with fewer (one TPU chip: 1)")
    config.addinivalue_line("markers", "sockets: starts local TCP servers; skipped where they cannot run "
                                       "(tests/accelerator.py: a TPU, LEVANTER_TEST_NO_SOCKETS=1)")
    _configure_xla_cache(config)  # first: JAX reads the cache's environment when it is imported
    _configure_embedded_dir(config)
    _configure_tpu()


def _configure_tpu():
    """On a TPU (``JAX_PLATFORMS=tpu`` given by the user; CPU stays the default): float32 matmuls at full
    precision, since the TPU's default runs them as bfloat16 passes (about three digits) and the tests
    compare float32 results to 1e-5; and subprocesses on the CPU, since only one process at a time can
    hold the chip (the subprocess tests then run as they do on CPU)."""
    if not _tests_module("accelerator").ON_TPU:
        return
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
    os.environ["JAX_PLATFORMS"] = "cpu"  # read by JAX at import: affects child processes only


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.first`` tests go to the front (stable otherwise): with ``-n 2 --dist worksteal`` (the
    slow step of .ci/run) one worker starts the longest test at once while the other works through the
    rest, and takes back part of the first one's queue when it runs dry, so neither waits long for the
    other at the end. Collected last, the longest test would run alone while the other core idles."""
    items.sort(key=lambda item: item.get_closest_marker("first") is None)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """``@pytest.mark.devices(n)`` and ``@pytest.mark.sockets``: skip before any fixture builds a mesh or
    starts a server."""
    marker = item.get_closest_marker("devices")
    if marker is not None:
        _tests_module("accelerator").require_devices(marker.args[0])
    if item.get_closest_marker("sockets") is not None:
        _tests_module("accelerator").require_sockets()


def _configure_xla_cache(config):
    """One persistent XLA compilation cache for the whole session, shared by the xdist workers and every
    ``train_lm`` subprocess the tests start (through the environment): the suite compiles the same tiny
    models' programs many times, and all but the first of each become cache hits. Set here, in the
    controlling process, before the workers start; ``LEVANTER_TEST_XLA_CACHE=0`` turns it off. A run keeps
    the directory the environment names (``trainer.jax_compilation_cache_dir`` null); without one, its default
    goes beside its checkpoints (levanter.utils.compile_cache), which tests put in temporary directories, so no
    test writes a cache under a home directory."""
    import tempfile

    if hasattr(config, "workerinput") or os.environ.get("LEVANTER_TEST_XLA_CACHE") == "0":
        return
    if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        config._levanter_xla_cache = tempfile.mkdtemp(prefix="levanter-test-xla-cache-")
        os.environ["JAX_COMPILATION_CACHE_DIR"] = config._levanter_xla_cache
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")


def _configure_embedded_dir(config):
    """One directory for the embedded corpus's text (``LEVANTER_EMBEDDED_DIR``, levanter.ingest.embedded),
    shared like the compilation cache: the tests and the ``train_lm`` subprocesses they start build many
    caches from ``embedded://`` URLs, each in a new directory, and each would otherwise parse the stdlib
    again (about 3 s on a busy 2-core machine). Set in the controlling process; a directory the environment
    already names is kept."""
    import tempfile

    if hasattr(config, "workerinput") or os.environ.get("LEVANTER_EMBEDDED_DIR"):
        return
    config._levanter_embedded_dir = tempfile.mkdtemp(prefix="levanter-test-embedded-")
    os.environ["LEVANTER_EMBEDDED_DIR"] = config._levanter_embedded_dir


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    """A pytest-xdist worker, its tests and fixtures done: collect its garbage now and freeze the rest
    (``gc.freeze``). After this hook the worker reports that it finished, the controller closes the
    connection, and execnet sends the worker a SIGINT if it is still busy 5 s later; pytest's own clean-up
    then runs a full collection, which on a worker's large heap (JAX's) took longer than that on a loaded
    machine, so the KeyboardInterrupt landed in JAX's gc callback (``_xla_gc_callback``) and printed a
    traceback. Collected here, while the controller still waits, the last collection has nothing to do."""
    if not hasattr(session.config, "workerinput"):
        return
    import gc

    gc.collect()
    gc.freeze()


def pytest_unconfigure(config):
    import shutil

    for attr in ("_levanter_xla_cache", "_levanter_embedded_dir"):
        directory = getattr(config, attr, None)
        if directory:
            shutil.rmtree(directory, ignore_errors=True)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Name the tests run again after their worker died (tests/crash_rerun.py), and report the size of the
    bad-input catalogue (tests/main/test_bad_inputs.py) when it was collected."""
    import sys

    _tests_module("crash_rerun").summarize(terminalreporter)

    module = sys.modules.get("test_bad_inputs") or sys.modules.get("tests.test_bad_inputs")
    cases = getattr(module, "CASES", None)
    if cases is not None:
        areas = sorted({c.area for c in cases})
        terminalreporter.write_line(f"bad-input catalogue: {len(cases)} cases ({len(areas)} areas)")


# ------------------------------------------------------------------ local object stores (tests/object_store.py)
# One moto server and one GCS emulator per test session, started on first use and stopped at the end. While
# a server is active its environment (AWS_ENDPOINT_URL + keys, STORAGE_EMULATOR_HOST) is set in os.environ
# for in-process clients; ``.env`` holds the same variables for subprocesses.

def _object_store_module():
    _tests_module("accelerator").require_sockets()  # every fixture below starts a local server
    return _tests_module("object_store")


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
