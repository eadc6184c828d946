"""Structured outputs: constraints validated up front, grammars compiled once, and every
constrained output parsing and matching its constraint (JSON schemas checked with jsonschema,
regexes with re, choices by membership); free requests in the same batch are unaffected."""
import json
import random
import re

import jsonschema
import numpy as np
import pytest

from jaxllm.sampling_params import SamplingParams, StructuredOutputsParams as SO


# --- parameters and validation (no engine) ---------------------------------------------------

@pytest.mark.parametrize("kwargs,message", [
    (dict(), "exactly one"),
    (dict(json={"type": "object"}, regex="a"), "exactly one"),
    (dict(json="{not json"), "structured_outputs.json is not valid JSON"),
    (dict(json=[1]), "structured_outputs.json must be a JSON schema"),
    (dict(choice=[]), "structured_outputs.choice"),
    (dict(choice=["a", 3]), "structured_outputs.choice"),
    (dict(regex=""), "structured_outputs.regex"),
    (dict(structural_tag='{"structures": []}'), "structural_tag is not supported"),
    (dict(regex="a+", whitespace_pattern=" "), "whitespace_pattern applies to json"),
])
def test_params_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SO(**kwargs)


def test_sampling_params_take_only_the_dataclass_and_no_min_tokens():
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regex": "a"})
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs=SO(regex="a+"))
    assert SO(json='{"type": "integer"}').json == {"type": "integer"}  # a string is parsed


