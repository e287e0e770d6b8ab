#!/usr/bin/env python3
"""The chat-template oracle: duet-chat-template against jinja2 configured as transformers does.

For every template (tests/data/chat_templates/*.jinja) x conversation (conversations/*.json) x
add_generation_prompt (off, on), render with jinja2 the way transformers' apply_chat_template
does (an ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks, loop controls, a
{% generation %} block, tojson as json.dumps with ensure_ascii off, raise_exception and
strftime_now as globals; variables messages, tools, documents, add_generation_prompt, bos_token,
eos_token, and a conversation's "documents" and "chat_template_kwargs" as apply_chat_template's
documents= and **kwargs, which win over the special tokens as there) and with duet-chat-template
(which reads the same keys of the conversation file), and require the same bytes, or both to
raise (and for raise_exception the same message). strftime_now is pinned to one instant on both
sides.

Then the same for every snippet of snippets.txt (small templates, separated by lines "=====",
that exercise one feature each: literals, operators, filters, tests, methods, loops, macros,
whitespace control, errors) over the tools_and_tool_calls conversation.

Usage: chat_template_oracle.py CLI DATA_DIR
Prints the number of cases and of each outcome; exits 1 on any mismatch.
"""
import datetime
import json
import os
import subprocess
import sys
import tempfile

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

NOW = "2025-03-07T09:05:03"  # a Friday; single-digit day and month catch %-d / %d differences
BOS = "<s>"
EOS = "</s>"


class Raised(jinja2.exceptions.TemplateError):
    """What the template's raise_exception(msg) raises (transformers raises TemplateError)."""


class Generation(jinja2.ext.Extension):
    """{% generation %}...{% endgeneration %}: renders its body, as transformers' tracker does
    when no assistant mask is asked for."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def make_env(now):
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def raise_exception(message):
        raise Raised(message)

    def strftime_now(fmt):
        return now.strftime(fmt)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def python_render(tmpl, conv, agp):
    """('ok', bytes) | ('raised', message) | ('error', description, refused at parse)."""
    if isinstance(tmpl, Exception):  # jinja2 refused the template: duet must refuse it too
        return "error", f"{type(tmpl).__name__}: {tmpl}", True
    # transformers: template_kwargs = {**special_tokens_map, **kwargs}, then
    # render(messages=..., tools=..., documents=..., add_generation_prompt=..., **template_kwargs)
    template_kwargs = {"bos_token": BOS, "eos_token": EOS, **conv.get("chat_template_kwargs", {})}
    try:
        out = tmpl.render(
            messages=conv["messages"],
            tools=conv.get("tools"),
            documents=conv.get("documents"),
            add_generation_prompt=agp,
            **template_kwargs,
        )
        return "ok", out.encode("utf-8")
    except Raised as e:
        return "raised", str(e)
    except Exception as e:  # noqa: BLE001 - any jinja2 / Python error is "raises"
        return "error", f"{type(e).__name__}: {e}", False


def c_render(cli, tmpl_path, conv_path, agp):
    cmd = [cli, "--template", tmpl_path, "--messages", conv_path, "--bos-token", BOS,
           "--eos-token", EOS, "--now", NOW]
    if agp:
        cmd.append("--add-generation-prompt")
    p = subprocess.run(cmd, capture_output=True, timeout=60)
    if p.returncode == 0:
        return "ok", p.stdout
    if p.returncode == 1:
        return "raised", p.stderr.decode("utf-8", "replace")
    return "fail", f"exit {p.returncode}: {p.stderr.decode('utf-8', 'replace')}"


def first_diff(a, b):
    i = 0
    while i < min(len(a), len(b)) and a[i] == b[i]:
        i += 1
    return i


def main():
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    cli, data = sys.argv[1], sys.argv[2]
    verbose = os.environ.get("ORACLE_VERBOSE") == "1"
    env = make_env(datetime.datetime.fromisoformat(NOW))
    counts = {"equal": 0, "both raised (same message)": 0, "both raised an error": 0, "MISMATCH": 0}
    mismatches = []

    def compare(case, py, cc):
        if py[0] == "ok" and cc[0] == "ok" and py[1] == cc[1]:
            counts["equal"] += 1
        elif py[0] == "raised" and cc[0] == "raised" and cc[1] == py[1] + "\n":
            counts["both raised (same message)"] += 1
        elif py[0] == "error" and (cc[0] == "raised" or (cc[0] == "fail" and py[2])):
            counts["both raised an error"] += 1
            if verbose:
                print(f"both raised: {case}\n  jinja2: {py[1][:200]}\n  duet:   {cc[1][:200]}")
        else:
            counts["MISMATCH"] += 1
            detail = f"  jinja2: {py[0]}"
            if py[0] == "ok" and cc[0] == "ok":
                i = first_diff(py[1], cc[1])
                detail += (f"\n  first difference at byte {i}:"
                           f"\n  jinja2: {py[1][max(0, i - 40):i + 40]!r}"
                           f"\n  duet:   {cc[1][max(0, i - 40):i + 40]!r}")
            else:
                detail += f" {py[1][:300]!r}\n  duet:   {cc[0]} {cc[1][:300]!r}"
            mismatches.append(f"{case}\n{detail}")

    def compile_or_error(src):
        try:
            return env.from_string(src)
        except Exception as e:  # noqa: BLE001 - a template jinja2 refuses: every case raises
            return e

    templates = sorted(f for f in os.listdir(data) if f.endswith(".jinja"))
    conv_dir = os.path.join(data, "conversations")
    convs = sorted(f for f in os.listdir(conv_dir) if f.endswith(".json"))
    for t in templates:
        tpath = os.path.join(data, t)
        with open(tpath, encoding="utf-8") as f:
            tmpl = compile_or_error(f.read())
        for c in convs:
            cpath = os.path.join(conv_dir, c)
            with open(cpath, encoding="utf-8") as f:
                conv = json.load(f)
            for agp in (False, True):
                compare(f"{t} x {c} x add_generation_prompt={agp}",
                        python_render(tmpl, conv, agp), c_render(cli, tpath, cpath, agp))
    n_cases = sum(counts.values())

    with open(os.path.join(data, "snippets.txt"), encoding="utf-8") as f:
        snippets = f.read().split("\n=====\n")
    cpath = os.path.join(conv_dir, "tools_and_tool_calls.json")
    with open(cpath, encoding="utf-8") as f:
        conv = json.load(f)
    with tempfile.TemporaryDirectory() as tmp:
        for k, snip in enumerate(snippets):
            tpath = os.path.join(tmp, f"snippet{k}.jinja")
            with open(tpath, "w", encoding="utf-8") as f:
                f.write(snip)
            compare(f"snippet {k}: {snip[:70]!r}", python_render(compile_or_error(snip), conv, True),
                    c_render(cli, tpath, cpath, True))

    for m in mismatches:
        print("MISMATCH " + m)
    total = sum(counts.values())
    print(f"chat template oracle: {len(templates)} templates x {len(convs)} conversations x 2 = "
          f"{n_cases} cases, and {len(snippets)} snippets: {total} cases compared")
    for k, v in counts.items():
        print(f"  {k}: {v}")
    return 1 if counts["MISMATCH"] > 0 or n_cases == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
