"""Constraints as llguidance grammars, and one sequence's matcher.

A constraint (StructuredOutputsParams) becomes an llguidance grammar (`serialize`), checked
without the tokenizer when the request comes in (`validate`: a schema using a keyword
llguidance does not implement is refused, naming it), compiled against the tokenizer once
(manager.py) and copied for each sequence (`Grammar`). llguidance is imported on first use,
so that requests without constraints never load it.
"""
from __future__ import annotations

import copy


from jaxllm.sampling_params import StructuredOutputsParams

# JSON's whitespace between tokens, where the constraint leaves it free: at most one line break
# and an indentation per gap. Any pretty-printing fits; a model cannot pad forever (with
# unbounded whitespace small models were seen writing newlines until max_tokens).
JSON_WHITESPACE = r"(\r?\n)?[\x20\x09]{0,48}"

_PROPERTY_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMAS = ("additionalProperties", "items", "prefixItems", "anyOf", "oneOf", "not",
               "if", "then", "else", "contains", "propertyNames")


def _own_names(schema: dict) -> list[str]:
    """The property names an object schema lists, its inline allOf members' included."""
    names = list(schema["properties"]) if isinstance(schema.get("properties"), dict) else []
    for sub in schema.get("allOf") or ():
        if isinstance(sub, dict):
            names += [n for n in _own_names(sub) if n not in names]
    return names


def close_objects(schema, _self: bool = True) -> None:
    """Objects that list their properties (or property patterns) get additionalProperties:
    false unless they say otherwise, in place: a schema then describes every key that may be
    written, as xgrammar (vLLM's default backend) and OpenAI's strict mode read it. An object
    listing no properties at all stays free. allOf members are intersected, so they stay open
    and their parent closes over the names of all of them."""
    if isinstance(schema, list):
        for s in schema:
            close_objects(s)
        return
    if not isinstance(schema, dict):
        return
    for key in _PROPERTY_MAPS:
        if isinstance(schema.get(key), dict):
            for sub in schema[key].values():
                close_objects(sub)
    for key in _SUBSCHEMAS:
        if isinstance(schema.get(key), (dict, list)):
            close_objects(schema[key])
    if isinstance(schema.get("allOf"), list):
        for sub in schema["allOf"]:
            close_objects(sub, _self=False)
    if not _self or "additionalProperties" in schema:
        return
    names = _own_names(schema)
    if names or isinstance(schema.get("patternProperties"), dict):
        own = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        extra = {n: True for n in names if n not in own}  # typed by their allOf member
        if extra:
            schema["properties"] = {**own, **extra}
        schema["additionalProperties"] = False


def serialize(p: StructuredOutputsParams, allow_additional_properties: bool = False) -> str:
    """The llguidance grammar (its JSON form) of a constraint. A JSON schema's objects are
    closed (close_objects) unless `allow_additional_properties` (the engine's
    structured_outputs_allow_additional_properties) and the request does not ask
    disable_additional_properties."""
    import llguidance

    kind = p.kind
    if kind in ("json", "json_object"):
        schema = p.json if kind == "json" else {"type": "object"}
        closed = p.disable_additional_properties or not allow_additional_properties
        if kind == "json" and closed and isinstance(schema, dict):
            schema = copy.deepcopy(schema)
            close_objects(schema)
        options = {"whitespace_flexible": not p.disable_any_whitespace}
        if not p.disable_any_whitespace:
            options["whitespace_pattern"] = p.whitespace_pattern or JSON_WHITESPACE
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
    if kind == "regex":
        # \d, \w and \s in their ASCII sense (as xgrammar, vLLM's default backend, has them):
        # the regex crate's Unicode digits let a model write "🯸" for "8"
        return llguidance.grammar_from("lark", f"start: /{llguidance.regex_to_lark(p.regex, 'dws')}/")
    if kind == "choice":
        return llguidance.grammar_from("choice", p.choice)
    # Lark, or GBNF (llama.cpp's EBNF), which llguidance translates to Lark
    return llguidance.grammar_from("grammar", p.grammar)


def validate(p: StructuredOutputsParams, allow_additional_properties: bool = False) -> str:
    """The grammar of a constraint, or a ValueError naming the field and what is wrong."""
    import llguidance

    try:
        grammar = serialize(p, allow_additional_properties)
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(f"{p.field_name}.{p.kind}: {e}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar, None)
    if error:
        raise ValueError(f"{p.field_name}.{p.kind}: {error}")
    return grammar


class Grammar:
    """One sequence's position in its grammar: it advances on the tokens a step produced.
    The tokens it allows next reach the device as a row of the step's packed bitmask
    (StructuredOutputManager.bitmask)."""

    __slots__ = ("matcher",)

    def __init__(self, matcher):
        self.matcher = matcher

    def accept(self, tokens: list[int]) -> bool:
        """Advance over tokens; False if one is not allowed (the matcher is then in error)."""
        return self.matcher.consume_tokens(list(tokens))

    def validate(self, tokens: list[int]) -> int:
        """How many of `tokens`, in order, the grammar allows from here (nothing advances)."""
        return self.matcher.validate_tokens(list(tokens))

    @property
    def is_terminated(self) -> bool:
        """Complete, and nothing may follow (only EOS is allowed)."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        return self.matcher.get_error()
