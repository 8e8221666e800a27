"""A GGUF file that declares general.alignment is read with it: its data section starts at the
first multiple of that alignment after the header, and every tensor's offset is checked against
it. (The default, 32, holds only when the file does not say.)

Each file here is spelled so that the two readings differ: its header ends where rounding up to
32 and rounding up to the declared alignment give different starts, so a reader that ignored
the key would take every tensor from the wrong bytes."""
import copy

import numpy as np
import pytest

import minitransformer as mt
from minitransformer.backend import to_numpy

pytest.importorskip("gguf")
from gguf_files import STRING, UINT32, gguf_bytes


def header_bytes(entries, tensors) -> int:
    """Where the header ends (the offsets are fixed-width, so it is the same at any alignment)."""
    return len(gguf_bytes(entries, tensors, alignment=1)) - sum(len(t[3]) for t in tensors)


def declaring(parts, alignment):
    """The parts with general.alignment = alignment and a filler string sized so that the header
    ends 8 bytes past a multiple of 32 that is not a multiple of `alignment`."""
    entries, tensors = copy.deepcopy(parts)
    entries.append(["general.alignment", UINT32, alignment, None])
    entries.append(["general.filler", STRING, "", None])
    for n in range(alignment):
        entries[-1][2] = "x" * n
        end = header_bytes(entries, tensors)
        if end % 32 == 8 and -(-end // 32) * 32 != -(-end // alignment) * alignment:
            return entries, tensors
    raise AssertionError("no filler length separates the two readings")


def weights(model):
    return {name: to_numpy(w) for name, w in model.weights.items()}


@pytest.mark.parametrize("alignment", [64, 256])
def test_a_declared_alignment_places_the_data_section(tmp_path, parts, alignment):
    reference = weights(mt.load(write(tmp_path / "default.gguf", gguf_bytes(*parts))))
    path = write(tmp_path / f"aligned{alignment}.gguf",
                 gguf_bytes(*declaring(parts, alignment), alignment=alignment))
    loaded = weights(mt.load(path))
    assert loaded.keys() == reference.keys()
    for name, w in reference.items():
        np.testing.assert_array_equal(loaded[name], w, err_msg=name)


@pytest.mark.parametrize("alignment", [64, 256])
def test_an_offset_off_the_declared_alignment_is_refused(tmp_path, parts, alignment):
    """An offset that is a multiple of 32 but not of the declared alignment: a CheckpointError
    that names it (a reader that checked against 32 would accept it)."""
    entries, tensors = declaring(parts, alignment)
    raw = gguf_bytes(entries, tensors, alignment=alignment, offsets={1: 32})
    with pytest.raises(mt.CheckpointError,
                       match=f"data offset 32 is not a multiple of the alignment {alignment}"):
        mt.load(write(tmp_path / "off.gguf", raw))


def write(path, raw):
    path.write_bytes(raw)
    return path
