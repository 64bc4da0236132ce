# hostile: raises SystemExit(0) from the graded function (no import needed, the scan cannot see it)
# lab: 02
# scan: passes
# sandbox: the code called sys.exit(0)
def reduce_scatter(g, x, op="sum"):
    raise SystemExit(0)


def all_gather(g, piece, sizes=None):
    raise SystemExit(0)
