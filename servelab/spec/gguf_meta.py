"""Reading GGUF headers: the metadata key/values and the tensor names, without loading weights."""

from __future__ import annotations

import os
from typing import Any

from servelab.errors import InvalidArgument, NotFound


def _reader(path: str | os.PathLike[str]):
    from gguf import GGUFReader  # lazy: pulls in numpy, and only GGUF users need it

    if not os.path.isfile(path):
        raise NotFound(f"GGUF file {str(path)!r} does not exist", param="path")
    try:
        return GGUFReader(path, "r")
    except Exception as exc:  # the library raises bare ValueErrors on bad magic / truncation
        raise InvalidArgument(f"{str(path)!r} is not a readable GGUF file: {exc}", param="path") from None


def _field_value(field: Any) -> Any:
    """A field as a plain Python value: int/float/bool/str, or a list of them for arrays."""
    from gguf import GGUFValueType

    if hasattr(field, "contents"):
        return field.contents()
    # Older gguf releases have no contents(): decode from the raw parts.
    main = field.types[0] if field.types else None
    if main == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    if main == GGUFValueType.ARRAY:
        sub = field.types[-1]
        items = [field.parts[i] for i in field.data]
        if sub == GGUFValueType.STRING:
            return [bytes(p).decode("utf-8") for p in items]
        return [p.tolist()[0] for p in items]
    value = field.parts[field.data[0]].tolist()[0]
    return bool(value) if main == GGUFValueType.BOOL else value


def gguf_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Every metadata field of a GGUF file as plain Python values (arrays become lists)."""
    reader = _reader(path)
    return {name: _field_value(field) for name, field in reader.fields.items()}


def gguf_header(path: str | os.PathLike[str]) -> tuple[dict[str, Any], list[str]]:
    """Metadata and tensor names in one read (tensor names tell tied embeddings apart)."""
    reader = _reader(path)
    metadata = {name: _field_value(field) for name, field in reader.fields.items()}
    return metadata, [t.name for t in reader.tensors]
