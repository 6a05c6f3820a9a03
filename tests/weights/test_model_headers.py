"""One GGUF and one safetensors header reader: they read what the formats' own writers wrote, and
refuse a damaged file naming it, without reading any tensor."""

from __future__ import annotations

import numpy as np
import pytest

from fractal_opt.core.errors import ModelSourceError
from fractal_opt.weights.model_headers import gguf_header, safetensors_header


@pytest.fixture
def small_gguf(tmp_path):
    """A two-tensor GGUF written by the gguf package's own GGUFWriter."""
    import gguf

    path = tmp_path / "small.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_context_length(128)
    w.add_token_list(["a", "bbbb", "cc"])
    w.add_tensor("blk.0.attn_q.weight", np.zeros((4, 32), dtype=np.float32))
    w.add_tensor("token_embd.weight", np.zeros((3, 32), dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_gguf_header_reads_as_gguf_wrote_it(small_gguf):
    """Metadata, the vocabulary's length and longest token, and each tensor's name, shape, type and bytes."""
    header = gguf_header(small_gguf)
    assert header.metadata["llama.block_count"] == 2 and header.metadata["llama.context_length"] == 128
    assert header.array_lengths["tokenizer.ggml.tokens"] == 3 and header.metadata["tokenizer.longest_token_bytes"] == 4
    got = [(t.name, t.shape, t.type_name, t.n_bytes) for t in header.tensors]
    assert got == [("blk.0.attn_q.weight", (32, 4), "F32", 4 * 32 * 4), ("token_embd.weight", (32, 3), "F16", 3 * 32 * 2)]


@pytest.mark.integration  # gguf.GGUFReader takes ~2.5 s over the 135M file on 2 cores
def test_the_reader_agrees_with_gguf_on_the_embedded_model():
    """Every tensor of the shipped SmolLM2 GGUF has the name, shape, type and byte count gguf.GGUFReader gives it."""
    from gguf import GGUFReader

    from fractal_opt.weights.models import resolve

    path = str(resolve("smollm2-135m-instruct").path)
    theirs = {t.name: (tuple(int(d) for d in t.shape), t.tensor_type.name, int(t.n_bytes)) for t in GGUFReader(path).tensors}
    assert {t.name: (t.shape, t.type_name, t.n_bytes) for t in gguf_header(path).tensors} == theirs


def test_a_gguf_cut_inside_its_tensor_records_is_refused_naming_the_file(small_gguf, tmp_path):
    """A file that ends inside its header (here, in the tensor records) says it is truncated and names itself."""
    data = small_gguf.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: data.index(b"token_embd.weight") + 5])
    with pytest.raises(ModelSourceError, match=r"cut\.gguf.*truncated"):
        gguf_header(cut)


def test_a_safetensors_header_reads_as_safetensors_wrote_it(tmp_path):
    """The header of a file saved by the safetensors library lists each tensor's dtype and shape."""
    from safetensors.numpy import save_file

    path = tmp_path / "model.safetensors"
    save_file({"q_proj.weight": np.zeros((8, 4), dtype=np.float32), "norm.weight": np.zeros(4, dtype=np.float16)}, str(path))
    header = safetensors_header(path)
    assert header["q_proj.weight"]["shape"] == [8, 4] and header["norm.weight"]["dtype"] == "F16"


def test_a_damaged_safetensors_header_is_refused_naming_the_file(tmp_path):
    """A header length past the file's end is refused with the file's name and the advice to re-download."""
    path = tmp_path / "broken.safetensors"
    path.write_bytes((10_000).to_bytes(8, "little") + b"{}")
    with pytest.raises(ModelSourceError, match=r"broken\.safetensors.*re-download"):
        safetensors_header(path)
