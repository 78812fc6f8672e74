"""What a request's output must match (vLLM's `structured_outputs`): a JSON schema, any JSON
object, a regex, one of several strings, or an EBNF grammar. Pure Python: the grammar engine
that enforces it lives in `engine/structured_output.py`.
"""

from __future__ import annotations

import json
import re
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

# What one constraint may ask of the grammar compiler, which runs for as long as its input makes
# it (figures in docs/limits-and-safety.md). A bounded repetition compiles to one grammar state
# per step: `[a-z]{1,10000}` took 6 s alone and 88 s on a loaded host; 2,000 steps take 0.17 s.
MAX_CONSTRAINT_BYTES = 128 * 1024  # the schema, regex or grammar as UTF-8 (compact JSON for schemas)
MAX_SCHEMA_DEPTH = 64  # JSON nesting of the schema document
MAX_ENUM_VALUES = 1024  # enum and const values in one schema, or choices; 30,000 took 2.4 s and 95 MB
MAX_REPETITION = 2000  # bounded repetitions ({n,m}) of a constraint's patterns, nested ones multiplied

_QUANTIFIER = re.compile(r"\{(\d+)(?:(,)(\d*))?\}")


def repetition_size(pattern: str) -> int:
    """How many atoms `pattern` spells once its bounded repetitions are written out (a{2,5} is 5 a's,
    (ab){3} is 6): the size of the automaton the compiler builds. Alternatives add up, unbounded
    repetitions (*, +, {n,}) count their minimum only, as the compiler loops over them."""
    i, n = 0, len(pattern)

    def sequence() -> int:
        nonlocal i
        total = last = 0
        while i < n and pattern[i] != ")":
            c = pattern[i]
            if c == "\\":
                i, last = i + 2, 1
            elif c == "[":
                i = _class_end(pattern, i)
                last = 1
            elif c == "(":
                i += 1
                last = sequence()
                i += 1  # the ")"
            elif c == "{" and (m := _QUANTIFIER.match(pattern, i)):
                times = int(m.group(3)) if m.group(3) else int(m.group(1))
                total += last * (times - 1)
                i, last = m.end(), last * times
                continue
            else:
                i, last = i + 1, 0 if c in "|*+?^$" else 1
            total += last
        return total

    size = 0
    while i < n:  # a stray ")" ends a sequence early: count on after it
        size += sequence()
        i += 1
    return size


def _class_end(pattern: str, start: int) -> int:
    i = start + 1
    if i < len(pattern) and pattern[i] == "^":
        i += 1
    if i < len(pattern) and pattern[i] == "]":  # a "]" first in a class is a literal
        i += 1
    while i < len(pattern) and pattern[i] != "]":
        i += 2 if pattern[i] == "\\" else 1
    return i + 1


def _schema_measures(schema: Any) -> tuple[int, int, int]:
    """(JSON nesting depth, enum/const values, repetition size of its patterns), iteratively: a
    deep schema must not exhaust the stack before its depth is refused."""
    depth = enums = repetition = 0
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        node, level = stack.pop()
        depth = max(depth, level)
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "enum" and isinstance(value, list):
                    enums += len(value)
                elif key == "const":
                    enums += 1
                elif key == "pattern" and isinstance(value, str):
                    repetition += repetition_size(value)
                elif key == "patternProperties" and isinstance(value, dict):
                    repetition += sum(repetition_size(k) for k in value)
                if isinstance(value, (dict, list)):
                    stack.append((value, level + 1))
        elif isinstance(node, list):
            stack.extend((item, level + 1) for item in node if isinstance(item, (dict, list)))
    return depth, enums, repetition


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
                f"{self.source}: unknown constraint {self.kind!r}; expected one of {', '.join(KINDS)}",
                param=self.source,
            )
        if self.kind == "json_object":
            if self.value is not None:
                raise InvalidArgument(f"{self.source}: json_object takes no value", param=self.source)
        elif self.kind == "choice":
            if (
                not isinstance(self.value, tuple)
                or not self.value
                or not all(isinstance(c, str) and c for c in self.value)
            ):
                raise InvalidArgument(
                    f"{self.source}: choice must be a non-empty list of non-empty strings", param=self.source
                )
        elif not isinstance(self.value, str) or not self.value:
            raise InvalidArgument(f"{self.source}: {self.kind} must be a non-empty string", param=self.source)
        self._check_size()

    def _check_size(self) -> None:
        """Refuses a constraint that would hold the grammar compiler for long, naming the measure."""
        value = self.value  # validated: None for json_object, a tuple for choice, else a string
        if value is None:
            return
        values = value if isinstance(value, tuple) else (value,)
        num_bytes = sum(len(v.encode()) for v in values)
        if num_bytes > MAX_CONSTRAINT_BYTES:
            raise InvalidArgument(
                f"{self.source}: the {self.kind} constraint has {num_bytes:,} bytes; at most {MAX_CONSTRAINT_BYTES:,} "
                "are allowed", param=self.source,
            )  # fmt: skip
        if isinstance(value, tuple):
            self._refuse_past(len(value), MAX_ENUM_VALUES, "choices")
            return
        if self.kind == "json":
            depth, enums, repetition = _schema_measures(json.loads(value))
            self._refuse_past(depth, MAX_SCHEMA_DEPTH, "levels of nesting")
            self._refuse_past(enums, MAX_ENUM_VALUES, "enum and const values")
        else:
            repetition = repetition_size(value)
        if repetition > MAX_REPETITION:
            raise InvalidArgument(
                f"{self.source}: the {self.kind} constraint's bounded repetitions ({{n,m}}) spell out {repetition:,} "
                f"characters; at most {MAX_REPETITION:,} are allowed (write a smaller bound, or use * or + and "
                "max_tokens)", param=self.source,
            )  # fmt: skip

    def _refuse_past(self, count: int, limit: int, what: str) -> None:
        if count > limit:
            raise InvalidArgument(
                f"{self.source}: the {self.kind} constraint has {count:,} {what}; at most {limit:,} are allowed",
                param=self.source,
            )

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
            raise InvalidArgument(
                f"{source}: a JSON schema must be an object, got {type(schema).__name__}", param=source
            )
        return cls("json", json.dumps(schema, separators=(",", ":")), source)
