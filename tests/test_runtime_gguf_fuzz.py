"""Fuzzing the GGUF header reader (runtime/gguf_loader.read_header): any truncation or byte damage of a valid file
either reads, or is refused with one GGUFError line naming the file; no other exception escapes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from envex.runtime.gguf_loader import GGUFError, read_header


def _small_gguf(path: Path) -> bytes:
    """A valid GGUF of every metadata kind the reader walks (scalars, a string, arrays of numbers, strings and
    arrays) and two tensors, written by the `gguf` package's own writer."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("llama.block_count", 2)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_string("general.name", "fuzz")
    writer.add_array("tokenizer.ggml.tokens", ["a", "b", "<s>"])
    writer.add_array("tokenizer.ggml.scores", [0.0, -1.0, -2.0])
    writer.add_array("nested", [[1, 2], [3]])
    writer.add_tensor("token_embd.weight", np.arange(32, dtype=np.float32).reshape(4, 8))
    writer.add_tensor("output_norm.weight", np.ones(8, dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


@pytest.fixture(scope="module")
def valid(tmp_path_factory) -> bytes:
    return _small_gguf(tmp_path_factory.mktemp("gguf") / "small.gguf")


def test_the_small_file_reads(valid: bytes, tmp_path: Path) -> None:
    path = tmp_path / "ok.gguf"
    path.write_bytes(valid)
    header = read_header(path)
    assert header.metadata["tokenizer.ggml.tokens"] == ["a", "b", "<s>"]
    assert header.metadata["nested"] == [1, 2, 3]  # an array of arrays, flattened as GGUFReader does
    assert [t.name for t in header.tensors] == ["token_embd.weight", "output_norm.weight"]
    assert np.array_equal(header.array(header.tensors[0]), np.arange(32, dtype=np.float32).reshape(4, 8))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(0, 1 << 12), flips=st.lists(st.tuples(st.integers(0, 1 << 12), st.integers(0, 255)),
                                                    max_size=6))  # fmt: skip
def test_damaged_files_read_or_are_refused_in_one_line(valid: bytes, tmp_path: Path, cut: int, flips) -> None:
    data = bytearray(valid[: max(0, len(valid) - cut)])
    for pos, byte in flips:
        if data:
            data[pos % len(data)] = byte
    path = tmp_path / "damaged.gguf"
    path.write_bytes(bytes(data))
    try:
        read_header(path)
    except GGUFError as exc:
        message = str(exc)
        assert message.startswith(f"{path}: not a readable GGUF file (") and "\n" not in message


def test_arrays_nested_past_the_recursion_limit_are_refused(valid: bytes, tmp_path: Path) -> None:
    """An array of arrays of arrays ... (12 bytes a level) in a small file must be one GGUFError, not a
    RecursionError."""
    import struct

    head = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 4) + b"deep" + struct.pack("<I", 9)
    path = tmp_path / "deep.gguf"
    path.write_bytes(head + struct.pack("<IQ", 9, 1) * 5000 + struct.pack("<IQ", 4, 0))
    with pytest.raises(GGUFError, match="not a readable GGUF file"):
        read_header(path)
