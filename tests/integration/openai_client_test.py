"""The official `openai` Python client against duet-router.

Run by tests/integration/run_openai_client_test.sh, which starts duet-router (model "m", byte
tokenizer with <|bos|>, the default chat template) with 1 ctx and 2 gen duet-test-worker
processes and passes the router's base URL as argv[1]. The router runs with api.key "unused"
(DUET_API_KEY), the key this client sends.

The test worker answers with the prompt's token ids reversed (cycling), so the text is
deterministic: with the byte tokenizer a token is a byte.
  completions "hello world" -> prompt "<|bos|>hello world" (12 tokens) -> "dlrow olleh..."
  chat [user "abc"] -> prompt "<|bos|>user: abc\nassistant: " (22 tokens) -> " :tnatsissa\ncba :resu"
Keep max_tokens below the prompt's byte count so the cycle never reaches <|bos|>.

Plain asserts; prints "N passed, M failed" and exits non-zero on any failure.
"""

import sys
import traceback

import openai
from openai import OpenAI

BASE = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000/v1"
MODEL = "m"
client = OpenAI(base_url=BASE, api_key="unused", max_retries=0, timeout=30)

PROMPT = "hello world"
PROMPT_REV = PROMPT[::-1]  # "dlrow olleh"
PROMPT_TOKENS = 1 + len(PROMPT)  # <|bos|> + bytes
CHAT = [{"role": "user", "content": "abc"}]
CHAT_PROMPT = "user: abc\nassistant: "
CHAT_REV = CHAT_PROMPT[::-1]  # " :tnatsissa\ncba :resu"
CHAT_TOKENS = 1 + len(CHAT_PROMPT)

tests = []


def test(fn):
    tests.append(fn)
    return fn


@test
def completions_non_streaming_length():
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5)
    assert r.object == "text_completion", r
    assert r.model == MODEL, r.model
    assert len(r.choices) == 1, r.choices
    assert r.choices[0].text == PROMPT_REV[:5], repr(r.choices[0].text)
    assert r.choices[0].finish_reason == "length", r.choices[0].finish_reason
    assert r.usage.prompt_tokens == PROMPT_TOKENS, r.usage
    assert r.usage.completion_tokens == 5, r.usage
    assert r.usage.total_tokens == PROMPT_TOKENS + 5, r.usage


@test
def completions_non_streaming_stop():
    # "dlrow olleh": the stop string "ol" cuts before "olleh" -> "dlrow ", finish "stop"
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, stop=["ol"])
    assert r.choices[0].text == "dlrow ", repr(r.choices[0].text)
    assert r.choices[0].finish_reason == "stop", r.choices[0].finish_reason


@test
def completions_streaming():
    text, finishes = "", []
    for chunk in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, stream=True):
        assert chunk.object == "text_completion", chunk
        assert chunk.usage is None, chunk.usage
        for c in chunk.choices:
            text += c.text
            if c.finish_reason is not None:
                finishes.append(c.finish_reason)
    assert text == PROMPT_REV[:5], repr(text)
    assert finishes == ["length"], finishes


@test
def completions_streaming_include_usage():
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, stream=True,
                                            stream_options={"include_usage": True}))
    last = chunks[-1]
    assert last.choices == [], last
    assert last.usage is not None, last
    assert last.usage.prompt_tokens == PROMPT_TOKENS, last.usage
    assert last.usage.completion_tokens == 5, last.usage
    assert last.usage.total_tokens == PROMPT_TOKENS + 5, last.usage
    for c in chunks[:-1]:
        assert c.usage is None, c  # "usage": null on every other chunk
    text = "".join(ch.text for c in chunks for ch in c.choices)
    assert text == PROMPT_REV[:5], repr(text)


@test
def generated_special_token_skipped_or_shown():
    # prompt ids b, <|bos|>, a -> the worker answers a, <|bos|>, b: a special id that is no stop
    # id. skip_special_tokens (vLLM's field, default true) drops its text; false keeps it.
    ids = [ord("b"), 256, ord("a")]
    for extra, want in (({}, "ab"), ({"skip_special_tokens": True}, "ab"),
                        ({"skip_special_tokens": False}, "a<|bos|>b")):
        r = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, extra_body=extra)
        assert r.choices[0].text == want, (extra, r.choices[0].text)
        assert r.choices[0].finish_reason == "length", r.choices[0].finish_reason
        assert r.usage.completion_tokens == 3, r.usage
        text = "".join(c.text for chunk in client.completions.create(
            model=MODEL, prompt=ids, max_tokens=3, stream=True, extra_body=extra)
            for c in chunk.choices)
        assert text == want, (extra, text)
    try:
        client.completions.create(model=MODEL, prompt=ids, max_tokens=3,
                                  extra_body={"skip_special_tokens": "no"})
    except openai.BadRequestError as e:
        assert e.status_code == 400, e.status_code
    else:
        raise AssertionError("skip_special_tokens \"no\" was accepted")


