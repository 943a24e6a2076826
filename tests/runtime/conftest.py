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
