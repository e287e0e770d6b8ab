"""response_format json_schema's automaton against the Python jsonschema package as the oracle.

For every schema in tests/data/json_schema/*.json (written for this test: the shapes pydantic and
OpenAI's structured-output examples produce, with $defs, Optional fields as anyOf with null,
enums, nested arrays with bounds, recursion), duet-jschema-walk prints random texts the automaton
accepts; each must parse (json.loads) and validate (jsonschema, Draft 2020-12), and the walks
must differ (the automaton is not stuck on one text; a top-level enum reaches every value). Schemas outside the compiled subset must be
refused by the tool with the keyword named: tests/data/json_schema/refused/*.json, whose
"x-refused" field names the expected words (the field itself is then removed).

Usage: json_schema_oracle_test.py BUILD_DIR
"""
import glob
import json
import os
import subprocess
import sys
import tempfile

import jsonschema

BUILD = sys.argv[1]
TOOL = os.path.join(BUILD, "tests", "tools", "duet-jschema-walk")
DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "json_schema")
WALKS = 300
failures = []

for path in sorted(glob.glob(os.path.join(DATA, "*.json"))):
    name = os.path.basename(path)
    schema = json.load(open(path))
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    r = subprocess.run([TOOL, path, str(WALKS), "41"], capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        failures.append(f"{name}: duet-jschema-walk failed: {r.stderr.strip()}")
        continue
    lines = r.stdout.splitlines()
    if len(lines) != WALKS:
        failures.append(f"{name}: {len(lines)} texts, want {WALKS}")
    bad = 0
    for line in lines:
        try:
            doc = json.loads(line)
        except json.JSONDecodeError as e:
            failures.append(f"{name}: does not parse ({e}): {line!r}")
            bad += 1
            continue
        errs = list(validator.iter_errors(doc))
        if errs:
            failures.append(f"{name}: invalid ({errs[0].message}): {line!r}")
            bad += 1
        if bad > 5:
            break
    distinct = len(set(lines))
    if "enum" in schema:  # a finite language: every value is reached
        if distinct != len(schema["enum"]):
            failures.append(f"{name}: {distinct} distinct texts, {len(schema['enum'])} values")
    elif distinct < WALKS // 3:
        failures.append(f"{name}: only {distinct} distinct texts of {WALKS}")
    print(f"{name}: {len(lines)} texts, {distinct} distinct, {bad} invalid; e.g. {lines[0][:100]}",
          flush=True)

for path in sorted(glob.glob(os.path.join(DATA, "refused", "*.json"))):
    name = "refused/" + os.path.basename(path)
    schema = json.load(open(path))
    want = schema.pop("x-refused")
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(schema, f)
    r = subprocess.run([TOOL, f.name, "1", "1"], capture_output=True, text=True, timeout=60)
    os.unlink(f.name)
    if r.returncode == 0:
        failures.append(f"{name}: compiled, but it must be refused")
    elif want not in r.stderr:
        failures.append(f"{name}: error {r.stderr.strip()!r} lacks {want!r}")
    print(f"{name}: {r.stderr.strip()}", flush=True)

for f in failures:
    print("FAIL:", f)
print("json_schema oracle:", "FAILED" if failures else "passed")
sys.exit(1 if failures else 0)
