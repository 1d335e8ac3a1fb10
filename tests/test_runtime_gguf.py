"""The GGUF header reader (runtime/gguf_loader.py) against the `gguf` package's own GGUFReader on the embedded model,
and its refusals of truncated and garbled files."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from envex.runtime.gguf_loader import GGUFError, read_header, read_metadata
from envex.runtime.loader import embedded_model_path


def test_the_header_reads_as_gguf_reader_does() -> None:
    import gguf

    path = embedded_model_path()
    reader = gguf.GGUFReader(str(path))
    header = read_header(path)
    expected = {key: field.contents() for key, field in reader.fields.items()}
    metadata = read_metadata(path)
    assert metadata.pop("tensor_names") == [t.name for t in reader.tensors]
    assert metadata == expected
    assert {k: type(v) for k, v in metadata.items()} == {k: type(v) for k, v in expected.items()}
    assert len(expected["tokenizer.ggml.tokens"]) == 49152 and len(expected["tokenizer.ggml.merges"]) > 40000
    assert len(header.tensors) == len(reader.tensors) == 272
    assert {int(t.tensor_type) for t in reader.tensors} == {0, 3, 8}  # F32, Q4_1, Q8_0: values and blocks
    for ours, theirs in zip(header.tensors, reader.tensors, strict=True):
        assert (ours.name, ours.dims, ours.ggml_type) == (theirs.name, tuple(int(d) for d in theirs.shape),
                                                          int(theirs.tensor_type))  # fmt: skip
        assert (ours.start, ours.nbytes) == (theirs.data_offset, theirs.n_bytes)
        data = header.array(ours)
        assert data.dtype == theirs.data.dtype and data.shape == theirs.data.shape
        assert np.array_equal(data, theirs.data), ours.name


def _refused(path: Path, data: bytes, match: str) -> None:
    path.write_bytes(data)
    with pytest.raises(GGUFError, match=match) as info:
        read_header(path)
    assert str(info.value).startswith(f"{path}: not a readable GGUF file (")


def test_truncated_and_garbled_files_are_refused(tmp_path: Path) -> None:
    blob = embedded_model_path().read_bytes()
    bad = tmp_path / "bad.gguf"
    _refused(bad, b"", "empty file")
    _refused(bad, b"GGML" + blob[4:4096], "GGUF magic")
    _refused(bad, blob[:4] + struct.pack("<I", 1) + blob[8:4096], "GGUF version 1")
    _refused(bad, blob[:4] + struct.pack(">I", 3) + blob[8:4096], "little-endian")
    _refused(bad, blob[:100_000], "requires a buffer|past the end")  # cut inside the vocabulary
    _refused(bad, blob[: len(blob) - 4096], r"the tensor blk\.9\.attn_v\.weight runs past the end of the file")
    (tmp_path / "missing.gguf").unlink(missing_ok=True)
    with pytest.raises(GGUFError, match="No such file"):
        read_header(tmp_path / "missing.gguf")


def test_the_tokenizer_given_the_model_type_is_transformers_public_one() -> None:
    """tokenizer_parts with the model type (as the loader calls it) skips transformers' legacy GGUF parse, which
    AutoTokenizer makes only to choose the tokenizer class: the same Rust tokenizer, settings and tokens as without
    it, and transformers' function is restored afterwards, also when the load fails."""
    import transformers.modeling_gguf_pytorch_utils as legacy

    from envex.runtime.gguf_loader import tokenizer_parts
    from envex.runtime.loader import load_model_info

    path = embedded_model_path()
    real = legacy.load_gguf_checkpoint
    assert load_model_info(str(path)).hf_config["model_type"] == "llama"
    fast, fast_config = tokenizer_parts(path, "llama")
    public, public_config = tokenizer_parts(path)
    assert legacy.load_gguf_checkpoint is real
    assert fast.to_str() == public.to_str() and fast_config == public_config
    text = "What is the capital of France? é 中文 <|im_end|>"
    assert fast.encode(text).ids == public.encode(text).ids
    with pytest.raises(OSError):
        tokenizer_parts(path.parent / "missing.gguf", "llama")
    assert legacy.load_gguf_checkpoint is real
