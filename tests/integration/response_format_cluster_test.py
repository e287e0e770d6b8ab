"""response_format json_object and json_schema through a real local cluster, with the official openai client.

Starts duet-router, one duet-ctx and two duet-gen on the demo model (CPU; gen-1 speculates with
the shipped draft model, which a response_format request must not use; round-robin placement, so
every check runs on both gen workers), then checks:
  - chat with response_format {"type": "json_object"}, greedy and seeded (temperature 1), by local
    prefill (a short prompt: the gen worker samples every id under the mask) and by remote
    prefill (a long prompt: the context worker samples the first id under the mask, the gen
    worker replays it into its automaton and goes on): the content parses with json.loads as an
    object whenever finish_reason is "stop", and with "length" it is a prefix the Python json
    parser fails on only because it ended (json.JSONDecodeError at the text's end);
  - the same prompts without response_format: the demo model's free text is not a JSON object
    (so the checks above can fail);
  - max_tokens 2 cuts the object: finish_reason "length", a valid prefix;
  - streaming gives the same content as the non-streamed greedy answer;
  - a long constrained request (logit_bias keeps "}" away, so the object goes on) moved between
    the gen workers mid-decode (drain --migrate of the worker running it): the target rebuilds
    the automaton from the ids generated before the move, so the whole text stays a valid prefix;
    the router's duet_router_moves_total{result="ok"} counts the move;
  - json_schema with five schemas of tests/data/json_schema (objects with optional fields, nested
    arrays with bounds, $defs and anyOf with null, a top-level enum, recursion), greedy and
    seeded, local and remote prefill: a finished answer parses and validates against the schema
    (the jsonschema package), greedy answers agree across the gen workers and with streaming,
    and at least 10 of the 40 answers finish (so the validation is not vacuous);
  - unknown types, json_schema without its schema, and schemas outside the compiled subset
    (pattern, a dangling $ref) are 400s naming the parameter (openai.BadRequestError).

Usage: response_format_cluster_test.py BUILD_DIR MODEL_DIR. Env: RF_TEST_LOG_LEVEL (default
warn); the processes' logs stay in the temp dir a failure names.
"""
import json
import os
import re
import sys
import tempfile
import threading
import time
import urllib.request

from duet_cluster import check, cluster, failures, finish

BUILD, MODEL = sys.argv[1], sys.argv[2]
LOCAL_BELOW = 16  # prompts shorter than this many tokens are prefilled by the gen worker
CUT_SCALAR = re.compile(r"^(-?[0-9]*\.?[0-9]*([eE][+-]?[0-9]*)?|t(r(ue?)?)?|f(a(l(se?)?)?)?|"
                        r"n(u(ll?)?)?)$")
counts = {"stop": 0, "length": 0}


def check_json(content, finish, what):
    """A finished answer is one JSON object; a cut one fails to parse only at its end."""
    counts[finish] = counts.get(finish, 0) + 1
    if finish == "stop":
        try:
            check(isinstance(json.loads(content), dict), f"{what}: not an object: {content!r}")
        except json.JSONDecodeError as e:
            check(False, f"{what}: finished but does not parse ({e}): {content!r}")
    else:
        check(finish == "length", f"{what}: finish_reason {finish}")
        try:
            json.loads(content)
            check(False, f"{what}: cut by length yet complete: {content!r}")
        except json.JSONDecodeError as e:
            # cut inside the value: the parser runs out of text (or stops at a cut string,
            # escape, number or literal), it never meets a wrong byte
            rest = content[e.pos:]
            check(e.pos >= len(content.rstrip()) or e.msg.startswith("Unterminated string")
                  or e.msg.startswith("Invalid \\uXXXX") or CUT_SCALAR.match(rest),
                  f"{what}: a byte the mask should have refused ({e}): {content!r}")


def admin(port, method, path):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method,
                                 data=b"" if method == "POST" else None)
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read() or b"null")


def moves_ok(port):
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("duet_router_moves_total{") and 'result="ok"' in line)


