"""Opening a GGUF file (llama.cpp's format) and reading its metadata, with errors that name the
file and the key. The loader (gguf_loader.py) and the tokenizer (gguf_tokenizer.py) read
through these."""

from __future__ import annotations

import gguf
import numpy as np

from dynaspec.models.load_types import ModelLoadError

_REQUIRED = object()


def open_gguf(path: str) -> gguf.GGUFReader:
    try:
        return _PlainArrayReader(path)
    except Exception as exc:  # the reader raises ValueError/IndexError/... on a bad or cut file
        raise ModelLoadError(
            f"{path}: not a valid GGUF file (corrupt or truncated?): {exc}"
        ) from exc


class _PlainArrayReader(gguf.GGUFReader):
    """GGUFReader over a plain ndarray view of its memory map.

    The reader slices its buffer about a million times for a 50k-token vocabulary, and each slice
    of an np.memmap runs a Python hook; a plain view of the same mapping parses ~3x faster and
    makes the tensor views faster to dequantize too. Nothing is copied.
    """

    # The base declares an np.memmap attribute; this is a plain ndarray view of that mapping.
    @property  # type: ignore[override]
    def data(self) -> np.ndarray:
        return self._plain_data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._plain_data = np.asarray(value)


class GGUFMetadata:
    """Typed access to GGUF key/values, with errors that name the file and the key."""

    def __init__(self, reader, path: str) -> None:
        self._fields = reader.fields
        self.path = path

    def get(self, key: str, default: object = _REQUIRED):
        field = self._fields.get(key)
        if field is None:
            if default is _REQUIRED:
                raise ModelLoadError(f"{self.path}: GGUF metadata lacks {key!r}")
            return default
        try:
            return field.contents()
        except Exception as exc:
            raise ModelLoadError(f"{self.path}: cannot read GGUF metadata {key!r}: {exc}") from exc