@test
def chat_non_streaming_length():
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=11)
    assert r.object == "chat.completion", r
    assert r.model == MODEL, r.model
    m = r.choices[0].message
    assert m.role == "assistant", m
    assert m.content == CHAT_REV[:11] == " :tnatsissa", repr(m.content)
    assert r.choices[0].finish_reason == "length", r.choices[0].finish_reason
    assert r.usage.prompt_tokens == CHAT_TOKENS, r.usage
    assert r.usage.completion_tokens == 11, r.usage


@test
def chat_non_streaming_stop():
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20, stop="ss")
    assert r.choices[0].message.content == " :tnatsi", repr(r.choices[0].message.content)
    assert r.choices[0].finish_reason == "stop", r.choices[0].finish_reason


@test
def chat_streaming_role_first_and_finish():
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=11,
                                                 stream=True))
    assert chunks, "no chunks"
    first = chunks[0]
    assert first.object == "chat.completion.chunk", first
    assert first.choices[0].delta.role == "assistant", first
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == CHAT_REV[:11], repr(text)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and
                c.choices[0].finish_reason is not None]
    assert finishes == ["length"], finishes
    assert chunks[-1].choices[0].finish_reason == "length", chunks[-1]


@test
def chat_streaming_stop_include_usage():
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20,
                                                 stop=["ss"], stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant", chunks[0]
    last = chunks[-1]
    assert last.choices == [], last
    assert last.usage is not None and last.usage.prompt_tokens == CHAT_TOKENS, last.usage
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == " :tnatsi", repr(text)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and
                c.choices[0].finish_reason is not None]
    assert finishes == ["stop"], finishes


@test
def chat_content_parts():
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "bc"}]
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": parts}],
                                       max_tokens=11)
    # parts are concatenated without a separator: the same prompt as "abc"
    assert r.choices[0].message.content == CHAT_REV[:11], repr(r.choices[0].message.content)
    assert r.usage.prompt_tokens == CHAT_TOKENS, r.usage


@test
def chat_system_message_in_template():
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "abc"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=30)
    full = "system: S\nuser: abc\nassistant: "
    assert r.usage.prompt_tokens == 1 + len(full), r.usage
    assert r.choices[0].message.content == full[::-1][:30], repr(r.choices[0].message.content)


@test
def chat_stream_helper():
    # events + get_final_completion(), finish "stop" (a stop string)
    events = []
    with client.chat.completions.stream(model=MODEL, messages=CHAT, max_tokens=20,
                                        stop=["ss"]) as stream:
        for ev in stream:
            events.append(ev)
        final = stream.get_final_completion()
    types = [e.type for e in events]
    assert "chunk" in types, types
    assert "content.done" in types, types
    chunks = [e.chunk for e in events if e.type == "chunk"]
    assert chunks[0].choices[0].delta.role == "assistant", chunks[0]
    deltas = "".join(e.delta for e in events if e.type == "content.delta")
    assert deltas == " :tnatsi", repr(deltas)
    done = [e for e in events if e.type == "content.done"]
    assert len(done) == 1 and done[0].content == " :tnatsi", done
    m = final.choices[0].message
    assert m.role == "assistant" and m.content == " :tnatsi", final
    assert final.choices[0].finish_reason == "stop", final.choices[0].finish_reason
    assert final.usage is None or final.usage.prompt_tokens == CHAT_TOKENS, final.usage


@test
def chat_stream_helper_length():
    # finish "length": the helper's get_final_completion() raises LengthFinishReasonError (the
    # library's documented behaviour) carrying the completion, whose text is still ours
    with client.chat.completions.stream(model=MODEL, messages=CHAT, max_tokens=11,
                                        stream_options={"include_usage": True}) as stream:
        text = "".join(e.delta for e in stream if e.type == "content.delta")
        try:
            stream.get_final_completion()
        except openai.LengthFinishReasonError as e:
            c = e.completion
            assert c.choices[0].finish_reason == "length", c
            assert c.choices[0].message.content == CHAT_REV[:11], c
            assert c.usage is not None and c.usage.prompt_tokens == CHAT_TOKENS, c.usage
            assert c.usage.completion_tokens == 11, c.usage
        else:
            raise AssertionError("finish 'length' did not raise LengthFinishReasonError")
    assert text == CHAT_REV[:11], repr(text)


@test
def models_list():
    models = list(client.models.list())
    assert [m.id for m in models] == [MODEL], models
    m = models[0].to_dict()
    assert m["owned_by"] == "duet", m
    assert m["max_model_len"] == 4096, m  # config.json's model_max_length
    assert isinstance(m["created"], int) and m["created"] > 1_600_000_000, m


