"""Re-quantise a GGUF file to Q4_0 or Q8_0 with gguf-py (gguf.quants), from its dequantised weights,
so that llama.cpp and this engine can be compared on the same model in other block types. The
metadata (tokenizer, chat template, hyper-parameters) is copied; 2-D weights are dequantised and
re-quantised to the type (the token embedding / tied head to Q8_0, as in the embedded Q4_1 file);
float tensors (norms) are copied as they are.

    python benchmarks/gguf_requant.py SRC.gguf DST.gguf q4_0|q8_0
"""

from __future__ import annotations

import os
import sys

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFValueType, GGUFWriter, Keys, LlamaFileType
from gguf.quants import dequantize, quantize

TYPES = {"q4_0": (T.Q4_0, LlamaFileType.MOSTLY_Q4_0), "q8_0": (T.Q8_0, LlamaFileType.MOSTLY_Q8_0)}
FLOAT_TYPES = (T.F32, T.F16, T.BF16)


def _copy_metadata(reader: GGUFReader, writer: GGUFWriter, file_type: int) -> None:
    for field in reader.fields.values():
        if field.name == Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        if field.name == Keys.General.FILE_TYPE:
            writer.add_file_type(int(file_type))
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)


def requantize(src: str, dst: str, kind: str) -> str:
    """Write `dst` (kind q4_0 | q8_0) from `src`; returns dst. Written to a temporary name first."""
    qtype, file_type = TYPES[kind]
    reader = GGUFReader(src)
    arch = reader.fields[Keys.General.ARCHITECTURE].contents()
    tmp = dst + ".part"
    writer = GGUFWriter(tmp, arch)
    _copy_metadata(reader, writer, file_type)
    for t in reader.tensors:
        if t.tensor_type in FLOAT_TYPES or len(t.shape) < 2:
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
            continue
        w = dequantize(t.data, t.tensor_type).astype(np.float32)  # [rows, K]
        target = T.Q8_0 if t.name == "token_embd.weight" else qtype
        writer.add_tensor(t.name, quantize(w, target), raw_dtype=target)  # uint8 blocks: shape from bytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, dst)
    return dst


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[3] not in TYPES:
        sys.exit(__doc__)
    print(requantize(sys.argv[1], sys.argv[2], sys.argv[3]))