@pytest.mark.parametrize("constraint,named", [
    (SO(json={"type": "array", "uniqueItems": True}), "uniqueItems"),
    (SO(json={"not": {"type": "string"}}), "not"),
    (SO(json={"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}), "missing"),
    (SO(json={"type": "integer", "minimum": 5, "maximum": 1}), "minimum"),
    (SO(json={"type": "string", "pattern": "(a"}), "unclosed group"),
    (SO(regex="(ab"), "unclosed group"),
    (SO(grammar="start: undefined_rule"), "undefined_rule"),
    (SO(json={"type": "object"}, whitespace_pattern="("), "unclosed group"),
])
def test_unsupported_or_broken_constraints_are_named(constraint, named):
    from jaxllm.structured_output.grammar import validate
    with pytest.raises(ValueError) as e:
        validate(constraint)
    assert str(e.value).startswith(f"structured_outputs.{constraint.kind}: ") and named in str(e.value)


def test_bitmask_on_device_matches_numpy():
    import jax
    from llguidance.numpy import apply_token_bitmask_inplace
    from jaxllm.runner.sampler import apply_bitmask

    rng = np.random.default_rng(0)
    V = 1000  # not a multiple of 32: the last word is partly past the vocabulary
    logits = rng.standard_normal((5, V)).astype(np.float32)
    mask = rng.integers(-2**31, 2**31, size=(5, -(-V // 32)), dtype=np.int64).astype(np.int32)
    mask[0] = -1                      # everything allowed
    mask[1] = 0
    mask[1, 3] = 1 << 7               # token 3 * 32 + 7 only
    expected = logits.copy()
    apply_token_bitmask_inplace(expected, mask)
    got = np.asarray(jax.jit(apply_bitmask)(logits, mask))
    np.testing.assert_array_equal(got, expected)
    assert np.isfinite(got[0]).all() and np.flatnonzero(np.isfinite(got[1])).tolist() == [103]


# --- the grammar module with the default model's tokenizer -----------------------------------

@pytest.fixture(scope="module")
def manager(tokenizer_dir):
    from transformers import AutoTokenizer
    from jaxllm.structured_output.manager import StructuredOutputManager
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    return StructuredOutputManager(tok, 49152, tok.eos_token_id)


def allowed(mask_row: np.ndarray) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(mask_row.view(np.uint8), bitorder="little"))


def test_grammar_advances_and_terminates(manager):
    tok = manager.tokenizer
    spec = manager.prepare(SO(json={"type": "object", "properties": {"ok": {"type": "boolean"}},
                                    "required": ["ok"], "additionalProperties": False},
                              disable_any_whitespace=True))
    compiled = manager.compile(spec).result()
    assert manager.compile(spec).result() is compiled  # cached by the constraint
    g = manager.grammar(compiled)
    ids = tok.encode('{"ok":true}', add_special_tokens=False)
    assert g.validate(ids + ids) == len(ids)  # nothing may follow the object
    assert g.accept(ids[:-1]) and not g.is_terminated
    start = manager.bitmask([(0, g)], 2)
    assert allowed(start[1]).size == 49152 and ids[-1] in allowed(start[0])
    assert g.accept(ids[-1:]) and g.is_terminated
    assert allowed(manager.bitmask([(0, g)], 1)[0]).tolist() == [tok.eos_token_id]


def test_json_whitespace_is_bounded_and_objects_may_be_closed(manager):
    tok = manager.tokenizer

    def allows(constraint, text):
        g = manager.grammar(manager.compile(manager.prepare(constraint)).result())
        ids = tok.encode(text, add_special_tokens=False)
        return g.validate(ids) == len(ids)

    schema = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}}},
              "required": ["a"]}
    for text in ('{"a":[1,2]}', json.dumps({"a": [1, 2]}), json.dumps({"a": [1, 2]}, indent=4),
                 '{ "a" :\t[ 1 ,\r\n 2 ] }'):
        assert allows(SO(json=schema), text), text
    assert not allows(SO(json=schema), '{\n\n"a":[1]}')  # one line break per gap
    assert not allows(SO(json=schema), '{' + " " * 49 + '"a":[1]}')
    assert not allows(SO(json=schema, disable_any_whitespace=True), '{"a": [1]}')
    assert allows(SO(json=schema, whitespace_pattern="[ ]{0,3}"), '{   "a":[1]}')
    assert not allows(SO(json=schema), '{"a":[1],"b":2}')  # closed: only what it describes


@pytest.fixture(scope="module")
def permissive(manager):
    """A manager of an engine with structured_outputs_allow_additional_properties."""
    from jaxllm.structured_output.manager import StructuredOutputManager
    return StructuredOutputManager(manager.tokenizer, 49152, manager.eos_token_id,
                                   allow_additional_properties=True)


def matcher_after(manager, constraint, text):
    """A sequence's grammar advanced over `text` (which it must allow)."""
    g = manager.grammar(manager.compile(manager.prepare(constraint)).result())
    ids = manager.tokenizer.encode(text, add_special_tokens=False)
    assert g.accept(ids), (text, g.error)
    return g


def next_allowed(manager, g) -> set[str]:
    """The texts of the tokens the grammar allows next."""
    tok = manager.tokenizer
    return {tok.decode([t]) for t in allowed(manager.bitmask([(0, g)], 1)[0])}


PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name"]}


def key_starts(texts: set[str]) -> set[str]:
    """The beginnings of keys among token texts that open a string."""
    return {t.lstrip()[1:].split('"')[0] for t in texts if t.lstrip().startswith('"')}


def test_objects_carry_only_the_keys_their_schema_names(manager, permissive):
    text, extra, listed = '{"name": "x", ', '"height": 3}', '"age": 3}'
    tok = manager.tokenizer
    # after the first property, the mask lets only a listed key begin
    g = matcher_after(manager, SO(json=PERSON), text)
    starts = key_starts(next_allowed(manager, g))
    assert starts and all("age".startswith(k) for k in starts), starts
    ids = tok.encode(extra, add_special_tokens=False)
    assert g.validate(ids) < len(ids)
    listed_ids = tok.encode(listed, add_special_tokens=False)
    assert g.validate(listed_ids) == len(listed_ids)
    # the permissive engine: any key may follow, as JSON Schema reads it
    g = matcher_after(permissive, SO(json=PERSON), text)
    assert not all("age".startswith(k) for k in key_starts(next_allowed(permissive, g)))
    assert g.validate(ids) == len(ids)
    # ... unless the request closes its objects itself
    g = matcher_after(permissive, SO(json=PERSON, disable_additional_properties=True), text)
    assert g.validate(ids) < len(ids)


def allows_text(manager, constraint, text) -> bool:
    g = manager.grammar(manager.compile(manager.prepare(constraint)).result())
    ids = manager.tokenizer.encode(text, add_special_tokens=False)
    return g.validate(ids) == len(ids)


@pytest.mark.parametrize("schema,allowed_texts,refused_texts", [
    # a schema that says extra keys may follow is honoured
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True},
     ['{"a":1,"b":2}'], []),
    ({"type": "object", "properties": {"a": {"type": "integer"}},
      "additionalProperties": {"type": "string"}}, ['{"a":1,"b":"x"}'], ['{"a":1,"b":2}']),
    # an object naming no properties stays free
    ({"type": "object"}, ['{"b":2}'], []),
    # nested, in arrays and in $defs
    ({"type": "object", "properties": {"p": {"type": "object", "properties": {"q": {"type": "integer"}}}}},
     ['{"p":{"q":1}}'], ['{"p":{"q":1,"r":2}}', '{"p":{"q":1},"r":2}']),
    ({"type": "array", "items": {"$ref": "#/$defs/item"},
      "$defs": {"item": {"type": "object", "properties": {"q": {"type": "integer"}}}}},
     ['[{"q":1}]'], ['[{"q":1,"r":2}]']),
    # property patterns close too
    ({"type": "object", "patternProperties": {"^x_": {"type": "integer"}}}, ['{"x_a":1}'], ['{"y":1}']),
    # allOf members intersect: their parent closes over all their keys
    ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                {"type": "object", "properties": {"b": {"type": "integer"}}}]},
     ['{"a":1,"b":2}'], ['{"a":1,"b":"x"}', '{"a":1,"c":2}']),
    ({"type": "object", "properties": {"a": {"type": "integer"}},
      "allOf": [{"properties": {"b": {"type": "integer"}}}]},
     ['{"a":1,"b":2}'], ['{"a":1,"b":"x"}', '{"a":1,"c":2}']),
    # anyOf members are alternatives, each closed
    ({"anyOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                {"type": "object", "properties": {"b": {"type": "integer"}}}]},
     ['{"a":1}', '{"b":1}'], ['{"a":1,"b":1}', '{"a":1,"c":1}']),
])
def test_closing_objects(manager, schema, allowed_texts, refused_texts):
    for text in allowed_texts:
        assert allows_text(manager, SO(json=schema, disable_any_whitespace=True), text), text
    for text in refused_texts:
        assert not allows_text(manager, SO(json=schema, disable_any_whitespace=True), text), text


