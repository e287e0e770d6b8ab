/*
 * duet-chat-template: render a chat template over a conversation exactly as duet-router does
 * (and as transformers' apply_chat_template does), to check a model folder's template, to see
 * what a model is prompted with, and as the C side of the jinja2 oracle test
 * (tests/python/chat_template_oracle.py).
 *
 *   duet-chat-template (--model DIR | --template FILE) --messages FILE.json [--tools FILE.json]
 *       [--var NAME=JSON ...] [--add-generation-prompt] [--bos-token S] [--eos-token S]
 *       [--now ISO8601] [--tokens]
 *
 * Prints the rendered prompt exactly (no newline added), or with --tokens its token ids (the
 * model folder's tokenizer; special tokens recognised only in the template's own text).
 * Exit status: 0 rendered; 1 the template raised (its message on stderr, alone on its line);
 * 2 bad usage or a bad input file (a message on stderr).
 */
#define _GNU_SOURCE /* timegm */
#include <ctype.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/json.h"
#include "common/strbuf.h"
#include "common/version.h"
#include "router/api/chat_template.h"

#define CT_MAX_FILE   ((size_t)64 << 20)
#define CT_MAX_VARS   64
#define CT_MAX_VARS_S "64"

static const char ct_usage[] =
    "usage: duet-chat-template (--model DIR | --template FILE) --messages FILE.json\n"
    "           [--tools FILE.json] [--var NAME=JSON ...] [--add-generation-prompt]\n"
    "           [--bos-token S] [--eos-token S] [--now YYYY-MM-DDTHH:MM:SS] [--tokens]\n"
    "\n"
    "Render a chat template over a conversation as duet-router (and transformers'\n"
    "apply_chat_template) renders it, and print the prompt exactly (no newline added).\n"
    "\n"
    "  --model DIR             the model folder's template (chat_template.json, "
    "chat_template.jinja\n"
    "                          or tokenizer_config.json's chat_template) and special tokens\n"
    "  --template FILE         a Jinja template file instead\n"
    "  --messages FILE         a JSON array of OpenAI messages, or an object with \"messages\"\n"
    "                          and optionally \"tools\", \"documents\" (arrays) and\n"
    "                          \"chat_template_kwargs\" (an object of more template variables)\n"
    "  --tools FILE            a JSON array of tools (the template's `tools`; default None)\n"
    "  --var NAME=JSON         one more template variable, e.g. --var enable_thinking=false or\n"
    "                          --var 'reasoning_effort=\"low\"' (repeatable; wins over the\n"
    "                          file's chat_template_kwargs and over the special tokens, as\n"
    "                          transformers' apply_chat_template(**kwargs) does)\n"
    "  --add-generation-prompt end with the start of the assistant's turn\n"
    "  --bos-token S, --eos-token S   the template's bos_token / eos_token (override the model's)\n"
    "  --now T                 the instant strftime_now() formats (default: the local time)\n"
    "  --tokens                print the prompt's token ids instead (needs --model)\n"
    "  --version               the version, git commit and CUDA build\n"
    "\n"
    "Exit status: 0 rendered, 1 the template raised an error (message on stderr),\n"
    "2 bad usage or input.\n";

static int ct_fail(int code, const char *fmt, const char *arg)
{
    fprintf(stderr, "duet-chat-template: ");
    fprintf(stderr, fmt, arg);
    fprintf(stderr, "\n");
    return code;
}

/* "YYYY-MM-DD[THH:MM[:SS]]" into a normalised broken-down time (weekday and yearday filled). */
static bool ct_parse_now(const char *s, struct tm *tm)
{
    int y, mo, d, h = 0, mi = 0, sec = 0, n = 0;
    memset(tm, 0, sizeof(*tm));
    if (sscanf(s, "%4d-%2d-%2d%n", &y, &mo, &d, &n) != 3)
        return false;
    const char *rest = s + n;
    if (*rest == 'T' || *rest == ' ') {
        int m = 0;
        if (sscanf(rest + 1, "%2d:%2d%n", &h, &mi, &m) != 2)
            return false;
        rest += 1 + m;
        if (*rest == ':') {
            if (sscanf(rest + 1, "%2d%n", &sec, &m) != 1)
                return false;
            rest += 1 + m;
        }
    }
    if (*rest != '\0' || mo < 1 || mo > 12 || d < 1 || d > 31 || h > 23 || mi > 59 || sec > 59)
        return false;
    tm->tm_year = y - 1900;
    tm->tm_mon = mo - 1;
    tm->tm_mday = d;
    tm->tm_hour = h;
    tm->tm_min = mi;
    tm->tm_sec = sec;
    time_t t = timegm(tm);
    struct tm norm;
    if (gmtime_r(&t, &norm) == NULL || norm.tm_mday != d)
        return false;
    *tm = norm;
    return true;
}

