"""Serial test session: tests/mpi/ runs only under mpirun with --with-mpi (see Makefile)."""


def pytest_ignore_collect(collection_path, config):
    with_mpi = config.getoption("--with-mpi", default=False)
    return (not with_mpi) and "mpi" in collection_path.parts[-2:] and collection_path.name == "mpi"


import pytest  # noqa: E402


@pytest.fixture
def fixed_peak(monkeypatch):
    """The trainer's start-up matmul-peak measurement replaced by a constant (in-process runs)."""
    from minipar.train import trainer as train
    monkeypatch.setattr(train, "matmul_peak_flops", lambda dtype, seconds=0.1: 1e11)
