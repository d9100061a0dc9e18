"""Bytes one rank sends for one 3-D tensor-parallel linear (lit_mesh/parallel/tensor_3d.py), forward + backward,
in the ring model of the monitor's counter (lit_mesh/monitor/comm.py: all-gather (n-1)/n of its output,
reduce-scatter (n-1)/n of its input)."""

from __future__ import annotations


def bytes_3d(tokens: int, in_features: int, out_features: int, tp: int, element_size: int = 4) -> float:
    """tp = q^3. Each of the three blocks a rank works on, x (tokens/q, in/q), w (in/q, out/q) and the product
    (tokens/q, out/q), goes over a q-rank group twice: x gathered forward and its gradient reduce-scattered back,
    w likewise, the product reduce-scattered forward and its gradient gathered back. So
    2 (q-1)/q^3 (tokens in + in out + tokens out) elements."""
    q = round(tp ** (1 / 3))
    if q**3 != tp:
        raise ValueError(f"bytes_3d: tp={tp} is not a cube q^3")
    blocks = tokens * in_features + in_features * out_features + tokens * out_features
    return 2 * (q - 1) / q**3 * blocks * element_size