def check_move(client, model, hp, ap):
    """A constrained request moved mid-decode stays a valid JSON prefix."""
    got = {}

    def consume():
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "JSON"}], max_tokens=1500,
            temperature=0, response_format={"type": "json_object"},
            logit_bias={str(ord("}")): -100}, stream=True)
        parts, finish = [], None
        for ch in stream:
            if ch.choices:
                parts.append(ch.choices[0].delta.content or "")
                finish = ch.choices[0].finish_reason or finish
        got["text"], got["finish"] = "".join(parts), finish

    before = moves_ok(hp)
    t0 = time.time()
    t = threading.Thread(target=consume)
    t.start()
    time.sleep(0.4)  # heartbeats (100 ms) no longer show the requests before this one
    source = None
    deadline = time.time() + 20
    while source is None and time.time() < deadline and t.is_alive():
        for w in admin(ap, "GET", "/admin/workers")["workers"]:
            if w["role"] == "gen" and w["load"]["running"] > 0:
                source = w["name"]
        time.sleep(0.02)
    check(source is not None, "move: never saw the request running on a gen worker")
    if source is not None:
        r = admin(ap, "POST", f"/admin/workers/{source}/drain?migrate=1")
        check(r.get("migrate") is True, f"move: drain answered {r}")
    t.join(120)
    if source is not None:
        admin(ap, "POST", f"/admin/workers/{source}/undrain")
    check(moves_ok(hp) > before, f"move: no move counted (source {source})")
    print(f"moved from {source}: {got.get('text', '')[:80]!r}... ({len(got.get('text', ''))} "
          f"bytes, {got.get('finish')}, {time.time() - t0:.1f} s)", flush=True)
    check_json(got.get("text", ""), got.get("finish"), "moved request")


def run_checks(client, model):
    import openai
    short = [{"role": "user", "content": "Give me a JSON object."}]
    long = [{"role": "user", "content": "Describe the weather in JSON. " * 12}]
    rf = {"type": "json_object"}
    for prompt, where in ((short, "local prefill"), (long, "remote prefill")):
        for rep in range(2):  # round robin: each gen worker
            r = client.chat.completions.create(model=model, messages=prompt, max_tokens=48,
                                               temperature=0, response_format=rf)
            c = r.choices[0]
            check_json(c.message.content, c.finish_reason, f"greedy, {where}, run {rep}")
            if rep == 0:
                greedy = c.message.content
                print(f"greedy, {where}: {greedy!r} ({c.finish_reason})", flush=True)
            else:
                check(c.message.content == greedy, f"greedy, {where}: the two gen workers differ: "
                      f"{greedy!r} vs {c.message.content!r}")
            free = client.chat.completions.create(model=model, messages=prompt, max_tokens=48,
                                                  temperature=0)
            text = free.choices[0].message.content
            try:
                is_obj = isinstance(json.loads(text), dict)
            except json.JSONDecodeError:
                is_obj = False
            check(not is_obj, f"{where}: the free text is already a JSON object: {text!r}")
            if rep == 0:
                print(f"free text, {where}: {text!r}", flush=True)
        for seed in range(4):
            r = client.chat.completions.create(model=model, messages=prompt, max_tokens=48,
                                               temperature=1.0, seed=seed, response_format=rf)
            c = r.choices[0]
            check_json(c.message.content, c.finish_reason, f"seed {seed}, {where}")
            print(f"seed {seed}, {where}: {c.message.content!r} ({c.finish_reason})", flush=True)
        r = client.chat.completions.create(model=model, messages=prompt, max_tokens=2,
                                           temperature=0, response_format=rf)
        c = r.choices[0]
        check(c.finish_reason == "length", f"max_tokens 2, {where}: {c.finish_reason}")
        check_json(c.message.content, c.finish_reason, f"max_tokens 2, {where}")
        stream = client.chat.completions.create(model=model, messages=prompt, max_tokens=48,
                                                temperature=0, response_format=rf, stream=True)
        text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
        check(text == greedy, f"stream, {where}: {text!r} vs {greedy!r}")
    for bad, what, param in (
            ({"type": "xml"}, "unknown type", "response_format.type"),
            ({"type": "json_schema"}, "json_schema without json_schema",
             "response_format.json_schema"),
            ({"type": "json_schema", "json_schema": {"name": "x"}}, "json_schema without schema",
             "response_format.json_schema.schema"),
            ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
                "type": "string", "pattern": "^a"}}}, "a pattern (not supported)",
             "response_format.json_schema.schema"),
            ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
                "$ref": "#/$defs/none"}}}, "a dangling $ref",
             "response_format.json_schema.schema")):
        try:
            client.chat.completions.create(model=model, messages=short, max_tokens=4,
                                           response_format=bad)
            check(False, f"{what}: accepted")
        except openai.BadRequestError as e:
            check(e.body.get("param") == param, f"{what}: {e.body}")


