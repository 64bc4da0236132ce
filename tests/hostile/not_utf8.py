# hostile: a file that is not UTF-8 (Latin-1 bytes)
# lab: 02
# scan: not UTF-8 text
# sandbox: not UTF-8 text
# résumé
def reduce_scatter(g, x, op="sum"):
    return x
