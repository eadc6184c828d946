"""Tool-call parsers: the model's text becomes OpenAI tool calls, whole or as stream deltas.

Each family writes calls its own way; what they share is a JSON object per call with the
function's name and its arguments. A parser frames those objects in the text (Hermes:
`<tool_call>{...}</tool_call>` blocks after optional content; Llama 3: objects separated by
`;`, the whole output being calls when it starts with one; `tool_choice: required`: the JSON
array our own constraint produces) and streams each one: the call's id and name once the name
is complete, then the raw text of its arguments as it arrives, as OpenAI streams them. A
whole output is parsed by streaming it in one piece, so both paths agree. Chosen by
`--tool-call-parser` (vLLM's names).
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

_WS = " \t\r\n"
_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


class _ValueEnd:
    """Finds where a JSON value that starts at `start` ends, resuming over a growing text."""

    def __init__(self, start: int):
        self.pos, self.depth, self.in_string, self.escape = start, 0, False, False
        self.started = False

    def scan(self, text: str) -> int | None:
        """The index just past the value's end, or None while it is incomplete."""
        i, n = self.pos, len(text)
        while i < n:
            c = text[i]
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif c == "\\":
                    self.escape = True
                elif c == '"':
                    self.in_string = False
                    if self.depth == 0:
                        self.pos = i + 1
                        return i + 1
            elif c == '"':
                self.in_string, self.started = True, True
            elif c in "{[":
                self.depth += 1
                self.started = True
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.pos = i + 1
                    return i + 1
            elif self.depth == 0 and self.started and c in _WS + ",}]":
                self.pos = i
                return i  # the end of a bare number, true, false or null
            elif c not in _WS:
                self.started = True
            i += 1
        self.pos = i
        return None


class _Call:
    """One call's JSON object, from `start` in the text, as it streams."""

    def __init__(self, index: int, start: int):
        self.index, self.start = index, start
        self.end_of = _ValueEnd(start)
        self.id = new_call_id()
        self.name: str | None = None
        self.args_start: int | None = None  # where the raw arguments object begins
        self.args_end_of: _ValueEnd | None = None
        self.args_end: int | None = None
        self.sent = 0                       # characters of arguments sent
        self.header_sent = False
        self.end: int | None = None
        self.failed = False

    def step(self, text: str) -> list[dict]:
        """Deltas for what arrived; sets `end` once the object is complete."""
        out = []
        self.end = self.end_of.scan(text)
        upto = len(text) if self.end is None else self.end
        obj = text[self.start:upto]
        if not self.header_sent:
            args_key = _ARGS.search(obj)
            # a "name" key inside the arguments is not the call's
            m = _NAME.search(obj if args_key is None else obj[:args_key.start()])
            if m is not None:
                try:
                    self.name = json.loads(f'"{m.group(1)}"')
                except ValueError:
                    self.name = m.group(1)
                out.append(self._delta(header=True))
                self.header_sent = True
        if self.header_sent and self.args_start is None:
            args_key = _ARGS.search(obj)
            if args_key is not None:
                j = self.start + args_key.end()
                while j < upto and text[j] in _WS:
                    j += 1
                if j < upto and text[j] == "{":  # an object: streamed raw as it arrives
                    self.args_start = j
                    self.args_end_of = _ValueEnd(j)
        if self.args_start is not None:
            if self.args_end is None:
                self.args_end = self.args_end_of.scan(text)
            stop = self.args_end if self.args_end is not None else upto
            piece = text[self.args_start + self.sent:stop]
            if piece:
                self.sent += len(piece)
                out.append(self._delta(piece))
        if self.end is not None:
            out += self._complete(text[self.start:self.end])
        return out

    def _complete(self, obj_text: str) -> list[dict]:
        """The object is complete: what streaming could not send (a name after the arguments,
        arguments that are not an object)."""
        try:
            obj = json.loads(obj_text)
            name = obj["name"]
            args = obj.get("arguments", obj.get("parameters", {}))
        except (ValueError, KeyError, TypeError):
            self.failed = True
            return []
        out = []
        if not self.header_sent:
            self.name = name
            out.append(self._delta(header=True))
            self.header_sent = True
        if self.args_start is None:
            text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
            self.sent = len(text)
            out.append(self._delta(text))
        return out

    def _delta(self, arguments: str = "", header: bool = False) -> dict:
        if header:
            return {"index": self.index, "id": self.id, "type": "function",
                    "function": {"name": self.name, "arguments": ""}}
        return {"index": self.index, "function": {"arguments": arguments}}