def test_the_engine_flag():
    import argparse
    from jaxllm.cli import add_engine_args, engine_config_from_args
    from jaxllm.config import EngineConfig
    p = argparse.ArgumentParser()
    add_engine_args(p)
    flag = "--structured-outputs-allow-additional-properties"
    assert engine_config_from_args(p.parse_args([flag])).structured_outputs_allow_additional_properties
    assert not engine_config_from_args(p.parse_args([])).structured_outputs_allow_additional_properties
    with pytest.raises(ValueError, match="structured_outputs_allow_additional_properties must be a bool"):
        EngineConfig(structured_outputs_allow_additional_properties="yes")


def test_close_objects_leaves_the_callers_schema_alone():
    from jaxllm.structured_output.grammar import serialize
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    serialize(SO(json=schema))
    assert schema == {"type": "object", "properties": {"a": {"type": "integer"}}}


def test_tool_arguments_carry_only_the_parameters_named(manager, permissive):
    """tool_choice naming a function, and "required": the arguments' objects are closed the
    same way (the permissive engine leaves them open)."""
    from serve.protocol import ChatCompletionRequest
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    msgs = [{"role": "user", "content": "weather?"}]
    named = ChatCompletionRequest.model_validate({"messages": msgs, "tools": [tool], "tool_choice": {
        "type": "function", "function": {"name": "get_weather"}}}).constraint()
    required = ChatCompletionRequest.model_validate(
        {"messages": msgs, "tools": [tool], "tool_choice": "required"}).constraint()
    for constraint, good, bad in (
            (named, '{"city": "Paris"}', '{"city": "Paris", "unit": "C"}'),
            (required, '[{"name": "get_weather", "parameters": {"city": "Paris"}}]',
             '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}]')):
        assert allows_text(manager, constraint, good)
        assert not allows_text(manager, constraint, bad)
        assert allows_text(permissive, constraint, bad)


def test_choices_with_quotes_and_backslashes(manager):
    choices = ['say "hi"', "back\\slash", "é"]
    g = manager.grammar(manager.compile(manager.prepare(SO(choice=choices))).result())
    for c in choices:
        ids = manager.tokenizer.encode(c, add_special_tokens=False)
        assert g.validate(ids) == len(ids), c
    assert g.validate(manager.tokenizer.encode("say hi", add_special_tokens=False)) < 3


def test_gbnf_grammar(manager):
    g = manager.grammar(manager.compile(manager.prepare(SO(
        grammar='root ::= "x" [0-9]+ ("," "x" [0-9]+)*'))).result())
    ids = manager.tokenizer.encode("x12,x7", add_special_tokens=False)
    assert g.validate(ids) == len(ids) and g.accept(ids)
    assert g.validate(manager.tokenizer.encode(",y", add_special_tokens=False)) == 1  # "," only