def schema_file(name):
    here = os.path.dirname(os.path.abspath(__file__))
    return json.load(open(os.path.join(here, "..", "data", "json_schema", name)))


def check_schemas(client, model):
    """json_schema: every finished answer parses and validates (jsonschema, the oracle); greedy
    answers agree across the two gen workers (one speculates) and with streaming."""
    import jsonschema
    short = [{"role": "user", "content": "Fill in the form."}]
    long = [{"role": "user", "content": "Fill in the form as JSON, please. " * 10}]
    stops = 0
    for name in ("person.json", "weather.json", "pydantic_defs.json", "enum_mixed.json",
                 "recursive_tree.json"):
        schema = schema_file(name)
        validator = jsonschema.Draft202012Validator(schema)
        rf = {"type": "json_schema", "json_schema": {"name": name[:-5], "schema": schema,
                                                      "strict": True}}
        for prompt, where in ((short, "local prefill"), (long, "remote prefill")):
            answers = []
            for rep, seed in ((0, None), (1, None), (2, 1), (3, 2)):
                r = client.chat.completions.create(
                    model=model, messages=prompt, max_tokens=160, response_format=rf,
                    temperature=0 if seed is None else 1.0, seed=seed)
                c = r.choices[0]
                text = c.message.content
                what = f"{name}, {where}, {'greedy' if seed is None else f'seed {seed}'}"
                if c.finish_reason == "stop":
                    stops += 1
                    try:
                        errs = list(validator.iter_errors(json.loads(text)))
                        check(not errs, f"{what}: invalid ({errs[0].message if errs else ''}): "
                              f"{text!r}")
                    except json.JSONDecodeError as e:
                        check(False, f"{what}: finished but does not parse ({e}): {text!r}")
                else:
                    check(c.finish_reason == "length", f"{what}: finish_reason {c.finish_reason}")
                answers.append(text)
                if rep == 0:
                    print(f"{what}: {text[:120]!r} ({c.finish_reason})", flush=True)
            check(answers[0] == answers[1], f"{name}, {where}: the gen workers differ: "
                  f"{answers[0]!r} vs {answers[1]!r}")
            stream = client.chat.completions.create(
                model=model, messages=prompt, max_tokens=160, temperature=0, response_format=rf,
                stream=True)
            text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
            check(text == answers[0], f"{name}, {where}, stream: {text!r} vs {answers[0]!r}")
    print(f"json_schema answers that finished (validated): {stops} of 40", flush=True)
    check(stops >= 10, f"only {stops} json_schema answers finished: the validation checks "
          "above hardly ran")


def main():
    import openai
    tmp = tempfile.mkdtemp(prefix="duet-rf-")
    ap = []
    draft = os.path.join(os.path.dirname(MODEL), "duet-demo-draft")
    workers = [("ctx-0", "ctx", []), ("gen-0", "gen", []),
               ("gen-1", "gen", ["--spec.method", "draft", "--spec.k", "3",
                                 "--spec.draft-model", draft])]
    with cluster(BUILD, MODEL, tmp, workers,
                 router_args=["--placement.local_prefill_tokens", str(LOCAL_BELOW),
                              "--placement.policy", "round_robin"],
                 log_level=os.environ.get("RF_TEST_LOG_LEVEL", "warn"), admin_port=ap) as hp:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{hp}/v1", api_key="x", max_retries=0)
        model = client.models.list().data[0].id
        run_checks(client, model)
        check_schemas(client, model)
        check_move(client, model, hp, ap[0])
    print(f"finish reasons of the constrained answers: {counts}")
    finish("response_format_cluster", failures, tmp)


main()