/* --var NAME=JSON into the object `vars` (NAME a Python identifier, JSON any one value). */
static bool ct_add_var(json_t *vars, const char *arg)
{
    const char *eq = strchr(arg, '=');
    size_t n = eq != NULL ? (size_t)(eq - arg) : 0;
    bool ident = n > 0 && !isdigit((unsigned char)arg[0]);
    for (size_t i = 0; ident && i < n; i++)
        ident = isalnum((unsigned char)arg[i]) || arg[i] == '_';
    if (!ident) {
        ct_fail(2, "--var %s: expected NAME=JSON with NAME a variable name", arg);
        return false;
    }
    /* The value alone inside [ ] so that the common loader takes any JSON value, and exactly
     * one: "1, 2" or "1] [2" are refused. */
    duet_strbuf_t sb;
    duet_strbuf_init(&sb);
    json_t *wrapped = NULL;
    duet_status_t st = duet_strbuf_printf(&sb, "[%s]", eq + 1);
    if (st == DUET_OK)
        st = duet_json_load_buffer(sb.data, sb.len, "--var", CT_MAX_FILE, &wrapped);
    duet_strbuf_free(&sb);
    bool ok = st == DUET_OK && json_array_size(wrapped) == 1;
    if (st != DUET_OK)
        ct_fail(2, "--var: %s", duet_error_last());
    else if (!ok)
        ct_fail(2, "--var %s: expected one JSON value", arg);
    char name[256];
    if (ok && n >= sizeof(name)) {
        ct_fail(2, "--var %s: the name is too long", arg);
        ok = false;
    }
    if (ok) {
        memcpy(name, arg, n);
        name[n] = '\0';
        ok = json_object_set(vars, name, json_array_get(wrapped, 0)) == 0;
        if (!ok)
            ct_fail(2, "%s", "--var: no memory");
    }
    json_decref(wrapped);
    return ok;
}

