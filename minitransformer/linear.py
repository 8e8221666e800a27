"""A projection: y = x @ w.T + b, for a batch of vectors, float or quantized weights.

Serves every forward pass (model.py) and experiment 12 (batching). The B x T vectors of a call
go in as one flat (B*T, in) matrix, so every weight is read once for the whole batch: a decode
step reads weights, and one read now serves B tokens (what batching buys). How the product
itself goes into BLAS (one call or several, chosen by timing the BLAS running here) is blas.py;
a quantized weight multiplies itself from its codes (quant/matmul.py).
"""
from minitransformer.backend import xp
from minitransformer.kernels.blas import multiply


def is_quantized(w) -> bool:
    """Is w held as codes and scales (a quant.QWeight) rather than as a float array?

    The one test for it: a weight that is not an array multiplies itself (`w.matmul(x)`).
    """
    return not isinstance(w, xp.ndarray)


def linear(x, w, bias=None):
    """x (B, T, in) @ w (out, in).T + b -> (B, T, out). A quantized weight multiplies itself.

    BLAS chooses its kernel, and so the order of its sums, by the number of rows (with
    OpenBLAS a row's bits change between 1, 2, 16 and 32 rows): a row of a batch gets the bits
    it gets alone only from the very call a batch of one makes.
    """
    flat = x.reshape(-1, x.shape[-1])                                # (B*T, in)
    y = w.matmul(flat) if is_quantized(w) else multiply(flat, w)     # flat @ w.T: (B*T, out)
    y = y.reshape(*x.shape[:-1], y.shape[-1])                        # (B, T, out)
    return y if bias is None else y + bias
