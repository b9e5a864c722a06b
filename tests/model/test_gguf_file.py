"""loader/gguf_file.py against gguf-py's GGUFReader: the same metadata and the same tensor views."""

import os
import sys

import gguf
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from tiny_gguf import write_tiny_gguf  # noqa: E402
from tiny_models import make_tiny_hf_model  # noqa: E402

from servescope.loader.gguf_file import GGUFFile, read_gguf  # noqa: E402
from servescope.loader.source import load_model_source, resolve_model_path  # noqa: E402


def assert_same_as_gguf_py(path: str) -> None:
    ours, ref = GGUFFile(path), gguf.GGUFReader(path)
    want = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert ours.fields.keys() == want.keys()
    for k, v in want.items():
        assert ours.fields[k] == v, k
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert (a.tensor_type, a.n_bytes, a.data_offset) == (b.tensor_type, int(b.n_bytes), int(b.data_offset)), a.name
        assert a.shape.tolist() == b.shape.tolist() and a.data.dtype == b.data.dtype, a.name
        assert a.data.shape == b.data.shape and np.array_equal(a.data, b.data), a.name


def test_embedded_model_reads_as_gguf_py_does():
    assert_same_as_gguf_py(resolve_model_path(None))


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_1", "Q5_1"])
def test_synthetic_files_read_as_gguf_py_does(tmp_path, qtype):
    src = load_model_source(str(make_tiny_hf_model(tmp_path / "hf", "qwen2", vocab_size=256, with_tokenizer=False)))
    path = write_tiny_gguf(tmp_path / "m.gguf", src.config, src.state_dict, arch="qwen2",
                           qtype=gguf.GGMLQuantizationType[qtype], chat_template="{{ messages }}", token_count=256)
    assert_same_as_gguf_py(path)


def test_malformed_files_raise_value_error(tmp_path):
    src = load_model_source(str(make_tiny_hf_model(tmp_path / "hf", "llama", vocab_size=256, with_tokenizer=False)))
    path = write_tiny_gguf(tmp_path / "m.gguf", src.config, src.state_dict)
    data = open(path, "rb").read()
    for keep in (len(data) - 100, len(data) // 2, 200, 30, 3, 0):
        bad = tmp_path / f"cut{keep}.gguf"
        bad.write_bytes(data[:keep])
        with pytest.raises(ValueError):
            read_gguf(str(bad))
    bad = tmp_path / "v9.gguf"
    bad.write_bytes(data[:4] + (9).to_bytes(4, "little") + data[8:])
    with pytest.raises(ValueError, match="version 9"):
        read_gguf(str(bad))


def test_big_endian_file_goes_through_gguf_py(tmp_path):
    path = str(tmp_path / "be.gguf")
    w = gguf.GGUFWriter(path, "llama", endianess=gguf.GGUFEndian.BIG)
    w.add_uint32("llama.block_count", 2)
    w.add_array("tokenizer.ggml.tokens", ["a", "b", "c"])
    w.add_tensor("t.weight", np.arange(8, dtype=np.float32).reshape(2, 4))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    got = read_gguf(path)
    assert got.fields["llama.block_count"] == 2 and got.fields["tokenizer.ggml.tokens"] == ["a", "b", "c"]
    assert [t.name for t in got.tensors] == ["t.weight"]
    assert np.array_equal(got.tensors[0].data.astype(np.float32), np.arange(8, dtype=np.float32).reshape(2, 4))