int main(int argc, char **argv)
{
    const char *model = NULL, *tmpl_file = NULL, *msgs_file = NULL, *tools_file = NULL;
    const char *bos = NULL, *eos = NULL, *now_s = NULL;
    bool gen = false, tokens = false;
    const char *var_args[CT_MAX_VARS];
    size_t n_var_args = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char **val = NULL;
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            fputs(ct_usage, stdout);
            return 0;
        } else if (duet_version_flag(a)) {
            duet_version_print("duet-chat-template");
            return 0;
        } else if (strcmp(a, "--add-generation-prompt") == 0) {
            gen = true;
            continue;
        } else if (strcmp(a, "--tokens") == 0) {
            tokens = true;
            continue;
        } else if (strcmp(a, "--model") == 0) {
            val = &model;
        } else if (strcmp(a, "--template") == 0) {
            val = &tmpl_file;
        } else if (strcmp(a, "--messages") == 0) {
            val = &msgs_file;
        } else if (strcmp(a, "--tools") == 0) {
            val = &tools_file;
        } else if (strcmp(a, "--var") == 0) {
            if (n_var_args == CT_MAX_VARS)
                return ct_fail(2, "more than %s --var options", CT_MAX_VARS_S);
            val = &var_args[n_var_args++];
        } else if (strcmp(a, "--bos-token") == 0) {
            val = &bos;
        } else if (strcmp(a, "--eos-token") == 0) {
            val = &eos;
        } else if (strcmp(a, "--now") == 0) {
            val = &now_s;
        } else {
            return ct_fail(2, "unknown option %s (see --help)", a);
        }
        if (i + 1 >= argc)
            return ct_fail(2, "%s needs a value (see --help)", a);
        *val = argv[++i];
    }
    if ((model == NULL) == (tmpl_file == NULL))
        return ct_fail(2, "%s", "give exactly one of --model DIR and --template FILE (see --help)");
    if (msgs_file == NULL)
        return ct_fail(2, "%s", "--messages FILE is required (see --help)");
    if (tokens && model == NULL)
        return ct_fail(2, "%s",
                       "--tokens needs a tokenizer: give --model DIR (a model folder) instead of "
                       "--template");
    struct tm now;
    if (now_s != NULL && !ct_parse_now(now_s, &now))
        return ct_fail(2, "--now %s: expected YYYY-MM-DDTHH:MM:SS", now_s);

    int rc = 2;
    json_t *msgs_root = NULL, *tools_root = NULL, *kwargs = NULL;
    duet_tokenizer_t *tok = NULL;
    duet_oai_template_t *tmpl = NULL;
    duet_strbuf_t text;
    duet_strbuf_init(&text);
    duet_jinja_output_t out;
    memset(&out, 0, sizeof(out));
    uint32_t *ids = NULL;
    size_t n_ids = 0;

    if (duet_json_load_file(msgs_file, CT_MAX_FILE, &msgs_root) != DUET_OK) {
        ct_fail(2, "%s", duet_error_last());
        goto out;
    }
    const json_t *messages = msgs_root, *tools = NULL, *documents = NULL, *file_kwargs = NULL;
    if (json_is_object(msgs_root)) {
        messages = json_object_get(msgs_root, "messages");
        tools = json_object_get(msgs_root, "tools");
        if (json_is_null(tools))
            tools = NULL;
        documents = json_object_get(msgs_root, "documents");
        if (json_is_null(documents))
            documents = NULL;
        file_kwargs = json_object_get(msgs_root, "chat_template_kwargs");
        if (json_is_null(file_kwargs))
            file_kwargs = NULL;
    }
    if (!json_is_array(messages)) {
        ct_fail(2, "%s: expected a JSON array of messages (or an object with \"messages\")",
                msgs_file);
        goto out;
    }
    if (tools != NULL && !json_is_array(tools)) {
        ct_fail(2, "%s: \"tools\" must be an array", msgs_file);
        goto out;
    }
    if (documents != NULL && !json_is_array(documents)) {
        ct_fail(2, "%s: \"documents\" must be an array", msgs_file);
        goto out;
    }
    if (file_kwargs != NULL && !json_is_object(file_kwargs)) {
        ct_fail(2, "%s: \"chat_template_kwargs\" must be an object", msgs_file);
        goto out;
    }
    if (file_kwargs != NULL || n_var_args > 0) {
        kwargs = json_object();
        if (kwargs == NULL ||
            (file_kwargs != NULL && json_object_update(kwargs, (json_t *)file_kwargs) != 0)) {
            ct_fail(2, "%s", "no memory");
            goto out;
        }
        for (size_t k = 0; k < n_var_args; k++)
            if (!ct_add_var(kwargs, var_args[k]))
                goto out;
    }
    if (tools_file != NULL) {
        if (duet_json_load_file(tools_file, CT_MAX_FILE, &tools_root) != DUET_OK) {
            ct_fail(2, "%s", duet_error_last());
            goto out;
        }
        if (!json_is_array(tools_root)) {
            ct_fail(2, "%s: expected a JSON array of tools", tools_file);
            goto out;
        }
        tools = tools_root;
    }

    if (model != NULL) {
        if (duet_tokenizer_load(model, &tok) != DUET_OK) {
            if (tokens) {
                ct_fail(2, "%s", duet_error_last());
                goto out;
            }
            tok = NULL; /* rendering needs no tokenizer when the template is Jinja */
        }
        if (duet_oai_template_load(model, tok, &tmpl) != DUET_OK) {
            ct_fail(2, "%s", duet_error_last());
            goto out;
        }
        if (!duet_oai_template_is_jinja(tmpl) && !tokens) {
            ct_fail(2,
                    "%s: the model's template is duet's own format, not Jinja; --tokens shows "
                    "what it makes",
                    model);
            goto out;
        }
    } else {
        if (duet_strbuf_read_file(&text, tmpl_file, CT_MAX_FILE) != DUET_OK) {
            ct_fail(2, "%s", duet_error_last());
            goto out;
        }
        if (duet_oai_template_create_jinja(text.data != NULL ? text.data : "", text.len, tmpl_file,
                                           NULL, NULL, &tmpl) != DUET_OK) {
            ct_fail(2, "%s", duet_error_last());
            goto out;
        }
    }
    if ((bos != NULL || eos != NULL) && !duet_oai_template_is_jinja(tmpl)) {
        ct_fail(2, "%s", "--bos-token / --eos-token apply to Jinja templates only");
        goto out;
    }
    if ((bos != NULL && duet_oai_template_set_token(tmpl, "bos_token", bos) != DUET_OK) ||
        (eos != NULL && duet_oai_template_set_token(tmpl, "eos_token", eos) != DUET_OK)) {
        ct_fail(2, "%s", duet_error_last());
        goto out;
    }

    duet_oai_chat_t chat = {.messages = messages,
                            .tools = tools,
                            .documents = documents,
                            .kwargs = kwargs,
                            .add_generation_prompt = gen,
                            .now = now_s != NULL ? &now : NULL};
    duet_status_t st;
    if (tokens && !duet_oai_template_is_jinja(tmpl)) {
        /* duet's own format: the messages as the router reads them (role and text content). */
        ct_fail(2, "%s",
                "--tokens with duet's own template format is not supported here; use "
                "duet-router");
        goto out;
    }
    st = tokens ? duet_oai_chat_prompt_json(tmpl, tok, &chat, &ids, &n_ids)
                : duet_oai_template_render(tmpl, &chat, &out);
    if (st != DUET_OK) {
        /* The template's own message (raise_exception) or the error where jinja2 raises. */
        fprintf(stderr, "%s\n", duet_error_last());
        rc = st == DUET_ERR_NOMEM ? 2 : 1;
        goto out;
    }
    if (tokens) {
        for (size_t i = 0; i < n_ids; i++)
            printf(i == 0 ? "%u" : " %u", ids[i]);
        printf("\n");
    } else if (out.text.len > 0 && fwrite(out.text.data, 1, out.text.len, stdout) != out.text.len) {
        ct_fail(2, "%s", "cannot write the output");
        goto out;
    }
    rc = fflush(stdout) == 0 ? 0 : 2;
out:
    free(ids);
    duet_jinja_output_free(&out);
    duet_oai_template_destroy(tmpl);
    duet_tokenizer_destroy(tok);
    duet_strbuf_free(&text);
    json_decref(msgs_root);
    json_decref(tools_root);
    json_decref(kwargs);
    return rc;
}
