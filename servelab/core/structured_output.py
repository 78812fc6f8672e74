"""What a request's output must match (vLLM's `structured_outputs`): a JSON schema, any JSON
object, a regex, one of several strings, or an EBNF grammar. Pure Python: the grammar engine
that enforces it lives in `engine/structured_output.py`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from servelab.errors import InvalidArgument

# kind -> what `value` holds
KINDS = {
    "json": "a JSON schema (compact JSON text)",
    "json_object": "nothing: any JSON object",
    "regex": "a regular expression",
    "choice": "a tuple of strings, one of which is the whole output",
    "grammar": "an EBNF grammar (xgrammar / GBNF syntax, root rule `root`)",
}


@dataclass(frozen=True, slots=True)
class StructuredOutputSpec:
    """One constraint; hashable, so compiled grammars are cached by it."""

    kind: str
    value: str | tuple[str, ...] | None = None
    # The request field it came from, for error messages (e.g. "response_format"); not part of
    # the identity: the same schema sent through two fields compiles once.
    source: str = field(default="structured_outputs", compare=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidArgument(
                f"{self.source}: unknown constraint {self.kind!r}; expected one of {', '.join(KINDS)}", param=self.source
            )
        if self.kind == "json_object":
            if self.value is not None:
                raise InvalidArgument(f"{self.source}: json_object takes no value", param=self.source)
        elif self.kind == "choice":
            if not isinstance(self.value, tuple) or not self.value or not all(isinstance(c, str) and c for c in self.value):
                raise InvalidArgument(f"{self.source}: choice must be a non-empty list of non-empty strings", param=self.source)
        elif not isinstance(self.value, str) or not self.value:
            raise InvalidArgument(f"{self.source}: {self.kind} must be a non-empty string", param=self.source)

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str | bool, source: str) -> StructuredOutputSpec:
        """A schema given as an object (or JSON text), stored as compact JSON text. Key order is
        kept: the grammar generates properties in the order the schema lists them."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise InvalidArgument(f"{source}: the JSON schema is not valid JSON: {e}", param=source) from e
        if not isinstance(schema, dict):
            raise InvalidArgument(f"{source}: a JSON schema must be an object, got {type(schema).__name__}", param=source)
        return cls("json", json.dumps(schema, separators=(",", ":")), source)
