"""Fixtures shared by the async-runtime tests: one SFT warm start per module, and configs
built from the module's own ``FAST`` overrides (each module sizes its runs)."""
import pytest

from asyncrl.config import load_config


@pytest.fixture(scope="module")
def sft_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("sft_cache")  # one warm start for the module


@pytest.fixture()
def cfg_of(request, tmp_path, sft_cache):
    """``cfg_of(*overrides)``: the quickstart with the module's ``FAST`` and this test's run dir."""
    def make(*extra):
        return load_config("quickstart", request.module.FAST + [f"logging.run_dir={tmp_path / 'run'}",
                                                                f"sft.cache_dir={sft_cache}", *extra])
    return make


@pytest.fixture(scope="package")
def local_ray():
    """One local Ray for the package's Ray tests (each ray.init costs seconds): 4 logical CPUs
    (the actors' bundles; the machine may have fewer cores) and 2 logical GPUs (for the checks
    of GPU counts; no test places an actor on them)."""
    import signal

    ray = pytest.importorskip("ray")
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    ray.init(num_cpus=4, num_gpus=2, include_dashboard=False, log_to_driver=False)
    for sig, handler in handlers.items():  # ray.init installs its own: the other tests expect the defaults
        signal.signal(sig, handler)
    yield
    ray.shutdown()
    for sig, handler in handlers.items():
        signal.signal(sig, handler)
