#!/usr/bin/env python3
"""The chat-template oracle: duet-chat-template against jinja2 configured as transformers does.

For every template (tests/data/chat_templates/*.jinja) x conversation (conversations/*.json) x
add_generation_prompt (off, on), render with jinja2 the way transformers' apply_chat_template
does (an ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks, loop controls, a
{% generation %} block, tojson as json.dumps with ensure_ascii off, raise_exception and
strftime_now as globals; variables messages, tools, documents, add_generation_prompt, bos_token,
eos_token) and with duet-chat-template, and require the same bytes, or both to raise (and for
raise_exception the same message). strftime_now is pinned to one instant on both sides.

Usage: chat_template_oracle.py CLI DATA_DIR
Prints the number of cases and of each outcome; exits 1 on any mismatch.
"""
import datetime
import json
import os
import subprocess
import sys

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
    """('ok', bytes) | ('raised', message) | ('error', description)."""
    try:
        if isinstance(tmpl, Exception):
            raise tmpl
        out = tmpl.render(
            messages=conv["messages"],
            tools=conv.get("tools"),
            documents=None,
            add_generation_prompt=agp,
            bos_token=BOS,
            eos_token=EOS,
        )
        return "ok", out.encode("utf-8")
    except Raised as e:
        return "raised", str(e)
    except Exception as e:  # noqa: BLE001 - any jinja2 / Python error is "raises"
        return "error", f"{type(e).__name__}: {e}"


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
    templates = sorted(f for f in os.listdir(data) if f.endswith(".jinja"))
    conv_dir = os.path.join(data, "conversations")
    convs = sorted(f for f in os.listdir(conv_dir) if f.endswith(".json"))
    counts = {"equal": 0, "both raised (same message)": 0, "both raised an error": 0, "MISMATCH": 0}
    mismatches = []
    for t in templates:
        tpath = os.path.join(data, t)
        with open(tpath, encoding="utf-8") as f:
            src = f.read()
        try:
            tmpl = env.from_string(src)
        except Exception as e:  # noqa: BLE001 - a template jinja2 refuses: every case raises
            tmpl = e
        for c in convs:
            cpath = os.path.join(conv_dir, c)
            with open(cpath, encoding="utf-8") as f:
                conv = json.load(f)
            for agp in (False, True):
                py = python_render(tmpl, conv, agp)
                cc = c_render(cli, tpath, cpath, agp)
                case = f"{t} x {c} x add_generation_prompt={agp}"
                if py[0] == "ok" and cc[0] == "ok" and py[1] == cc[1]:
                    counts["equal"] += 1
                elif py[0] == "raised" and cc[0] == "raised" and cc[1] == py[1] + "\n":
                    counts["both raised (same message)"] += 1
                elif py[0] == "error" and cc[0] == "raised":
                    counts["both raised an error"] += 1
                    if verbose:
                        print(f"both raised: {case}\n  jinja2: {py[1][:200]}\n  duet:   {cc[1][:200]}")
                else:
                    counts["MISMATCH"] += 1
                    detail = f"  jinja2: {py[0]}"
                    if py[0] == "ok" and cc[0] == "ok":
                        i = first_diff(py[1], cc[1])
                        detail += (f"\n  first difference at byte {i}:\n  jinja2: {py[1][max(0, i - 40):i + 40]!r}"
                                   f"\n  duet:   {cc[1][max(0, i - 40):i + 40]!r}")
                    else:
                        detail += f" {py[1][:300]!r}\n  duet:   {cc[0]} {cc[1][:300]!r}"
                    mismatches.append(f"{case}\n{detail}")
    for m in mismatches:
        print("MISMATCH " + m)
    total = sum(counts.values())
    print(f"chat template oracle: {len(templates)} templates x {len(convs)} conversations x 2 = "
          f"{total} cases")
    for k, v in counts.items():
        print(f"  {k}: {v}")
    return 1 if counts["MISMATCH"] > 0 or total == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
