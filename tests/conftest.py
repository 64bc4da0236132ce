"""Serial test session: tests/mpi/ runs only under mpirun with --with-mpi (see Makefile)."""


def pytest_ignore_collect(collection_path, config):
    with_mpi = config.getoption("--with-mpi", default=False)
    return (not with_mpi) and "mpi" in collection_path.parts[-2:] and collection_path.name == "mpi"
