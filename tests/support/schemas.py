"""JSON Schemas that constrained output is tested with: the masks themselves
(tests/generation/test_grammar.py) and response_format through the server
(tests/server/test_response_format.py) use the same ones."""

PERSON = {"type": "object", "additionalProperties": False,
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "color": {"enum": ["red", "green", "blue"]},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2}},
          "required": ["name", "age", "color", "tags"]}
NESTED = {"type": "object", "additionalProperties": False, "required": ["id", "owner"],
          "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99},
                         "owner": {"type": "object", "additionalProperties": False, "required": ["name", "ok"],
                                   "properties": {"name": {"type": "string", "maxLength": 6},
                                                  "ok": {"type": "boolean"}}}}}
LIST = {"type": "object", "additionalProperties": False, "required": ["items"],
        "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 3,
                                 "items": {"enum": [1, 2, "three", None]}}}}