class ToolStream:
    """Text deltas in, (content delta, tool-call deltas) out. Subclasses frame the calls:
    `_content` finds where calls begin, `_next` where the next call's object begins."""

    def __init__(self):
        self.text = ""
        self.pos = 0               # scanned up to here
        self.in_calls = False
        self.calls: list[_Call] = []
        self.current: _Call | None = None
        self.finished = False      # no further calls can follow
        self.content_sent = 0      # characters of content sent (a prefix of the text)

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict]]:
        content, deltas = self._feed(delta, final)
        if final and self.failed and not any(c.header_sent for c in self.calls):
            content += self.text[self.content_sent + len(content):]  # it was content after all
        self.content_sent += len(content)
        return content, deltas

    def _feed(self, delta: str, final: bool) -> tuple[str, list[dict]]:
        self.text += delta
        content, deltas = "", []
        while True:
            if not self.in_calls:
                piece, begins = self._content(final)
                content += piece
                if not begins:
                    break
                self.in_calls = True
            if self.finished:
                self.pos = len(self.text)
                break
            if self.current is None:
                start = self._next(final)
                if start is None:
                    break
                self.current = _Call(len(self.calls), start)
                self.calls.append(self.current)
            deltas += self.current.step(self.text)
            if self.current.end is None:
                break
            self.pos, self.current = self.current.end, None
        return content, deltas

    def finish(self) -> tuple[str, list[dict]]:
        return self.feed("", final=True)

    def _content(self, final: bool) -> tuple[str, bool]:
        raise NotImplementedError

    def _next(self, final: bool) -> int | None:
        raise NotImplementedError

    def _skip(self, chars: str = _WS) -> None:
        while self.pos < len(self.text) and self.text[self.pos] in chars:
            self.pos += 1

    @property
    def tool_calls(self) -> list[ToolCall]:
        return [ToolCall(c.name, self.text[c.args_start:c.args_start + c.sent]
                         if c.args_start is not None else _args_text(self.text[c.start:c.end]),
                         c.id)
                for c in self.calls if c.end is not None and not c.failed]

    @property
    def failed(self) -> bool:
        """A call that did not parse, or one cut off: the output is not a valid call list."""
        return any(c.failed or c.end is None for c in self.calls)


def _args_text(obj_text: str) -> str:
    obj = json.loads(obj_text)
    args = obj.get("arguments", obj.get("parameters", {}))
    return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


class HermesStream(ToolStream):
    """Content, then `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks
    (Hermes, Qwen 2.5/3, SmolLM3 chat templates). Text after the calls is dropped."""
    START, END = "<tool_call>", "</tool_call>"

    def _content(self, final: bool) -> tuple[str, bool]:
        i = self.text.find(self.START, self.pos)
        if i >= 0:
            piece, self.pos = self.text[self.pos:i], i + len(self.START)
            return piece, True
        keep = 0 if final else _partial_suffix(self.text, self.START, self.pos)
        piece = self.text[self.pos:len(self.text) - keep]
        self.pos += len(piece)
        return piece, False

    def _next(self, final: bool) -> int | None:
        self._skip()
        rest = self.text[self.pos:]
        if rest.startswith(self.END):
            self.pos += len(self.END)
            self._skip()
            rest = self.text[self.pos:]
        if rest.startswith(self.START):
            self.pos += len(self.START)
            self._skip()
            rest = self.text[self.pos:]
        if rest.startswith("{"):
            return self.pos
        if rest and not (self.START.startswith(rest) or self.END.startswith(rest)):
            self.finished = True  # text after the calls
        return None


class Llama3JsonStream(ToolStream):
    """Llama 3.x's JSON tool calls: the output is `{"name": ..., "parameters": {...}}`
    objects separated by `;` (optionally after `<|python_tag|>`), or plain content."""
    TAG = "<|python_tag|>"

    def _content(self, final: bool) -> tuple[str, bool]:
        if self.calls or self.pos > 0:  # decided: plain content
            piece, self.pos = self.text[self.pos:], len(self.text)
            return piece, False
        head = self.text.lstrip(_WS)
        if head.startswith(self.TAG) or head.startswith("{"):
            self.pos = self.text.index(head[0])
            if head.startswith(self.TAG):
                self.pos += len(self.TAG)
            return "", True
        if not head or (self.TAG.startswith(head) and not final):
            return "", False  # not decided yet
        piece, self.pos = self.text, len(self.text)
        return piece, False

    def _next(self, final: bool) -> int | None:
        self._skip(_WS + ";")
        rest = self.text[self.pos:]
        if rest.startswith("{"):
            return self.pos
        if rest:
            self.finished = True
        return None


class JsonArrayStream(ToolStream):
    """`tool_choice: required`: the JSON array of {"name", "parameters"} objects that the
    request's own constraint makes the model write."""

    def _content(self, final: bool) -> tuple[str, bool]:
        self._skip()
        if self.pos < len(self.text) and self.text[self.pos] == "[":
            self.pos += 1
            return "", True
        return "", False

    def _next(self, final: bool) -> int | None:
        self._skip(_WS + ",")
        rest = self.text[self.pos:]
        if rest.startswith("{"):
            return self.pos
        if rest:
            self.finished = True  # the closing bracket
        return None


def _partial_suffix(text: str, marker: str, start: int) -> int:
    """Length of the longest end of text[start:] that begins `marker` (held back while it may
    be the start of the marker)."""
    for k in range(min(len(marker) - 1, len(text) - start), 0, -1):
        if marker.startswith(text[len(text) - k:]):
            return k
    return 0


class ToolParser:
    """A parser family: how to stream a model's output, and whole outputs via the stream."""

    def __init__(self, stream_cls):
        self.stream_cls = stream_cls

    def stream(self) -> ToolStream:
        return self.stream_cls()

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of a whole output; an output whose calls do not parse is all
        content."""
        s = self.stream()
        content, _ = s.feed(text)
        rest, _ = s.finish()
        calls = s.tool_calls
        if s.failed or not calls:
            return text, []
        content += rest
        return (content if content.strip() else None), calls


PARSERS = {"hermes": HermesStream, "llama3_json": Llama3JsonStream}


def get_parser(name: str) -> ToolParser:
    if name not in PARSERS:
        raise ValueError(f"tool_call_parser must be one of {sorted(PARSERS)}, got {name!r}")
    return ToolParser(PARSERS[name])


REQUIRED = ToolParser(JsonArrayStream)
