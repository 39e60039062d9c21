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

# The suite loads hundreds of throwaway models: their recorded plans (runtime/plan_cache.py)
# go to a directory of the run's own, inherited by the processes tests start, never into the
# user's cache. A test of the plan cache itself picks its own.
if not os.environ.get("LLAMBDA_PLAN_DIR"):
    import atexit
    import shutil
    import tempfile
    os.environ["LLAMBDA_PLAN_DIR"] = tempfile.mkdtemp(prefix="llambda-test-plans-")
    atexit.register(shutil.rmtree, os.environ["LLAMBDA_PLAN_DIR"], True)


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
    from llambda import default_model
    return str(default_model.gguf_path())


@pytest.fixture(scope="module", params=("avx2", "avx512"))
def isa(request, native):
    """Every qgemm variant this CPU runs; the others are skipped (and say so)."""
    from helpers import runnable
    return runnable(request.param)