@test
def models_retrieve():
    m = client.models.retrieve(MODEL)
    assert m.to_dict() == list(client.models.list())[0].to_dict(), m
    # the client escapes the id's '/' as %2F; the server decodes it before comparing
    try:
        client.models.retrieve("org/" + MODEL)
    except openai.NotFoundError as e:
        assert e.status_code == 404 and e.code == "model_not_found", e
        assert f"`org/{MODEL}`" in e.message, e.message
    else:
        raise AssertionError("an unknown model id did not raise openai.NotFoundError")


@test
def unknown_route_is_not_found():
    try:
        client.embeddings.create(model=MODEL, input="x")
    except openai.NotFoundError as e:
        assert e.status_code == 404 and e.code == "unknown_url", e
        assert "POST /v1/embeddings" in e.message, e.message
    else:
        raise AssertionError("POST /v1/embeddings did not raise openai.NotFoundError")


@test
def unknown_fields_are_ignored():
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3,
                                  extra_body={"guided_regex": "x", "chat_template_kwargs": {}})
    assert r.choices[0].text == PROMPT_REV[:3], repr(r.choices[0].text)


@test
def chat_n3_non_streaming():
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, n=3, seed=11)
    assert [c.index for c in r.choices] == [0, 1, 2], r.choices
    for c in r.choices:
        assert c.message.content == CHAT_REV[:5], repr(c.message.content)
        assert c.finish_reason == "length", c.finish_reason
    assert r.usage.prompt_tokens == CHAT_TOKENS, r.usage  # counted once
    assert r.usage.completion_tokens == 15, r.usage


@test
def completions_n2_streaming_interleaved():
    text, finishes, usage = {}, {}, []
    for chunk in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, n=2,
                                           stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage.append(chunk.usage)
        for c in chunk.choices:
            text[c.index] = text.get(c.index, "") + c.text
            if c.finish_reason is not None:
                finishes[c.index] = c.finish_reason
    assert text == {0: PROMPT_REV[:5], 1: PROMPT_REV[:5]}, text
    assert finishes == {0: "length", 1: "length"}, finishes
    assert len(usage) == 1 and usage[0].completion_tokens == 10, usage


@test
def n_over_the_limit_is_bad_request():
    try:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, n=17)
    except openai.BadRequestError as e:
        assert e.status_code == 400, e.status_code
        assert e.param == "n", e.param
    else:
        raise AssertionError("n=17 did not raise openai.BadRequestError")


@test
def streamed_best_of_over_n_is_bad_request():
    try:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, n=1, best_of=2,
                                  stream=True)
    except openai.BadRequestError as e:
        assert e.param == "best_of", e.param
        assert "cannot be streamed" in e.message, e.message
    else:
        raise AssertionError("streamed best_of=2 did not raise openai.BadRequestError")


def post_root(path, body):
    """POST JSON to the router's root (vLLM's /tokenize is outside /v1): (status, JSON)."""
    import json
    import urllib.error
    import urllib.request
    root = BASE[:-len("/v1")] if BASE.endswith("/v1") else BASE
    req = urllib.request.Request(root + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **AUTH}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


AUTH = {"Authorization": "Bearer unused"}  # the router runs with api.key "unused"


@test
def tokenize_and_detokenize():
    st, r = post_root("/tokenize", {"model": MODEL, "prompt": PROMPT})
    assert st == 200, (st, r)
    # the router's model folder adds <|bos|> (256) to a completions prompt; bytes are ids
    assert r == {"count": PROMPT_TOKENS, "max_model_len": 4096,
                 "tokens": [256] + list(PROMPT.encode())}, r
    st, r = post_root("/tokenize", {"messages": CHAT})
    assert st == 200 and r["count"] == CHAT_TOKENS, (st, r)
    st, d = post_root("/detokenize", {"tokens": r["tokens"]})
    assert st == 200 and d == {"prompt": "<|bos|>" + CHAT_PROMPT}, (st, d)
    st, e = post_root("/detokenize", {"tokens": [1, -5]})
    assert st == 400 and e["error"]["param"] == "tokens[1]", (st, e)


@test
def wrong_api_key_is_authentication_error():
    bad = OpenAI(base_url=BASE, api_key="not-the-key", max_retries=0, timeout=30)
    try:
        bad.models.list()
    except openai.AuthenticationError as e:
        assert e.status_code == 401, e.status_code
        assert e.code == "invalid_api_key", e.code
    else:
        raise AssertionError("a wrong key did not raise openai.AuthenticationError")
    global AUTH
    saved, AUTH = AUTH, {}
    try:
        st, e = post_root("/tokenize", {"prompt": "x"})
        assert st == 401 and e["error"]["code"] == "invalid_api_key", (st, e)
    finally:
        AUTH = saved


@test
def unknown_model_is_not_found():
    try:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    except openai.NotFoundError as e:
        assert e.status_code == 404, e.status_code
    else:
        raise AssertionError("an unknown model did not raise openai.NotFoundError")


def main():
    print(f"openai {openai.__version__} against {BASE}")
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
