# hostile: aborts the whole MPI job through the communicator the group carries
# lab: 02
# scan: .Abort: ends or reshapes the MPI job
# sandbox: exited before returning its results
def reduce_scatter(g, x, op="sum"):
    g.comm.Abort(0)


def all_gather(g, piece, sizes=None):
    g.comm.Abort(0)
