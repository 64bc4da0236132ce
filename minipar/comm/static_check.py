"""The static check that keeps minipar honest: Python source that references one of MPI's own
collectives (Allreduce, Bcast, Reduce_scatter, ...), found by walking its syntax tree.
Library code may only send and receive (docs/design.md §5); the tests run this over minipar/,
and the labs' graders over a student's file.
"""
import ast

# MPI's collectives as mpi4py spells them: buffer-based (upper case), their non-blocking
# (I...) and persistent (..._init) forms, and the pickle-based lower-case ones.
_UPPER = ["Allgather", "Allgatherv", "Allreduce", "Alltoall", "Alltoallv", "Alltoallw",
          "Barrier", "Bcast", "Exscan", "Gather", "Gatherv", "Reduce", "Reduce_scatter",
          "Reduce_scatter_block", "Scan", "Scatter", "Scatterv",
          "Neighbor_allgather", "Neighbor_allgatherv", "Neighbor_alltoall",
          "Neighbor_alltoallv", "Neighbor_alltoallw"]
FORBIDDEN = set(_UPPER) | {"I" + n.lower() for n in _UPPER} | {n + "_init" for n in _UPPER} | {
    "allgather", "allreduce", "alltoall", "barrier", "bcast", "exscan", "scan",
    "ibarrier", "ibcast", "igather", "iscatter", "iallgather", "iallreduce", "ialltoall",
    "ireduce", "neighbor_allgather", "neighbor_alltoall"}
# gather, reduce and scatter are also minipar's own names (comm.gather(g, x)), and reduce is
# NumPy's and functools'; they are MPI's when called on a communicator: g.comm.gather(...),
# MPI.COMM_WORLD.reduce(...).
AMBIGUOUS = {"gather", "reduce", "scatter"}
COMMUNICATOR_NAMES = {"comm", "mpi_comm", "COMM_WORLD", "COMM_SELF", "world", "Intracomm", "Comm"}


def _receiver_is_communicator(node):
    return (isinstance(node, ast.Attribute) and node.attr in COMMUNICATOR_NAMES) or \
        (isinstance(node, ast.Name) and node.id in COMMUNICATOR_NAMES - {"comm"})


def mpi_collective_uses(source, filename="<source>"):
    """(line, text) of every MPI collective referenced in Python source."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Attribute):
            if node.attr in FORBIDDEN or (node.attr in AMBIGUOUS
                                          and _receiver_is_communicator(node.value)):
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, (ast.ImportFrom,)) and node.module and "mpi4py" in node.module:
            found += [(node.lineno, f"import {a.name}") for a in node.names if a.name in FORBIDDEN]
    return found
