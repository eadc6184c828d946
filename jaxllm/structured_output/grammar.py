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
_SUBSCHEMAS = ("additionalProperties", "items", "prefixItems", "allOf", "anyOf", "oneOf", "not",
               "if", "then", "else", "contains", "propertyNames")


def _close_objects(schema) -> None:
    """disable_additional_properties: objects with listed properties get
    additionalProperties: false unless they say otherwise (in place)."""
    if isinstance(schema, list):
        for s in schema:
            _close_objects(s)
        return
    if not isinstance(schema, dict):
        return
    for key in _PROPERTY_MAPS:
        if isinstance(schema.get(key), dict):
            for sub in schema[key].values():
                _close_objects(sub)
    for key in _SUBSCHEMAS:
        if isinstance(schema.get(key), (dict, list)):
            _close_objects(schema[key])
    if "additionalProperties" not in schema and isinstance(schema.get("properties"), dict):
        schema["additionalProperties"] = False


def serialize(p: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON form) of a constraint."""
    import llguidance

    kind = p.kind
    if kind in ("json", "json_object"):
        schema = p.json if kind == "json" else {"type": "object"}
        if p.disable_additional_properties and isinstance(schema, dict):
            schema = copy.deepcopy(schema)
            _close_objects(schema)
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


def validate(p: StructuredOutputsParams) -> str:
    """The grammar of a constraint, or a ValueError naming the field and what is wrong."""
    import llguidance

    try:
        grammar = serialize(p)
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
