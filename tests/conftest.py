import os

import pytest
from hypothesis import HealthCheck, settings

# Kernel tests are fuzzed; in CI the examples are fixed (derandomized) so a
# green run is reproducible. LLAMBDA_HYPOTHESIS=thorough draws more examples.
settings.register_profile("ci", deadline=None, derandomize=True, max_examples=60,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("dev", deadline=None, max_examples=60,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("thorough", deadline=None, max_examples=1000,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("LLAMBDA_HYPOTHESIS", "ci" if os.environ.get("CI") else "dev"))

# The suite loads hundreds of throwaway models. Their conversions, checksum stamps and
# recorded plans go to a cache of the run's own (LLAMBDA_CACHE_DIR, inherited by the processes
# tests start), never into the user's: it holds links to what the suite only reads there (the
# downloaded models, the kernel library, llama.cpp's vocabulary fixtures, tests/fetched_files.py's
# files). A test of a cache itself picks its own directory.
SHARED_CACHE_DIRS = ("models", "kernels", "vocab", "test-data")

if not os.environ.get("LLAMBDA_TEST_CACHE"):
    import atexit
    import shutil
    import tempfile
    from llambda.runtime import paths as _paths
    _user_cache = _paths.cache_dir()
    _run_cache = tempfile.mkdtemp(prefix="llambda-test-cache-")
    for _name in SHARED_CACHE_DIRS:
        (_user_cache / _name).mkdir(parents=True, exist_ok=True)
        os.symlink(_user_cache / _name, os.path.join(_run_cache, _name))
    os.environ["LLAMBDA_CACHE_DIR"] = os.environ["LLAMBDA_TEST_CACHE"] = _run_cache
    atexit.register(shutil.rmtree, _run_cache, True)


@pytest.fixture(scope="session")
def native():
    from llambda.runtime import get_backend
    return get_backend("avx2")


@pytest.fixture(scope="session")
def ref():
    from llambda.runtime import get_backend
    return get_backend("numpy")


@pytest.fixture(scope="session")
def default_gguf():
    """The default model's GGUF (SmolLM2-135M-Instruct Q4_1), fetched by `make test`'s setup
    into the user cache. LLAMBDA_TEST_GGUF points at another copy."""
    path = os.environ.get("LLAMBDA_TEST_GGUF")
    if path:
        return path
    from llambda.model import default_model
    return str(default_model.gguf_path())


@pytest.fixture(scope="module", params=("avx2", "avx512"))
def isa(request, native):
    """Every qgemm variant this CPU runs; the others are skipped (and say so)."""
    from helpers import runnable
    return runnable(request.param)
