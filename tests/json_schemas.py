"""JSON schemas for the guided-decoding suite (tests/test_guided.py, benchmarks/guided.py): nested
objects, arrays with min/max items, enums and consts, numbers with bounds, string lengths, formats
and patterns, required and optional fields, $defs/$ref, anyOf/oneOf, nullable fields."""

_str = {"type": "string"}
_int = {"type": "integer"}
_bool = {"type": "boolean"}


def _obj(props: dict, required=None, **extra) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False, **extra}


SCHEMAS: dict[str, dict] = {
    # scalars and flat objects
    "string": _obj({"value": _str}),
    "integer": _obj({"value": _int}),
    "number": _obj({"value": {"type": "number"}}),
    "boolean": _obj({"value": _bool}),
    "null": _obj({"value": {"type": "null"}}),
    "flat_mixed": _obj({"name": _str, "age": _int, "score": {"type": "number"}, "active": _bool}),
    "optional_fields": _obj({"id": _int, "nickname": _str, "email": _str}, required=["id"]),
    "all_optional": _obj({"a": _int, "b": _str}, required=[]),
    "many_fields": _obj({f"field_{i}": (_int if i % 3 == 0 else _str if i % 3 == 1 else _bool) for i in range(12)}),
    # bounds
    "int_bounds": _obj({"percent": {"type": "integer", "minimum": 0, "maximum": 100}}),
    "int_exclusive": _obj({"x": {"type": "integer", "exclusiveMinimum": -5, "exclusiveMaximum": 5}}),
    "negative_range": _obj({"t": {"type": "integer", "minimum": -273, "maximum": -1}}),
    "number_bounds": _obj({"ratio": {"type": "number", "minimum": 0, "maximum": 1}}),
    "string_length": _obj({"code": {"type": "string", "minLength": 3, "maxLength": 8}}),
    "short_strings": _obj({"a": {"type": "string", "maxLength": 2}, "b": {"type": "string", "maxLength": 1}}),
    # enums and consts
    "enum_string": _obj({"color": {"enum": ["red", "green", "blue"]}}),
    "enum_mixed": _obj({"level": {"enum": [1, 2, 3, "max", None]}}),
    "const": _obj({"version": {"const": "1.0"}, "kind": {"const": 7}}),
    "enum_array": _obj({"days": {"type": "array", "items": {"enum": ["mon", "tue", "wed"]}, "maxItems": 3}}),
    # patterns and formats
    "pattern_zip": _obj({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}),
    "pattern_id": _obj({"id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3,4}$"}}),
    "pattern_hex": _obj({"color": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}}),
    "format_date": _obj({"day": {"type": "string", "format": "date"}}),
    "format_datetime": _obj({"at": {"type": "string", "format": "date-time"}}),
    "format_email": _obj({"email": {"type": "string", "format": "email"}}),
    "format_uuid": _obj({"id": {"type": "string", "format": "uuid"}}),
    "format_ipv4": _obj({"ip": {"type": "string", "format": "ipv4"}}),
    "format_ipv6": _obj({"ip": {"type": "string", "format": "ipv6"}}),
    # arrays
    "array_ints": _obj({"values": {"type": "array", "items": _int}}),
    "array_min_max": _obj({"tags": {"type": "array", "items": _str, "minItems": 1, "maxItems": 3}}),
    "array_exact": _obj({"point": {"type": "array", "items": {"type": "number"}, "minItems": 3, "maxItems": 3}}),
    "array_of_objects": _obj({"items": {"type": "array", "items": _obj({"id": _int, "label": _str}), "maxItems": 3}}),
    "array_min_only": _obj({"xs": {"type": "array", "items": _bool, "minItems": 2}}),
    "tuple": _obj({"pair": {"type": "array", "prefixItems": [_str, _int], "items": False}}),
    "nested_arrays": _obj({"grid": {"type": "array", "items": {"type": "array", "items": _int, "maxItems": 2},
                                    "maxItems": 2}}),
    "top_level_array": {"type": "array", "items": _int, "minItems": 1, "maxItems": 4},
    # nesting
    "nested_object": _obj({"user": _obj({"name": _str, "address": _obj({"city": _str, "zip": _str})})}),
    "deep_nesting": _obj({"a": _obj({"b": _obj({"c": _obj({"d": _int})})})}),
    "object_with_array_of_enums": _obj({"order": _obj({"id": _int, "status": {"enum": ["open", "closed"]},
                                                       "lines": {"type": "array", "items": _obj({"sku": _str,
                                                                                                 "qty": _int}),
                                                                 "minItems": 1, "maxItems": 2}})}),
    "free_dict": {"type": "object", "additionalProperties": _int, "maxProperties": 3},
    # composition and references
    "any_of": _obj({"value": {"anyOf": [_int, _str]}}),
    "any_of_objects": _obj({"shape": {"anyOf": [_obj({"kind": {"const": "circle"}, "r": {"type": "number"}}),
                                                _obj({"kind": {"const": "square"}, "side": {"type": "number"}})]}}),
    "one_of": _obj({"id": {"oneOf": [{"type": "integer"}, {"type": "string", "pattern": "^[a-z]+$"}]}}),
    "nullable": _obj({"middle_name": {"type": ["string", "null"]}}),
    "nullable_any_of": _obj({"count": {"anyOf": [_int, {"type": "null"}]}}),
    "defs_ref": {"$defs": {"person": _obj({"name": _str, "age": _int})},
                 **_obj({"author": {"$ref": "#/$defs/person"}, "editor": {"$ref": "#/$defs/person"}})},
    "defs_nested_ref": {"$defs": {"point": _obj({"x": {"type": "number"}, "y": {"type": "number"}}),
                                  "segment": _obj({"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}})},
                        **_obj({"segments": {"type": "array", "items": {"$ref": "#/$defs/segment"}, "maxItems": 2}})},
    "recursive_ref": {"$defs": {"node": _obj({"value": _int, "children": {"type": "array", "items": {
        "$ref": "#/$defs/node"}, "maxItems": 2}}, required=["value"])}, "$ref": "#/$defs/node"},
    "all_of": {"allOf": [_obj({"a": _int})], "type": "object"},
    # realistic shapes
    "tool_call": _obj({"name": {"enum": ["get_weather", "search"]},
                       "arguments": _obj({"city": _str, "unit": {"enum": ["celsius", "fahrenheit"]}},
                                         required=["city"])}),
    "product": _obj({"sku": {"type": "string", "pattern": "^[A-Z0-9]{4,8}$"}, "price": {"type": "number", "minimum": 0},
                     "in_stock": _bool, "tags": {"type": "array", "items": _str, "maxItems": 3}},
                    required=["sku", "price"]),
    "event": _obj({"title": {"type": "string", "maxLength": 40}, "date": {"type": "string", "format": "date"},
                   "attendees": {"type": "array", "items": {"type": "string", "format": "email"}, "maxItems": 2}}),
    "classification": _obj({"label": {"enum": ["positive", "negative", "neutral"]},
                            "confidence": {"type": "number", "minimum": 0, "maximum": 1}}),
}
