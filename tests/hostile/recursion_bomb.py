# hostile: recurses until the interpreter gives up
# lab: 02
# scan: passes
# sandbox: RecursionError
def reduce_scatter(g, x, op="sum"):
    return reduce_scatter(g, x, op)


def all_gather(g, piece, sizes=None):
    return all_gather(g, piece, sizes)