# valid on its own, but the tokenizer has no such special token: fails only when compiled
UNCOMPILABLE = SO(grammar='start: "a" <|no_such_token|>')


def test_failed_compilation_raises_from_the_future(manager):
    spec = manager.prepare(UNCOMPILABLE)
    with pytest.raises(ValueError, match="structured_outputs: the grammar does not compile: .*"
                                         "unknown special token"):
        manager.compile(spec).result()


# --- the default model: many schemas in one batch --------------------------------------------

def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """An object schema drawn from what structured outputs are used for: nested objects,
    arrays with bounds, enums, numbers with ranges, required and optional properties, closed
    objects. Strings and arrays are short, so that outputs are short."""
    props = {}
    for i in range(rng.randint(1, 3 if depth else 4)):
        kind = rng.choice(["string", "integer", "number", "enum", "boolean", "array"]
                          + (["object"] if depth < 1 else []))
        name = rng.choice(["name", "city", "count", "score", "tags", "kind", "info", "ok",
                           "title", "level"]) + (str(i) if rng.random() < 0.3 else "")
        if kind == "string":
            p = {"type": "string", "minLength": 1, "maxLength": rng.randint(3, 12)}
        elif kind == "integer":
            lo = rng.randint(-50, 50)
            p = {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(1, 500)}
        elif kind == "number":
            p = {"type": "number", "minimum": 0, "exclusiveMaximum": rng.choice([1, 10, 100])}
        elif kind == "enum":
            p = {"type": "string", "enum": rng.sample(["red", "green", "blue", "small", "large",
                                                       "yes", "no"], rng.randint(2, 4))}
        elif kind == "boolean":
            p = {"type": "boolean"}
        elif kind == "array":
            lo = rng.randint(0, 2)
            item = rng.choice([{"type": "integer", "minimum": 0, "maximum": 99},
                               {"type": "string", "maxLength": 6},
                               {"type": "string", "enum": ["a", "b", "c"]}])
            p = {"type": "array", "items": item, "minItems": lo, "maxItems": lo + rng.randint(1, 2)}
        else:
            p = random_schema(rng, depth + 1)
        props[name] = p
    names = list(props)
    schema = {"type": "object", "properties": props,
              "required": rng.sample(names, rng.randint(1, len(names)))}
    # some left open: the engine closes them (an open object invites a small model to copy
    # the schema's keys from the prompt until max_tokens)
    if depth or rng.random() < 0.75:
        schema["additionalProperties"] = False
    return schema


SCHEMAS = [random_schema(random.Random(i)) for i in range(24)]


def chat_prompt(tok, text: str) -> str:
    return tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                   add_generation_prompt=True)


