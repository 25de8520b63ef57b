import pytest


@pytest.fixture(autouse=True)
def _small_tensors(one_thread):
    yield

