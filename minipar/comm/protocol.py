"""The wire format: the tags that keep calls' messages apart, and the header that carries an
array's dtype and shape ahead of it.

Bytes go on the wire as raw bytes (MPI.BYTE), so any NumPy dtype works, float16 and
ml_dtypes' bfloat16 included.
"""
import numpy as np
from mpi4py import MPI

BYTE = MPI.BYTE

# Tags: collective call k of a group uses tag k % TAG_CYCLE (so overlapping async calls never
# match each other's messages); point-to-point and the debug check have their own tags.
# The MPI standard guarantees tags up to 32767.
TAG_CYCLE = 32000
TAG_P2P = 32001
TAG_DEBUG = 32002
TAG_TOPOLOGY = 32003
TAG_P2P_GRAD = 32004        # a second point-to-point stream: the pipeline's gradients (tag=)
HOST_BYTES = 64             # a host name as exchanged when a Group is made
HEADER_BYTES = 128          # send/recv header: b"<dtype>|<shape>" padded with zeros


# --------------------------------------------------------------------------------------------
# Point-to-point with dtype and shape: a 128-byte header message, then the payload message.

def _dtype_token(dtype):
    if dtype.fields is not None or dtype.hasobject:
        raise TypeError(f"minipar.comm sends plain numeric arrays, not dtype {dtype}")
    return dtype.name if dtype.kind == "V" else dtype.str      # bfloat16 is kind 'V'


def _token_dtype(token):
    try:
        return np.dtype(token)
    except TypeError:
        import ml_dtypes  # noqa: F401  (registers bfloat16 & co. with NumPy)
        return np.dtype(token)


def encode_header(x):
    text = f"{_dtype_token(x.dtype)}|{','.join(str(d) for d in x.shape)}".encode()
    if len(text) > HEADER_BYTES:
        raise ValueError(f"array header too long ({len(text)} B > {HEADER_BYTES} B): {text!r}")
    header = np.zeros(HEADER_BYTES, np.uint8)
    header[:len(text)] = np.frombuffer(text, np.uint8)
    return header


def decode_header(header):
    token, dims = bytes(header).rstrip(b"\0").decode().rsplit("|", 1)    # uint8 is "|u1"
    shape = tuple(int(d) for d in dims.split(",")) if dims else ()
    return _token_dtype(token), shape