@pytest.mark.slow
def test_default_model_constrained_batch(default_llm):
    """One generate call: 24 JSON schemas, regexes, choices, a grammar and JSON mode, with free
    requests mixed in. Every constrained output is complete and valid; the free ones get
    exactly what they get alone; nothing compiles after warm-up."""
    llm, engine = default_llm, default_llm.llm_engine
    tok = llm.get_tokenizer()
    free_prompts = [chat_prompt(tok, "Write a haiku about the sea."),
                    chat_prompt(tok, "What is the capital of France?")]
    free = [SamplingParams(temperature=0.0, max_tokens=24),
            SamplingParams(temperature=0.8, seed=7, max_tokens=24)]
    alone = llm.generate(free_prompts, free, use_tqdm=False)

    prompts, params, checks = [], [], []
    for schema in SCHEMAS:
        prompts.append(chat_prompt(tok, "Reply with JSON only, following this schema: "
                                        + json.dumps(schema, separators=(",", ":"))))
        params.append(SamplingParams(temperature=0.0, max_tokens=200,
                                     structured_outputs=SO(json=schema)))
        checks.append(lambda text, s=schema: jsonschema.validate(json.loads(text), s))
    regexes = [r"\d{3}-\d{3}-\d{4}", r"[A-Z][a-z]{1,10} [A-Z][a-z]{1,10}",
               r"(19|20)\d\d-(0[1-9]|1[0-2])-\d\d"]
    for rx, q in zip(regexes, ["a phone number", "a person's full name", "a date"]):
        prompts.append(chat_prompt(tok, f"Give me {q}."))
        params.append(SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=SO(regex=rx)))
        checks.append(lambda text, rx=rx: re.fullmatch(rx, text) or pytest.fail(f"{text!r} !~ {rx}"))
    choices = [["positive", "negative", "neutral"], ["Paris", "London", "Rome", "Berlin"]]
    for ch, q in zip(choices, ["Is 'what a great day' positive or negative?",
                               "Which city is the capital of Italy?"]):
        prompts.append(chat_prompt(tok, q))
        params.append(SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=SO(choice=ch)))
        checks.append(lambda text, ch=ch: text in ch or pytest.fail(f"{text!r} not in {ch}"))
    grammar = 'start: answer " because " reason\nanswer: "yes" | "no"\nreason: /[a-z ,]{5,40}/'
    prompts.append(chat_prompt(tok, "Is the sky blue? Answer yes or no and say why."))
    params.append(SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=SO(grammar=grammar)))
    checks.append(lambda text: re.fullmatch(r"(yes|no) because [a-z ,]{5,40}", text)
                  or pytest.fail(repr(text)))
    prompts.append(chat_prompt(tok, "Describe a cat as a JSON object with at most three fields."))
    params.append(SamplingParams(temperature=0.0, max_tokens=120,
                                 structured_outputs=SO(json_object=True, disable_any_whitespace=True)))
    checks.append(lambda text: isinstance(json.loads(text), dict) or pytest.fail(text))
    # the free requests in the middle of the batch
    outs = llm.generate(prompts[:10] + free_prompts + prompts[10:], params[:10] + free + params[10:],
                        use_tqdm=False)
    mixed, outs = outs[10:12], outs[:10] + outs[12:]
    failures = []
    for out, check, p in zip(outs, checks, params):
        c = out.outputs[0]
        try:
            assert c.finish_reason == "stop", f"finish_reason {c.finish_reason}"
            check(c.text)
        except Exception as e:  # collect all, to see every failure at once
            failures.append(f"{p.structured_outputs.kind}: {c.text!r}: {e}")
    assert not failures, "\n".join(failures)
    for a, b in zip(alone, mixed):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert engine.structured.num_compiled >= len(SCHEMAS)
    assert engine.runner.num_compiles_after_warmup == 0
    kv = engine.kv_manager
    assert kv.num_free_blocks == kv.pool.num_usable_blocks


def test_invalid_constraint_is_refused_before_anything_runs(tiny_llm):
    with pytest.raises(ValueError, match=r"structured_outputs\.json: Unimplemented keys: \[\"not\"\]"):
        tiny_llm.generate(["a", "b"], [SamplingParams(max_tokens=4),
                                       SamplingParams(max_tokens=4, structured_outputs=SO(json={"not": {}}))],
                          use_tqdm=False)
    assert not tiny_llm.llm_engine.has_unfinished_requests()
    assert tiny_llm.generate("still fine", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_request_waits_for_its_grammar_and_is_abortable(tiny_llm):
    """A request whose grammar is compiling waits outside the scheduler while others run; an
    abort while it waits leaves nothing behind; a grammar that fails to compile ends its
    request (the server refuses such requests before submitting them)."""
    import threading
    engine = tiny_llm.llm_engine
    release = threading.Event()
    engine.structured._pool.submit(release.wait)  # hold the grammar thread
    engine.add_request("free", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
    engine.add_request("constrained", [5, 6, 7],
                       SamplingParams(max_tokens=8, structured_outputs=SO(regex="[ab]{3}c")))
    engine.add_request("aborted", [5, 6, 7],
                       SamplingParams(max_tokens=8, structured_outputs=SO(regex="[xy]{4}z")))
    engine.add_request("fails", [5, 6, 7], SamplingParams(max_tokens=8, structured_outputs=UNCOMPILABLE))
    assert set(engine.grammars.waiting) == {"constrained", "aborted", "fails"}
    engine.abort_request("aborted")
    finals = {}

    def run(steps=None):
        while engine.has_unfinished_requests() and steps != 0:
            steps = None if steps is None else steps - 1
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out.outputs[0]

    run(steps=6)  # the free request runs to its end meanwhile
    assert len(finals["free"].token_ids) == 3 and set(engine.grammars.waiting) == {"constrained", "fails"}
    release.set()
    run()
    assert "aborted" not in finals
    assert finals["fails"].finish_reason == "abort" and not finals["fails"].token_ids
    assert re.fullmatch("[ab]{3}c", finals["constrained"].text)
    assert finals["constrained"].finish_reason == "stop"
    kv = engine.kv_manager
    assert kv.num_free_blocks == kv.pool.num_usable_blocks and not engine.grammars.waiting
