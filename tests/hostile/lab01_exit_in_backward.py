# hostile: lab 01's backwards end the process with exit code 0 before any result
# lab: 01
# scan: import of os
# sandbox: exited before returning its results
import os


def layernorm_backward(dout, x, w, eps=1e-5):
    os._exit(0)


def softmax_backward(dout, y):
    os._exit(0)


def cross_entropy_backward(logits, targets, dloss, loss_denom):
    os._exit(0)
