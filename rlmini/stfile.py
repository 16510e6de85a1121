"""A safetensors file read without loading it: its header, checked against the file's size (a file cut short
is named in one line). rlmini/models.py reads weights by it; rlmini/smollm2.py checks its cache with it."""
import json
import math
import os

import torch

# the dtype codes a safetensors header names, as safetensors/torch.py::_TYPES maps them
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
                      "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
                      "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
                      "F8_E5M2": torch.float8_e5m2, "U16": torch.uint16, "U32": torch.uint32,
                      "U64": torch.uint64}


def safetensors_header(file: str) -> dict | str:
    """{key: (dtype, shape, byte offset in the file)} of a safetensors file (a dtype torch has no name for
    here: its code), or a one-line error: its header is an 8-byte little-endian length, then that many bytes
    of JSON, {key: {dtype, shape, data_offsets: [begin, end]}}, the offsets from the header's end (the format:
    huggingface/safetensors, README.md)."""
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if 8 + n > size:
            return f"{file}: not a safetensors file (its header's length {n} is past its end)"
        try:
            header = json.loads(f.read(n))
        except ValueError:
            return f"{file}: not a safetensors file (its header is not JSON)"
    out = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        (begin, end), dtype = entry["data_offsets"], SAFETENSORS_DTYPES.get(entry["dtype"], entry["dtype"])
        nbytes = math.prod(entry["shape"]) * dtype.itemsize if isinstance(dtype, torch.dtype) else end - begin
        if 8 + n + end > size:
            return f"{file}: ends inside {key} (its last byte {8 + n + end}, the file's {size}): cut short?"
        if end - begin != nbytes:
            return f"{file}: {key}'s {end - begin} bytes do not hold {entry['dtype']} {entry['shape']}"
        out[key] = (dtype, list(entry["shape"]), 8 + n + begin)
    return out
