# hostile: returns an object whose repr never ends and whose comparisons are always true
# lab: 02
# scan: passes
# sandbox: not an array
class Liar:
    def __eq__(self, other):
        return True

    def __repr__(self):
        while True:
            pass


def reduce_scatter(g, x, op="sum"):
    return Liar()


def all_gather(g, piece, sizes=None):
    return Liar()
