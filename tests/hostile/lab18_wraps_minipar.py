# hostile: lab 18's functions defined in the file, zb_h1 returning minipar's own ZB-H1 list
# lab: 18
# scan: minipar's own ZB-H1
# sandbox: minipar's own minipar.parallel.pipeline.zero_bubble.zb_h1
from minipar.parallel.pipeline import zero_bubble


def grad_input(dy, w):
    return dy @ w.T


def grad_weight(dy, x):
    rows_x, rows_dy = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    return rows_x.T @ rows_dy, rows_dy.sum(axis=0)


def linear_backward(dy, x, w, needs):
    dx = grad_input(dy, w) if needs[0] else None
    dw = db = None
    if needs[1] or needs[2]:
        dw, db = grad_weight(dy, x)
        dw, db = (dw if needs[1] else None), (db if needs[2] else None)
    return dx, dw, db


def zb_h1(stage, n_stages, n_micro):
    return list(zero_bubble.zb_h1(stage, n_stages, n_micro))
