"""What moeplace's files may hold, as schemas checked where each file is read, and their error line.

Each file format has one schema: a trace's (and shard's) header (``trace/header_schema.py``), a placement
file and SGLang's placement file (``files/placement_schema.py``), a cost-model file (``cost/schema.py``);
the model description they share is here. A schema checks every field's type (strict: 8.0, "8" and true
are not 8), its range, and its agreement with the others (ids below num_experts, a map as wide as
num_physical_experts, nodes dividing ranks) before any array is sized from it, and a file that fails is
one line: the file, the field, what was expected and what it holds.

The schemas are pydantic (v2) models. pydantic rather than jsonschema: the checks between fields (a map's
width against ``ranks``, ids against ``num_experts``) are plain methods of the model, where JSON Schema
cannot say them and would need hand-written code beside it anyway; strict types come built in; and
SGLang, which the plugin runs in, already depends on it. Both have one compiled dependency (pydantic-core;
jsonschema's rpds-py, beside attrs, referencing and jsonschema-specifications). The cost is paid only when a
file is read (these modules are imported inside the readers; ``moeplace --help`` imports neither):
``python -X importtime`` and wall clocks on the shared 2-core machine put pydantic's import at 0.1 s (load 2)
to 0.19 s (load 5, where numpy took 0.12 s) and building these schemas at 0.02-0.07 s; checking a Kimi-K2
placement file (60 x 384 ids) takes 2 ms.

Bounds (what the program can hold): expert ids are int16 in memory, so at most MAX_EXPERTS experts (and
slots); ranks are int16 too.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from moeplace.errors import FormatError
from moeplace.model.spec import MAX_EXPERTS, MAX_LAYERS, MAX_RANKS


class Schema(BaseModel):
    """Strict types (no "8" or 8.0 for 8, no 1 for true), unknown keys ignored (newer writers may add some)."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False, frozen=True)


class ModelSchema(Schema):
    """The ``model`` object of a trace header or placement file (``ModelSpec.to_json``)."""

    name: str
    num_hidden_layers: int = Field(ge=1, le=MAX_LAYERS)
    moe_layers: list[int] = Field(min_length=1, max_length=MAX_LAYERS)
    num_experts: int = Field(ge=1, le=MAX_EXPERTS)
    top_k: int = Field(ge=1, le=MAX_EXPERTS)

    @model_validator(mode="after")
    def _agree(self) -> "ModelSchema":
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k {self.top_k} is more than num_experts {self.num_experts}")
        layers = self.moe_layers
        if any(b <= a for a, b in zip(layers, layers[1:])) or layers[0] < 0 or layers[-1] >= self.num_hidden_layers:
            raise ValueError(f"moe_layers must be increasing layer indices below num_hidden_layers "
                             f"{self.num_hidden_layers}")
        return self


def check_map(rows: list[list[int]] | None, layers: int, num_experts: int, name: str = "physical_to_logical_map",
              min_width: int | None = None) -> None:
    """ValueError unless ``rows`` is [layers, P] with P from ``min_width`` (default num_experts) to MAX_EXPERTS
    and every id in [0, num_experts)."""
    if rows is None:
        return
    widths = {len(r) for r in rows}
    if len(rows) != layers or len(widths) != 1:
        raise ValueError(f"{name} must be [{layers} MoE layers, slots], got {len(rows)} rows of "
                         f"{'/'.join(str(w) for w in sorted(widths)[:3]) or 0} slots")
    width = widths.pop()
    if not (min_width if min_width is not None else num_experts) <= width <= MAX_EXPERTS:
        raise ValueError(f"{name} has {width} slots per layer, fewer than the {num_experts} experts or more "
                         f"than {MAX_EXPERTS}")
    low, high = min(min(r) for r in rows), max(max(r) for r in rows)
    if low < 0 or high >= num_experts:
        raise ValueError(f"{name} holds expert id {low if low < 0 else high}, outside 0..{num_experts - 1}")


def validate(schema: type[Schema], data: Any, path: object, what: str) -> Any:
    """``data`` checked against ``schema``; FormatError (one line: file, field, what was expected) if it fails."""
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
        raise FormatError(path, f"{what}: {describe(errors[0])}{more}") from None


def describe(error: dict) -> str:
    """One pydantic error as "FIELD must be EXPECTED, got VALUE" (or the check's own sentence)."""
    where = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" if str(part).isidentifier() else f"[{part!r}]"
                    for part in error["loc"]).lstrip(".")
    kind, ctx = error["type"], error.get("ctx") or {}
    if kind == "value_error":
        sentence = " ".join(str(ctx.get("error", error["msg"])).split())
        return f"{where}: {sentence}" if where else sentence
    if kind == "missing":
        return f"{where} is missing"
    expected = {
        "int_type": "a whole number", "int_parsing": "a whole number", "int_from_float": "a whole number",
        "float_type": "a number", "float_parsing": "a number", "finite_number": "a finite number",
        "string_type": "a string", "bool_type": "true or false", "list_type": "a list", "dict_type": "an object",
        "model_type": "an object", "model_attributes_type": "an object", "none_required": "null",
        "greater_than_equal": f"at least {ctx.get('ge')}", "less_than_equal": f"at most {_number(ctx.get('le'))}",
        "greater_than": f"more than {ctx.get('gt')}", "less_than": f"less than {_number(ctx.get('lt'))}",
        "too_short": f"at least {ctx.get('min_length')} long", "too_long": f"at most {ctx.get('max_length')} long",
        "literal_error": f"{ctx.get('expected')}",
    }.get(kind, error["msg"].removeprefix("Input should be ").lower())
    return f"{where or 'the file'} must be {expected}, got {_shown(error.get('input'))}"


def _number(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _shown(value: Any) -> str:
    """A field's value for a message, cut short: lists and objects by their kind and length."""
    if isinstance(value, (list, tuple)):
        return f"a list of {len(value)}"
    if isinstance(value, dict):
        return f"an object with keys {', '.join(map(repr, list(value)[:4]))}"[:80] if value else "an empty object"
    text = "null" if value is None else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
