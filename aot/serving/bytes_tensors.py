"""BYTES tensors read and written with one C-level join or one lean loop, in place of the python backend's
per-element `struct` formats.

The python backend of Triton 2.51 (the nvidia-pytriton 0.7.0 wheel) turns a BYTES input into a numpy object array,
and a BYTES output back into bytes, by calling `triton_python_backend_utils.deserialize_bytes_tensor` and
`serialize_byte_tensor`, looked up in that module at every call (python_backend r24.10, src/pb_tensor.cc): their
`struct` calls (a format string parsed per element) cost about a microsecond each, for every TEXT, TASK, LABEL, ANSWER and TASK_VERSION of
every text (python_backend moved them into C++ in 2025 for the same reason); these cost well under half of that
(docs/benchmarks.md). A served step installs them in that
module (use_array_bytes_tensors): the same format (each element's length as 4 little-endian bytes, then its
bytes), the same results (tests/test_serving_package.py compares them with the backend's own).
"""

from __future__ import annotations

import struct

import numpy as np

_LENGTH = struct.Struct("<I")


def serialize_byte_tensor(input_tensor: np.ndarray):
    """A BYTES tensor (object or bytes_ array) as the backend's serialize_byte_tensor writes it, in C order: bytes
    (() for an empty tensor, None for another dtype)."""
    if input_tensor.size == 0:
        return ()
    if input_tensor.dtype == np.object_:
        items = [v if type(v) is bytes else str(v).encode("utf-8") for v in input_tensor.reshape(-1).tolist()]
    elif input_tensor.dtype.type == np.bytes_:
        items = input_tensor.reshape(-1).tolist()
    else:
        return None
    parts = [b""] * (2 * len(items))
    parts[0::2] = map(_LENGTH.pack, map(len, items))
    parts[1::2] = items
    return b"".join(parts)


def deserialize_bytes_tensor(encoded_tensor) -> np.ndarray:
    """The elements of a serialized BYTES tensor, a 1-D object array of bytes (the backend's
    deserialize_bytes_tensor)."""
    data, unpack = bytes(encoded_tensor), _LENGTH.unpack_from
    out, offset, end = [], 0, len(data)
    while offset < end:
        (length,) = unpack(data, offset)
        offset += 4
        out.append(data[offset:offset + length])
        offset += length
    array = np.empty(len(out), dtype=np.object_)
    array[:] = out
    return array


def use_array_bytes_tensors(pb_utils) -> None:
    """Have this stub's python backend read and write BYTES tensors with the functions above."""
    pb_utils.serialize_byte_tensor = serialize_byte_tensor
    pb_utils.deserialize_bytes_tensor = deserialize_bytes_tensor
