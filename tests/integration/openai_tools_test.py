"""Tool calling through duet-router with the official `openai` Python client.

Run by tests/integration/run_openai_client_test.sh against a second router whose model folder
("k") has a byte tokenizer with Kimi's chat and tool-call special tokens and Kimi K2's own chat
template (tests/data/chat_templates/moonshotai-Kimi-K2.jinja). Its duet-test-worker processes
answer a prompt without <|tool_calls_section_begin|> with a scripted Kimi K2 tool call (argv[2]:
the ids, content "Let me check." then a get_weather call), and any other prompt with its ids
reversed. Checked: the tools reach the template exactly as jinja2 renders them (the oracle's
environment, tests/python/chat_template_oracle.py), the call comes back as OpenAI tool_calls
(not streaming and streaming), and a round trip (assistant tool_calls + a role "tool" message)
is rendered and answered.

Usage: openai_tools_test.py BASE_URL TEMPLATE_PATH
"""

import json
import os
import sys
import traceback
import urllib.request

import openai
from openai import OpenAI

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))
import chat_template_oracle  # noqa: E402  (jinja2 configured as transformers does)

BASE, TEMPLATE = sys.argv[1], sys.argv[2]
MODEL = "k"
client = OpenAI(base_url=BASE, api_key="unused", max_retries=0, timeout=30)
ROOT = BASE[: -len("/v1")]

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city, °C.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]

tests = []


def test(fn):
    tests.append(fn)
    return fn


def post(path, body):
    req = urllib.request.Request(ROOT + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json",
                                          "Authorization": "Bearer unused"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def rendered(messages, tools):
    """What the router's template makes of a conversation: /tokenize, then /detokenize."""
    ids = post("/tokenize", {"messages": messages, "tools": tools})["tokens"]
    return ids, post("/detokenize", {"tokens": ids})["prompt"]


def jinja2_render(messages, tools):
    env = chat_template_oracle.make_env(None)
    with open(TEMPLATE, encoding="utf-8") as f:
        tmpl = env.from_string(f.read())
    return tmpl.render(messages=messages, tools=tools, documents=None,
                       add_generation_prompt=True)


@test
def tools_reach_the_template_as_jinja2_renders_them():
    _, text = rendered(ASK, TOOLS)
    want = jinja2_render(ASK, TOOLS)
    assert text == want, (text, want)
    assert "<|im_system|>tool_declare<|im_middle|>[{" in text, text


@test
def tool_call_non_streaming():
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=100)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    assert c.message.content == "Let me check.", repr(c.message.content)
    assert len(c.message.tool_calls) == 1, c.message.tool_calls
    tc = c.message.tool_calls[0]
    assert tc.id == "functions.get_weather:0" and tc.type == "function", tc
    assert tc.function.name == "get_weather", tc
    assert json.loads(tc.function.arguments) == {"city": "Paris"}, tc.function.arguments


@test
def tool_call_streaming():
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                                max_tokens=100, stream=True):
        for c in chunk.choices:
            d = c.delta
            content += d.content or ""
            for t in d.tool_calls or []:
                cur = calls.setdefault(t.index, {"id": None, "name": None, "arguments": ""})
                if t.id:
                    cur["id"] = t.id
                if t.function and t.function.name:
                    cur["name"] = t.function.name
                if t.function and t.function.arguments:
                    cur["arguments"] += t.function.arguments
            if c.finish_reason:
                finish = c.finish_reason
    assert content == "Let me check.", repr(content)
    assert finish == "tool_calls", finish
    assert list(calls) == [0], calls
    assert calls[0]["id"] == "functions.get_weather:0", calls
    assert calls[0]["name"] == "get_weather", calls
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris"}, calls


@test
def tool_round_trip():
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=100)
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 21}'},
    ]
    ids, text = rendered(history, TOOLS)
    assert text == jinja2_render(history, TOOLS), text
    assert "## Return of functions.get_weather:0" in text, text
    r = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=8)
    # the test worker answers a conversation that had the call with its prompt reversed
    want = post("/detokenize", {"tokens": ids[::-1][:8]})["prompt"]
    assert r.choices[0].message.content == want, (r.choices[0].message.content, want)
    assert r.choices[0].message.tool_calls is None, r.choices[0].message
    assert r.choices[0].finish_reason == "length", r.choices[0].finish_reason
    assert r.usage.prompt_tokens == len(ids), (r.usage, len(ids))


@test
def tool_choice_none_offers_no_tools():
    _, text = rendered(ASK, None)
    ids = post("/tokenize", {"messages": ASK})["tokens"]
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none",
                                       max_tokens=100)
    assert r.usage.prompt_tokens == len(ids), (r.usage, len(ids))
    # no tools: the output is not parsed; the scripted call's special tokens are not shown
    assert r.choices[0].message.tool_calls is None, r.choices[0].message
    assert r.choices[0].message.content.startswith("Let me check."), r.choices[0].message


@test
def bad_tools_are_bad_requests():
    for kw, param in [({"tools": [{"type": "function", "function": {"name": "a b"}}]},
                       "tools[0].function.name"),
                      ({"tools": TOOLS, "tool_choice": {"type": "function",
                                                        "function": {"name": "nope"}}},
                       "tool_choice")]:
        try:
            client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1, **kw)
        except openai.BadRequestError as e:
            assert e.param == param, (e.param, param)
        else:
            raise AssertionError(f"{kw} did not raise openai.BadRequestError")


def main():
    print(f"openai {openai.__version__} against {BASE} (tools)")
    passed = failed = 0
    for fn in tests:
        try:
            fn()
        except Exception:  # noqa: BLE001 - report every failure, keep going
            failed += 1
            print(f"FAIL {fn.__name__}")
            traceback.print_exc()
        else:
            passed += 1
            print(f"ok   {fn.__name__}")
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
