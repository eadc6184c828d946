"""The request models alone (no engine): what a body must hold before anything runs."""
import pytest
from pydantic import ValidationError

from serve.protocol import ChatCompletionRequest, TokenizeRequest

CALL = [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]


@pytest.mark.parametrize("messages,where", [
    ([{"role": "user", "content": None}], ("messages", 0, "content")),
    ([{"role": "user"}], ("messages", 0, "content")),
    ([{"role": "system", "content": None}, {"role": "user", "content": "hi"}], ("messages", 0, "content")),
    ([{"role": "developer", "content": None}], ("messages", 0, "content")),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": CALL},
      {"role": "tool", "tool_call_id": "call_1", "content": None}], ("messages", 2, "content")),
])
def test_null_content_is_refused_naming_the_message(messages, where):
    for model in (ChatCompletionRequest, TokenizeRequest):
        with pytest.raises(ValidationError) as e:
            model.model_validate({"messages": messages})
        err = e.value.errors()[0]
        assert err["loc"] == where and "needs content" in err["msg"]


def test_an_assistant_calling_tools_keeps_null_content():
    body = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": CALL},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "user", "content": [{"type": "text", "text": "thanks"}]}]})
    assert body.messages[1].plain()["tool_calls"][0]["function"]["arguments"] == {}
    assert body.messages[1].content is None and body.messages[1].plain()["content"] == ""
