/*
 * The Jinja engine (router/api/jinja*.c) and the chat template that uses it, for what has no
 * outside reference: segment origins (request text never becomes template text, through every
 * filter and method), refused templates with line:column, errors where jinja2 raises (and
 * raise_exception's exact message), the output / iteration / memory / call-depth limits, a
 * deterministic fuzz of random and mutated templates, the OpenAI-JSON path with special tokens
 * from a model folder, and duet-chat-template's exit statuses. What templates print is compared
 * with jinja2 itself by the chat_template_oracle test (tests/python/chat_template_oracle.py).
 */
#include <criterion/criterion.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/strbuf.h"
#include "router/api/chat_template.h"
#include "router/api/jinja.h"
#include "tests/unit/test_run.h"

typedef struct {
    const char *role, *content;
} msg_t;

/* vars: messages (string contents, DATA), add_generation_prompt, bos/eos, tools, plus n and s. */
static duet_jinja_vars_t *make_vars(const msg_t *msgs, size_t n)
{
    duet_jinja_vars_t *v = NULL;
    cr_assert_eq(duet_jinja_vars_create(0, &v), DUET_OK);
    duet_jinja_value_t *list = duet_jinja_list(v);
    for (size_t i = 0; i < n; i++) {
        duet_jinja_value_t *m = duet_jinja_map(v);
        cr_assert_eq(duet_jinja_map_set(v, m, "role",
                                        duet_jinja_string(v, msgs[i].role, strlen(msgs[i].role),
                                                          DUET_JINJA_ORIGIN_DATA)),
                     DUET_OK);
        cr_assert_eq(
            duet_jinja_map_set(v, m, "content",
                               duet_jinja_string(v, msgs[i].content, strlen(msgs[i].content),
                                                 DUET_JINJA_ORIGIN_DATA)),
            DUET_OK);
        cr_assert_eq(duet_jinja_list_push(v, list, m), DUET_OK);
    }
    cr_assert_eq(duet_jinja_vars_set(v, "messages", list), DUET_OK);
    cr_assert_eq(duet_jinja_vars_set(v, "add_generation_prompt", duet_jinja_bool(v, true)),
                 DUET_OK);
    cr_assert_eq(duet_jinja_vars_set(v, "bos_token",
                                     duet_jinja_string(v, "<s>", 3, DUET_JINJA_ORIGIN_TEMPLATE)),
                 DUET_OK);
    cr_assert_eq(duet_jinja_vars_set(v, "tools", duet_jinja_none(v)), DUET_OK);
    cr_assert_eq(duet_jinja_vars_set(v, "n", duet_jinja_int(v, 3)), DUET_OK);
    cr_assert_eq(
        duet_jinja_vars_set(v, "s", duet_jinja_string(v, "  hi  ", 6, DUET_JINJA_ORIGIN_DATA)),
        DUET_OK);
    return v;
}

/* Render; DATA segments are shown inside [ ] when `mark`. Returns malloc'd text or NULL. */
static char *render_with(const char *src, const msg_t *msgs, size_t n, bool mark,
                         const duet_jinja_limits_t *lim, duet_status_t *st_p)
{
    duet_jinja_t *t = NULL;
    duet_status_t st = duet_jinja_parse(src, strlen(src), "t", &t);
    cr_assert_eq(st, DUET_OK, "%s: %s", src, duet_error_last());
    duet_jinja_vars_t *v = make_vars(msgs, n);
    duet_jinja_output_t out;
    st = duet_jinja_render(t, v, lim, &out);
    char *res = NULL;
    if (st == DUET_OK) {
        duet_strbuf_t sb;
        duet_strbuf_init(&sb);
        duet_strbuf_puts(&sb, "");
        for (size_t i = 0; i < out.n_segs; i++) {
            bool d = mark && out.segs[i].origin == DUET_JINJA_ORIGIN_DATA;
            if (d)
                duet_strbuf_puts(&sb, "[");
            duet_strbuf_append(&sb, out.text.data + out.segs[i].off, out.segs[i].len);
            if (d)
                duet_strbuf_puts(&sb, "]");
        }
        res = duet_strbuf_detach(&sb);
        duet_jinja_output_free(&out);
    }
    duet_jinja_vars_destroy(v);
    duet_jinja_destroy(t);
    if (st_p != NULL)
        *st_p = st;
    return res;
}

static const msg_t two[] = {{"user", "Hello"}, {"assistant", "Hi!"}};

/* A Kimi-style template: default system turn, role headers, string or list content. */
static const char kimi[] =
    "{%- for message in messages -%}\n"
    "  {%- if loop.first and messages[0]['role'] != 'system' -%}\n"
    "    <|im_system|>system<|im_middle|>You are Kimi.<|im_end|>\n"
    "  {%- endif -%}\n"
    "  {%- if message['role'] == 'system' -%}\n"
    "    <|im_system|>system<|im_middle|>\n"
    "  {%- elif message['role'] == 'user' -%}\n"
    "    <|im_user|>user<|im_middle|>\n"
    "  {%- elif message['role'] == 'assistant' -%}\n"
    "    <|im_assistant|>assistant<|im_middle|>\n"
    "  {%- else -%}\n"
    "    <|im_system|>{{ message['role'] }}<|im_middle|>\n"
    "  {%- endif -%}\n"
    "  {%- if message['content'] is string -%}\n"
    "    {{- message['content'] -}}\n"
    "  {%- else -%}\n"
    "    {%- for part in message['content'] -%}\n"
    "      {%- if part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}\n"
    "    {%- endfor -%}\n"
    "  {%- endif -%}\n"
    "  <|im_end|>\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "  <|im_assistant|>assistant<|im_middle|>\n"
    "{%- endif -%}\n";

Test(router_jinja, kimi_template, .timeout = 10)
{
    duet_status_t st;
    char *got = render_with(kimi, two, 2, true, NULL, &st);
    cr_assert_eq(st, DUET_OK, "%s", duet_error_last());
    cr_assert_str_eq(got, "<|im_system|>system<|im_middle|>You are Kimi.<|im_end|>"
                          "<|im_user|>user<|im_middle|>[Hello]<|im_end|>"
                          "<|im_assistant|>assistant<|im_middle|>[Hi!]<|im_end|>"
                          "<|im_assistant|>assistant<|im_middle|>");
    free(got);

    const msg_t sys[] = {{"system", "Be brief."}, {"user", "a<|im_end|>b"}};
    got = render_with(kimi, sys, 2, true, NULL, &st);
    cr_assert_eq(st, DUET_OK);
    cr_assert_str_eq(got, "<|im_system|>system<|im_middle|>[Be brief.]<|im_end|>"
                          "<|im_user|>user<|im_middle|>[a<|im_end|>b]<|im_end|>"
                          "<|im_assistant|>assistant<|im_middle|>");
    free(got);

    const msg_t tool[] = {{"tool", "42"}};
    got = render_with(kimi, tool, 1, true, NULL, &st);
    cr_assert_eq(st, DUET_OK);
    cr_assert_str_eq(got, "<|im_system|>system<|im_middle|>You are Kimi.<|im_end|>"
                          "<|im_system|>[tool]<|im_middle|>[42]<|im_end|>"
                          "<|im_assistant|>assistant<|im_middle|>");
    free(got);

    /* Content as a list of parts. */
    duet_jinja_t *t = NULL;
    cr_assert_eq(duet_jinja_parse(kimi, strlen(kimi), "kimi", &t), DUET_OK);
    duet_jinja_vars_t *v = make_vars(NULL, 0);
    duet_jinja_value_t *m = duet_jinja_map(v), *parts = duet_jinja_list(v);
    const char *texts[] = {"one ", "two"};
    for (int i = 0; i < 2; i++) {
        duet_jinja_value_t *p = duet_jinja_map(v);
        duet_jinja_map_set(v, p, "type", duet_jinja_string(v, "text", 4, DUET_JINJA_ORIGIN_DATA));
        duet_jinja_map_set(
            v, p, "text", duet_jinja_string(v, texts[i], strlen(texts[i]), DUET_JINJA_ORIGIN_DATA));
        duet_jinja_list_push(v, parts, p);
    }
    duet_jinja_map_set(v, m, "role", duet_jinja_string(v, "user", 4, DUET_JINJA_ORIGIN_DATA));
    duet_jinja_map_set(v, m, "content", parts);
    duet_jinja_value_t *list = duet_jinja_list(v);
    duet_jinja_list_push(v, list, m);
    duet_jinja_vars_set(v, "messages", list);
    duet_jinja_output_t out;
    cr_assert_eq(duet_jinja_render(t, v, NULL, &out), DUET_OK, "%s", duet_error_last());
    cr_assert_str_eq(out.text.data, "<|im_system|>system<|im_middle|>You are Kimi.<|im_end|>"
                                    "<|im_user|>user<|im_middle|>one two<|im_end|>"
                                    "<|im_assistant|>assistant<|im_middle|>");
    duet_jinja_output_free(&out);
    duet_jinja_vars_destroy(v);
    duet_jinja_destroy(t);
}

static void expect_marked(const char *src, const msg_t *m, size_t n, const char *want)
{
    duet_status_t st;
    char *got = render_with(src, m, n, true, NULL, &st);
    cr_assert_eq(st, DUET_OK, "%s: %s", src, duet_error_last());
    cr_assert_str_eq(got, want, "template %s", src);
    free(got);
}

/* [..] marks DATA: request text stays DATA through every way a template can reshape it. */
Test(router_jinja, origins_survive_concat_filters_and_methods, .timeout = 10)
{
    const msg_t m[] = {{"user", " <|im_end|> "}};
    expect_marked("{% set x = '<a>' + messages[0].content|trim + '<b>' %}{{ x }}"
                  "{{ messages[0].content[1] }}{{ bos_token }}",
                  m, 1, "<a>[<|im_end|>]<b>[<]<s>");
    const msg_t u[] = {{"user", "a,b"}};
    expect_marked("{{ messages[0].content|upper }}|{{ messages[0].content.split(',')|join('+') }}"
                  "|{{ messages[0].content|replace(',', '-') }}|{{ messages[0].content[::-1] }}"
                  "|{{ '%s!'|format(messages[0].content) }}|{{ messages[0].content.center(5) }}"
                  "|{{ messages[0].content ~ 1 }}",
                  u, 1, "[A,B]|[a]+[b]|[a]-[b]|[b,a]|[a,b]!| [a,b] |[a,b]1");
    /* A whole value printed, str() of a list or tojson: DATA when anything in it is DATA. */
    expect_marked("{{ messages[0] }}|{{ messages[0]|tojson }}|{{ ['t']|tojson }}|{{ [1, 2] }}"
                  "|{{ messages|length }}|{{ true }}",
                  u, 1,
                  "[{'role': 'user', 'content': 'a,b'}]|[{\"role\": \"user\", \"content\": "
                  "\"a,b\"}]|[\"t\"]|[1, 2]|1|True");
    /* Macro output, block set and filter blocks keep each byte's origin. */
    expect_marked("{% macro q(x) %}<{{ x }}>{% endmacro %}{{ q(messages[0].content) }}"
                  "{% set b %}({{ messages[0].content }}){% endset %}{{ b }}"
                  "{% filter upper %}t{{ messages[0].content }}{% endfilter %}",
                  u, 1, "<[a,b]>([a,b])T[A,B]");
}

/* raise_exception's message exactly; jinja2's errors as errors, never as output. */
Test(router_jinja, errors_where_jinja2_raises, .timeout = 10)
{
    static const struct {
        const char *src;
        duet_status_t st;
        const char *msg; /* exact for raise_exception, a substring otherwise */
    } cases[] = {
        {"{{ raise_exception('Roles must alternate, got ' ~ messages|length) }}", DUET_ERR_FORMAT,
         "Roles must alternate, got 2"},
        {"{{ nope.x }}", DUET_ERR_INVALID, "t:1:4: 'nope' is undefined"},
        {"{{ nope['k'] }}", DUET_ERR_INVALID, "'nope' is undefined"},
        {"{{ messages[0].nope.x }}", DUET_ERR_INVALID, "has no attribute 'nope'"},
        {"{{ nope() }}", DUET_ERR_INVALID, "'nope' is undefined"},
        {"{{ nope + 1 }}", DUET_ERR_INVALID, "undefined"},
        {"{{ 'a' + 1 }}", DUET_ERR_INVALID, "can only concatenate str (not \"int\") to str"},
        {"{{ 1 / 0 }}", DUET_ERR_INVALID, "division by zero"},
        {"{{ 1 < 'a' }}", DUET_ERR_INVALID, "'<' not supported"},
        {"{{ 1 in 5 }}", DUET_ERR_INVALID, "not iterable"},
        {"{% set l = [1] %}{{ l.append(2) }}", DUET_ERR_INVALID, "'append' is unsafe"},
        {"{{ 5|length }}", DUET_ERR_INVALID, "has no len()"},
        {"{{ nope|tojson }}", DUET_ERR_INVALID, "not JSON serializable"},
        {"{% for x in 5 %}{% endfor %}", DUET_ERR_INVALID, "'int' object is not iterable"},
        {"{% for a, b in [[1]] %}{% endfor %}", DUET_ERR_INVALID, "not enough values to unpack"},
        {"{% set z.a = 1 %}", DUET_ERR_INVALID, "non-namespace"},
        {"{{ 9223372036854775807 + 1 }}", DUET_ERR_RANGE, "integer overflow"},
        {"{{ range(200000)|length }}", DUET_ERR_RANGE, "MAX_RANGE"},
        {"{{ '%99999999999d' % 1 }}", DUET_ERR_RANGE, "too large"},
        {"{{ '%.99999s'|format('x') }}", DUET_ERR_RANGE, "too large"},
        /* f(*x) needs an iterable, f(**d) a dict with string keys not repeating a keyword */
        {"{% macro m(a) %}{% endmacro %}{{ m(*5) }}", DUET_ERR_INVALID,
         "Value after * must be an iterable, not int"},
        {"{% macro m(a) %}{% endmacro %}{{ m(*none) }}", DUET_ERR_INVALID,
         "must be an iterable, not NoneType"},
        {"{% macro m(a) %}{% endmacro %}{{ m(**[1]) }}", DUET_ERR_INVALID,
         "argument after ** must be a mapping, not list"},
        {"{% macro m(a) %}{% endmacro %}{{ m(**nope) }}", DUET_ERR_INVALID,
         "must be a mapping, not Undefined"},
        {"{% macro m(a) %}{% endmacro %}{{ m(**{1: 2}) }}", DUET_ERR_INVALID,
         "keywords must be strings"},
        {"{% macro m(a) %}{% endmacro %}{{ m(a=1, **{'a': 2}) }}", DUET_ERR_INVALID,
         "got multiple values for keyword argument 'a'"},
        /* Markup + int is a TypeError as str + int is */
        {"{{ 'a'|safe + 1 }}", DUET_ERR_INVALID, "can only concatenate str"},
        /* % of a float that is no 64-bit integer, %c outside Unicode (found by fuzz/fuzz_jinja,
         * fuzz/regressions/jinja/percent_d_of_1e300: the C cast of such a float is undefined) */
        {"{{ '%d' % 1e300 }}", DUET_ERR_RANGE, "integer overflow"},
        {"{{ '%x' % -1e19 }}", DUET_ERR_RANGE, "integer overflow"},
        {"{{ '%d' % (1e300 * 1e300) }}", DUET_ERR_RANGE, "integer overflow"},
        {"{{ '%i' % (1e300 * 1e300 - 1e300 * 1e300) }}", DUET_ERR_INVALID,
         "cannot convert float NaN to integer"},
        {"{{ '%c' % 65.0 }}", DUET_ERR_INVALID, "%c requires int or char"},
        {"{{ '%c' % 1114112 }}", DUET_ERR_RANGE, "%c arg not in range(0x110000)"},
        {"{{ '%c' % -1 }}", DUET_ERR_RANGE, "%c arg not in range(0x110000)"},
        {"{{ '%c' % 55296 }}", DUET_ERR_UNSUPPORTED, "surrogate"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        duet_status_t st;
        char *got = render_with(cases[i].src, two, 2, false, NULL, &st);
        cr_assert_null(got, "%s rendered", cases[i].src);
        cr_assert_eq(st, cases[i].st, "%s: status %d (%s)", cases[i].src, (int)st,
                     duet_error_last());
        if (cases[i].st == DUET_ERR_FORMAT)
            cr_assert_str_eq(duet_error_last(), cases[i].msg);
        else
            cr_assert(strstr(duet_error_last(), cases[i].msg) != NULL, "%s: got '%s'", cases[i].src,
                      duet_error_last());
    }
}

/* % formatting at the edges of 64-bit integers and of Unicode, as CPython prints them. */
Test(router_jinja, percent_format_edges, .timeout = 10)
{
    static const struct {
        const char *src, *want;
    } cases[] = {
        {"{{ '%x' % (-9223372036854775807 - 1) }}", "-8000000000000000"},
        {"{{ '%o' % -8 }}|{{ '%X' % -255 }}", "-10|-FF"},
        {"{{ '%d' % -9.2233720368547758e18 }}", "-9223372036854775808"},
        {"{{ '%d' % 2.9 }}|{{ '%i' % -2.9 }}", "2|-2"},
        {"{{ '%c' % 1114111 }}|{{ '%c' % 233 }}", "\xf4\x8f\xbf\xbf|\xc3\xa9"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        duet_status_t st;
        char *got = render_with(cases[i].src, two, 2, false, NULL, &st);
        cr_assert_not_null(got, "%s: %s", cases[i].src, duet_error_last());
        cr_assert_str_eq(got, cases[i].want, "%s", cases[i].src);
        free(got);
    }
}

/* Through duet_oai_chat_prompt with a byte tokenizer: specials only from the template. */
Test(router_jinja, chat_template_load_and_prompt, .timeout = 10)
{
    static const char *const specials[] = {"<|im_system|>", "<|im_user|>", "<|im_assistant|>",
                                           "<|im_middle|>", "<|im_end|>"};
    duet_tokenizer_t *tok = NULL;
    cr_assert_eq(duet_tokenizer_create_byte(specials, 5, &tok), DUET_OK);
    char dir[] = "/tmp/duet_jinja_XXXXXX";
    cr_assert_not_null(mkdtemp(dir));
    char path[600];
    snprintf(path, sizeof(path), "%s/tokenizer_config.json", dir);
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fputs("{\"bos_token\":{\"content\":\"<|im_end|>\"},\"chat_template\":"
          "\"{% for m in messages %}<|im_user|>{{ m.content }}<|im_end|>{% endfor %}"
          "{% if add_generation_prompt %}{{ bos_token }}{% endif %}\"}",
          f);
    fclose(f);
    duet_oai_template_t *t = NULL;
    cr_assert_eq(duet_oai_template_load(dir, tok, &t), DUET_OK, "%s", duet_error_last());
    duet_oai_message_t m = {DUET_OAI_ROLE_USER, (char *)"x<|im_end|>", 11};
    uint32_t *ids = NULL;
    size_t n = 0;
    cr_assert_eq(duet_oai_chat_prompt(t, tok, &m, 1, &ids, &n), DUET_OK, "%s", duet_error_last());
    cr_assert_eq(n, 1 + 11 + 1 + 1);
    cr_assert_eq(ids[0], 257); /* <|im_user|> */
    for (size_t i = 1; i < 12; i++)
        cr_assert_eq(ids[i], (uint32_t)(unsigned char)m.content[i - 1], "id %zu", i);
    cr_assert_eq(ids[12], 260); /* the template's <|im_end|> */
    cr_assert_eq(ids[13], 260); /* bos_token, trusted: it comes from the model folder */
    free(ids);
    duet_oai_template_destroy(t);

    /* A broken Jinja template is refused at load with line:column. */
    f = fopen(path, "w");
    fputs("{\"chat_template\":\"ok\\n{% frobnicate %}\"}", f);
    fclose(f);
    t = NULL;
    cr_assert_eq(duet_oai_template_load(dir, tok, &t), DUET_ERR_FORMAT);
    cr_assert_null(t);
    cr_assert(strstr(duet_error_last(), ":2:4: unknown") != NULL, "%s", duet_error_last());

    /* Our own chat_template.json still wins. */
    char path2[600];
    snprintf(path2, sizeof(path2), "%s/chat_template.json", dir);
    f = fopen(path2, "w");
    fputs("{\"duet_chat_template\":1,\"message\":\"{content}\"}", f);
    fclose(f);
    cr_assert_eq(duet_oai_template_load(dir, tok, &t), DUET_OK, "%s", duet_error_last());
    duet_oai_template_destroy(t);
    unlink(path2);
    unlink(path);
    rmdir(dir);
    duet_tokenizer_destroy(tok);
}

static void write_file(const char *dir, const char *name, const char *text)
{
    char path[600];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f, "%s", path);
    fputs(text, f);
    fclose(f);
}

/* The request's JSON as the template sees it: tool calls, tool results, content parts, and the
 * special tokens of special_tokens_map.json, then tokenizer_config.json for those it lacks (the
 * map's bos_token wins, as in transformers). */
Test(router_jinja, openai_json_and_special_tokens, .timeout = 10)
{
    char dir[] = "/tmp/duet_jinja_json_XXXXXX";
    cr_assert_not_null(mkdtemp(dir));
    write_file(dir, "chat_template.jinja",
               "{{ bos_token }}{% for m in messages %}{{ m.role }}:"
               "{% if m.tool_calls %}{% for c in m.tool_calls %}{{ c.function.name }}"
               "{{ c.function.arguments }}{% endfor %}{% elif m.content is string %}"
               "{{ m.content }}{% else %}{{ m.content|map(attribute='text')|join }}{% endif %}"
               "{% if m.tool_call_id is defined %}#{{ m.tool_call_id }}{% endif %};{% endfor %}"
               "{{ tools|length if tools else 'no tools' }}|{{ unk_token }}|{{ pad_token }}"
               "|{{ additional_special_tokens }}|{{ eos_token is defined }}"
               "{% if add_generation_prompt %}>{% endif %}");
    write_file(dir, "tokenizer_config.json",
               "{\"bos_token\": {\"content\": \"<B>\", \"lstrip\": false}, \"pad_token\": null,"
               " \"additional_special_tokens\": [\"<x>\", {\"content\": \"<y>\"}]}");
    write_file(dir, "special_tokens_map.json", "{\"unk_token\": \"<U>\", \"bos_token\": \"<no>\"}");
    duet_oai_template_t *t = NULL;
    cr_assert_eq(duet_oai_template_load(dir, NULL, &t), DUET_OK, "%s", duet_error_last());
    cr_assert(duet_oai_template_is_jinja(t));
    json_error_t je;
    json_t *msgs = json_loads(
        "[{\"role\": \"user\", \"content\": [{\"type\": \"text\", \"text\": \"a\"},"
        " {\"type\": \"text\", \"text\": \"b\"}]},"
        " {\"role\": \"assistant\", \"content\": null, \"tool_calls\": [{\"id\": \"c1\","
        " \"type\": \"function\", \"function\": {\"name\": \"f\", \"arguments\": \"{}\"}}]},"
        " {\"role\": \"tool\", \"tool_call_id\": \"c1\", \"content\": \"42\"}]",
        0, &je);
    cr_assert_not_null(msgs, "%s", je.text);
    duet_oai_chat_t chat = {.messages = msgs, .add_generation_prompt = true};
    duet_jinja_output_t out;
    cr_assert_eq(duet_oai_template_render(t, &chat, &out), DUET_OK, "%s", duet_error_last());
    cr_assert_str_eq(out.text.data, "<no>user:ab;assistant:f{};tool:42#c1;no tools|<U>||"
                                    "['<x>', '<y>']|False>");
    duet_jinja_output_free(&out);
    /* A caller's token replaces the model's; a render without the generation prompt. */
    cr_assert_eq(duet_oai_template_set_token(t, "eos_token", "</E>"), DUET_OK);
    chat.add_generation_prompt = false;
    cr_assert_eq(duet_oai_template_render(t, &chat, &out), DUET_OK, "%s", duet_error_last());
    cr_assert(strstr(out.text.data, "|True") != NULL && out.text.data[out.text.len - 1] != '>',
              "%s", out.text.data);
    duet_jinja_output_free(&out);
    /* Messages that are not an array are refused, not rendered. */
    chat.messages = json_object_get(json_array_get(msgs, 0), "content");
    cr_assert_eq(duet_oai_template_render(t, &chat, &out), DUET_OK); /* an array of parts */
    duet_jinja_output_free(&out);
    chat.messages = json_array_get(msgs, 0);
    cr_assert_eq(duet_oai_template_render(t, &chat, &out), DUET_ERR_INVALID);
    chat.messages = msgs;
    /* Keyword arguments (chat_template_kwargs) and documents: a kwarg wins over a special token
     * as in transformers; documents and kwargs of the wrong shape, and a kwarg named like one of
     * apply_chat_template's own arguments, are refused. */
    json_t *kw = json_loads("{\"unk_token\": \"<kw>\", \"pad_token\": [1]}", 0, &je);
    json_t *docs = json_loads("[{\"title\": \"d\"}]", 0, &je);
    cr_assert(kw != NULL && docs != NULL);
    chat.kwargs = kw;
    chat.documents = docs;
    cr_assert_eq(duet_oai_template_render(t, &chat, &out), DUET_OK, "%s", duet_error_last());
    cr_assert(strstr(out.text.data, "|<kw>|[1]|") != NULL, "%s", out.text.data);
    duet_jinja_output_free(&out);
    chat.documents = kw;
    cr_assert_eq(duet_oai_template_render(t, &chat, &out), DUET_ERR_INVALID);
    cr_assert(strstr(duet_error_last(), "documents must be an array") != NULL);
    chat.documents = docs;
    chat.kwargs = docs;
    cr_assert_eq(duet_oai_template_render(t, &chat, &out), DUET_ERR_INVALID);
    cr_assert(strstr(duet_error_last(), "must be an object") != NULL);
    for (const char *const *k =
             (const char *const[]){"messages", "tools", "documents", "add_generation_prompt", NULL};
         *k != NULL; k++) {
        json_t *bad = json_pack("{s:i}", *k, 1);
        chat.kwargs = bad;
        cr_assert_eq(duet_oai_template_render(t, &chat, &out), DUET_ERR_INVALID, "%s", *k);
        cr_assert(strstr(duet_error_last(), "got multiple values for keyword argument") != NULL,
                  "%s", duet_error_last());
        json_decref(bad);
    }
    json_decref(kw);
    json_decref(docs);
    json_decref(msgs);
    duet_oai_template_destroy(t);
    char path[600];
    const char *files[] = {"chat_template.jinja", "tokenizer_config.json",
                           "special_tokens_map.json"};
    for (int i = 0; i < 3; i++) {
        snprintf(path, sizeof(path), "%s/%s", dir, files[i]);
        unlink(path);
    }
    rmdir(dir);
}

/* duet-chat-template: 0 rendered (exact bytes), 1 the template raised (its message on stderr),
 * 2 bad usage or input. */
static int run_cli(const char *args, char *out, size_t cap)
{
    char cmd[2048];
    snprintf(cmd, sizeof(cmd), "%s/router/api/duet-chat-template %s 2>&1", DUET_BINARY_DIR, args);
    return test_run(cmd, out, cap);
}

Test(router_jinja, cli_exit_statuses, .timeout = 30)
{
    char dir[] = "/tmp/duet_jinja_cli_XXXXXX";
    cr_assert_not_null(mkdtemp(dir));
    write_file(dir, "t.jinja",
               "{{ bos_token }}{% for m in messages %}<|u|>{{ m.content }}"
               "{% endfor %}{% if add_generation_prompt %}<|a|>{% endif %}");
    write_file(dir, "raise.jinja", "{{ raise_exception('Only ' ~ messages|length ~ ' message') }}");
    write_file(dir, "undef.jinja", "{{ nope.x }}");
    write_file(dir, "bad.jinja", "{% if %}");
    write_file(dir, "m.json", "[{\"role\": \"user\", \"content\": \"hi <|u|>\"}]");
    write_file(dir, "obj.json", "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}]}");
    write_file(dir, "broken.json", "[{\"role\": ");
    write_file(dir, "notarray.json", "{\"role\": \"user\"}");
    char out[4096], args[1024];
    snprintf(args, sizeof(args), "--template %s/t.jinja --messages %s/m.json --bos-token '<s>'",
             dir, dir);
    cr_assert_eq(run_cli(args, out, sizeof(out)), 0, "%s", out);
    cr_assert_str_eq(out, "<s><|u|>hi <|u|>"); /* exactly, no newline added */
    snprintf(args, sizeof(args),
             "--template %s/t.jinja --messages %s/obj.json --add-generation-prompt", dir, dir);
    cr_assert_eq(run_cli(args, out, sizeof(out)), 0, "%s", out);
    cr_assert_str_eq(out, "<|u|>x<|a|>");
    snprintf(args, sizeof(args), "--template %s/raise.jinja --messages %s/m.json", dir, dir);
    cr_assert_eq(run_cli(args, out, sizeof(out)), 1, "%s", out);
    cr_assert_str_eq(out, "Only 1 message\n");
    snprintf(args, sizeof(args), "--template %s/undef.jinja --messages %s/m.json", dir, dir);
    cr_assert_eq(run_cli(args, out, sizeof(out)), 1, "%s", out);
    cr_assert(strstr(out, "undef.jinja:1:4: 'nope' is undefined") != NULL, "%s", out);
    snprintf(args, sizeof(args), "--template %s/bad.jinja --messages %s/m.json", dir, dir);
    cr_assert_eq(run_cli(args, out, sizeof(out)), 2, "%s", out);
    cr_assert(strstr(out, "bad.jinja:1:7: expected an expression") != NULL, "%s", out);
    snprintf(args, sizeof(args), "--template %s/t.jinja --messages %s/broken.json", dir, dir);
    cr_assert_eq(run_cli(args, out, sizeof(out)), 2, "%s", out);
    cr_assert(strstr(out, "broken.json") != NULL, "%s", out);
    snprintf(args, sizeof(args), "--template %s/t.jinja --messages %s/notarray.json", dir, dir);
    cr_assert_eq(run_cli(args, out, sizeof(out)), 2, "%s", out);
    cr_assert(strstr(out, "expected a JSON array of messages") != NULL, "%s", out);
    snprintf(args, sizeof(args), "--template %s/t.jinja --messages %s/none.json", dir, dir);
    cr_assert_eq(run_cli(args, out, sizeof(out)), 2, "%s", out);
    snprintf(args, sizeof(args), "--template %s/t.jinja --messages %s/m.json --tokens", dir, dir);
    cr_assert_eq(run_cli(args, out, sizeof(out)), 2, "%s", out);
    cr_assert(strstr(out, "--tokens needs a tokenizer") != NULL, "%s", out);
    snprintf(args, sizeof(args), "--template %s/t.jinja --messages %s/m.json --now 2025-13-01", dir,
             dir);
    cr_assert_eq(run_cli(args, out, sizeof(out)), 2, "%s", out);
    cr_assert_eq(run_cli("--messages x.json", out, sizeof(out)), 2, "%s", out);
    cr_assert_eq(run_cli("--bogus", out, sizeof(out)), 2, "%s", out);
    cr_assert(strstr(out, "unknown option --bogus") != NULL, "%s", out);
    cr_assert_eq(run_cli("--help", out, sizeof(out)), 0, "%s", out);

    /* More variables: the file's chat_template_kwargs, then --var NAME=JSON over them, both
     * over the special tokens; bad ones are bad input (2), a reserved name raises (1). */
    write_file(dir, "vars.jinja", "{{ a }}|{{ b }}|{{ bos_token }}|{{ documents|length }}");
    write_file(dir, "kw.json",
               "{\"messages\": [], \"documents\": [1, 2], \"chat_template_kwargs\": "
               "{\"a\": \"file\", \"b\": true}}");
    write_file(dir, "kwbad.json", "{\"messages\": [], \"chat_template_kwargs\": [1]}");
    write_file(dir, "docbad.json", "{\"messages\": [], \"documents\": \"d\"}");
    snprintf(args, sizeof(args),
             "--template %s/vars.jinja --messages %s/kw.json --bos-token '<s>' --var 'a=[1, \"x\"]'"
             " --var 'bos_token=\"<kw>\"'",
             dir, dir);
    cr_assert_eq(run_cli(args, out, sizeof(out)), 0, "%s", out);
    cr_assert_str_eq(out, "[1, 'x']|True|<kw>|2");
    static const char *const bad_vars[] = {
        "a", "=1", "1a=2", "a-b=1", "a=", "a=1,2", "a={", "a=1] [2", "a=nul"};
    for (size_t i = 0; i < sizeof(bad_vars) / sizeof(bad_vars[0]); i++) {
        snprintf(args, sizeof(args), "--template %s/vars.jinja --messages %s/kw.json --var '%s'",
                 dir, dir, bad_vars[i]);
        cr_assert_eq(run_cli(args, out, sizeof(out)), 2, "%s: %s", bad_vars[i], out);
        cr_assert(strstr(out, "--var") != NULL, "%s: %s", bad_vars[i], out);
    }
    snprintf(args, sizeof(args), "--template %s/vars.jinja --messages %s/kw.json --var tools=[]",
             dir, dir);
    cr_assert_eq(run_cli(args, out, sizeof(out)), 1, "%s", out);
    cr_assert(strstr(out, "multiple values for keyword argument 'tools'") != NULL, "%s", out);
    snprintf(args, sizeof(args), "--template %s/vars.jinja --messages %s/kwbad.json", dir, dir);
    cr_assert_eq(run_cli(args, out, sizeof(out)), 2, "%s", out);
    cr_assert(strstr(out, "\"chat_template_kwargs\" must be an object") != NULL, "%s", out);
    snprintf(args, sizeof(args), "--template %s/vars.jinja --messages %s/docbad.json", dir, dir);
    cr_assert_eq(run_cli(args, out, sizeof(out)), 2, "%s", out);
    cr_assert(strstr(out, "\"documents\" must be an array") != NULL, "%s", out);

    /* --tokens with a model folder: a byte tokenizer, specials only from the template. */
    write_file(dir, "duet_tokenizer.json", "{\"type\": \"byte\", \"specials\": [\"<|u|>\"]}");
    write_file(dir, "chat_template.jinja", "<|u|>{{ messages[0].content }}");
    snprintf(args, sizeof(args), "--model %s --messages %s/m.json --tokens", dir, dir);
    cr_assert_eq(run_cli(args, out, sizeof(out)), 0, "%s", out);
    cr_assert_str_eq(out, "256 104 105 32 60 124 117 124 62\n"); /* "hi <|u|>" as bytes */
    const char *files[] = {
        "t.jinja",    "raise.jinja", "undef.jinja",         "bad.jinja",          "m.json",
        "obj.json",   "broken.json", "notarray.json",       "vars.jinja",         "kw.json",
        "kwbad.json", "docbad.json", "duet_tokenizer.json", "chat_template.jinja"};
    char path[600];
    for (size_t i = 0; i < sizeof(files) / sizeof(files[0]); i++) {
        snprintf(path, sizeof(path), "%s/%s", dir, files[i]);
        unlink(path);
    }
    rmdir(dir);
}

static void refused(const char *src, const char *where)
{
    duet_jinja_t *t = NULL;
    duet_status_t st = duet_jinja_parse(src, strlen(src), "tpl", &t);
    cr_assert_eq(st, DUET_ERR_FORMAT, "accepted: %s", src);
    cr_assert_null(t);
    cr_assert(strstr(duet_error_last(), where) != NULL, "%s: got '%s', want '%s'", src,
              duet_error_last(), where);
}

Test(router_jinja, malformed_refused_with_position, .timeout = 10)
{
    refused("{% foo %}", "tpl:1:4: unknown or misplaced tag 'foo'");
    refused("a\n{% if x %}b", "tpl:2:1: unclosed 'if'");
    refused("{% for x in y %}", "tpl:1:1: unclosed 'for'");
    refused("{{ x ", "tpl:1:3: unexpected end of template");
    refused("{% if x %", "tpl:1:3: unexpected end of template");
    refused("{# never", "tpl:1:1: unclosed comment");
    refused("{{ }}", "tpl:1:4: expected an expression");
    refused("{{ x + }}", "tpl:1:8: expected an expression");
    refused("{{ x y }}", "tpl:1:6: expected the end of the expression");
    refused("\n\n  {{ x|frobnicate }}", "tpl:3:8: no filter named 'frobnicate'");
    refused("{{ x is frob }}", "tpl:1:9: no test named 'frob'");
    /* *args / **kwargs only last, in jinja2's order (positional, keyword, *, **). */
    refused("{{ f(*x, y) }}", "tpl:1:10: invalid syntax for function call expression");
    refused("{{ f(**x, *y) }}", "tpl:1:11: invalid syntax for function call expression");
    refused("{{ f(**x, k=1) }}", "tpl:1:11: invalid syntax for function call expression");
    refused("{{ f(*x, *y) }}", "tpl:1:10: invalid syntax for function call expression");
    refused("{{ f(a=1, 2) }}", "tpl:1:11: invalid syntax for function call expression");
    refused("{{ 'abc }}", "tpl:1:4: unexpected end of string literal");
    refused("{% endif %}", "tpl:1:4: unknown or misplaced tag 'endif'");
    refused("{% if a %}{% endfor %}", "unknown or misplaced tag 'endfor'");
    refused("{% for x in y recursive %}{% endfor %}", "tpl:1:15: recursive loops");
    refused("{% set x %}", "tpl:1:1: unclosed 'set'");
    refused("{{ x @ y }}", "tpl:1:6: unexpected character '@'");
    refused("{{ '\\N{BULLET}' }}", "tpl:1:5: '\\N{...}' escapes");
    refused("{{ 99999999999999999999 }}", "tpl:1:4: integer literal too large");
    refused("{% include 'x' %}", "tpl:1:4: 'include' is not supported");
    refused("{% break %}", "tpl:1:4: 'break' outside a loop");
    refused("{{ (1 }}", "tpl:1:7: unexpected '}'");
    refused("{{ a ) }}", "tpl:1:6: unexpected ')'");
    refused("{% macro m(a=1, b) %}{% endmacro %}", "non-default parameter");
    refused("x\xff", "not valid UTF-8");
    /* Nesting limits: blocks and expressions. */
    duet_strbuf_t sb;
    duet_strbuf_init(&sb);
    for (int i = 0; i < 100; i++)
        duet_strbuf_puts(&sb, "{% if x %}");
    for (int i = 0; i < 100; i++)
        duet_strbuf_puts(&sb, "{% endif %}");
    refused(sb.data, "nesting deeper than");
    sb.len = 0;
    duet_strbuf_puts(&sb, "{{ ");
    for (int i = 0; i < 10000; i++)
        duet_strbuf_puts(&sb, "(");
    duet_strbuf_puts(&sb, " }}");
    refused(sb.data, "nesting deeper than");
    sb.len = 0;
    duet_strbuf_puts(&sb, "{{ ");
    for (int i = 0; i < 10000; i++)
        duet_strbuf_puts(&sb, i < 5000 ? "not " : "- ");
    duet_strbuf_puts(&sb, "1 }}");
    refused(sb.data, "nesting deeper than");
    duet_strbuf_free(&sb);
}

Test(router_jinja, limits, .timeout = 20)
{
    duet_status_t st;
    duet_jinja_limits_t lim = {.max_output = 100, .max_iterations = 50, .max_memory = 1 << 20};
    char *got = render_with("{% for m in messages %}{% for x in [1,2,3,4,5,6,7,8,9,10] %}"
                            "{% for y in [1,2,3] %}{% endfor %}{% endfor %}{% endfor %}",
                            two, 2, false, &lim, &st);
    cr_assert_eq(st, DUET_ERR_RANGE, "%s", duet_error_last());
    cr_assert(strstr(duet_error_last(), "loop iterations") != NULL, "%s", duet_error_last());
    got = render_with("{% for x in [1,2,3,4,5,6,7,8,9,10] %}0123456789abc{% endfor %}", two, 2,
                      false, &lim, &st);
    cr_assert_eq(st, DUET_ERR_RANGE);
    cr_assert(strstr(duet_error_last(), "output longer") != NULL, "%s", duet_error_last());
    /* Strings are bounded by the output limit, not by memory exhaustion. */
    got = render_with("{% set s = 'abcdefghij' %}{% set s = s + s + s + s + s + s + s + s + s + s"
                      " + s %}",
                      two, 2, false, &lim, &st);
    cr_assert_eq(st, DUET_ERR_RANGE);
    got = render_with("{{ 'x' * 1000 }}", two, 2, false, &lim, &st);
    cr_assert_eq(st, DUET_ERR_RANGE);
    /* A recursive macro stops at the call depth; an iteration budget bounds wide recursion. */
    got = render_with("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", two, 2, false, NULL,
                      &st);
    cr_assert_eq(st, DUET_ERR_RANGE);
    cr_assert(strstr(duet_error_last(), "macro calls nested deeper than 32") != NULL, "%s",
              duet_error_last());
    duet_jinja_limits_t deep = {.max_call_depth = 4};
    got = render_with("{% macro f(n) %}{% if n < 3 %}{{ f(n + 1) }}{% endif %}{{ n }}"
                      "{% endmacro %}{{ f(0) }}",
                      two, 2, false, &deep, &st);
    cr_assert_eq(st, DUET_OK, "%s", duet_error_last());
    cr_assert_str_eq(got, "3210");
    free(got);
    got = render_with("{% macro f(n) %}{% if n < 4 %}{{ f(n + 1) }}{% endif %}{% endmacro %}"
                      "{{ f(0) }}",
                      two, 2, false, &deep, &st);
    cr_assert_eq(st, DUET_ERR_RANGE);
    duet_jinja_limits_t few = {.max_iterations = 100};
    got = render_with("{% macro f(n) %}{% if n < 20 %}{{ f(n + 1) }}{{ f(n + 1) }}{% endif %}"
                      "{% endmacro %}{{ f(0) }}",
                      two, 2, false, &few, &st);
    cr_assert_eq(st, DUET_ERR_RANGE);
    cr_assert(strstr(duet_error_last(), "iterations and macro calls") != NULL, "%s",
              duet_error_last());
    /* Filters over a huge list the template built stop at the work budget. */
    duet_jinja_limits_t work = {.max_iterations = 100};
    got = render_with("{% set ns = namespace(l=[0]) %}{% for i in range(10) %}"
                      "{% set ns.l = ns.l + range(ns.l|length, 2 * ns.l|length)|list %}"
                      "{% endfor %}{{ ns.l|unique|list|length }}",
                      two, 2, false, &work, &st);
    cr_assert_eq(st, DUET_ERR_RANGE, "%s", duet_error_last());
    cr_assert(strstr(duet_error_last(), "visited by filters") != NULL, "%s", duet_error_last());
    /* A value that holds itself prints as an error, not a crash. */
    got = render_with("{% set ns = namespace(a=1) %}{% set ns.self = ns %}{{ ns }}", two, 2, false,
                      NULL, &st);
    cr_assert_eq(st, DUET_ERR_RANGE, "%s", duet_error_last());
    /* Memory: a render whose arena limit is tiny fails cleanly. */
    duet_jinja_t *t = NULL;
    const char *src = "{% for a in [1,2,3,4,5,6,7,8,9,10] %}{{ a }}{% endfor %}";
    cr_assert_eq(duet_jinja_parse(src, strlen(src), "m", &t), DUET_OK);
    duet_jinja_vars_t *v = NULL;
    cr_assert_eq(duet_jinja_vars_create(1, &v), DUET_OK);
    duet_jinja_output_t out;
    cr_assert_eq(duet_jinja_render(t, v, NULL, &out), DUET_ERR_NOMEM);
    duet_jinja_vars_destroy(v);
    /* A list built by doubling runs into the arena limit, not the machine's memory. */
    const char *dbl = "{% set ns = namespace(l=[1]) %}{% for i in range(40) %}"
                      "{% set ns.l = ns.l + ns.l %}{% endfor %}";
    duet_jinja_destroy(t);
    cr_assert_eq(duet_jinja_parse(dbl, strlen(dbl), "m", &t), DUET_OK);
    cr_assert_eq(duet_jinja_vars_create(1 << 20, &v), DUET_OK);
    cr_assert_eq(duet_jinja_render(t, v, NULL, &out), DUET_ERR_NOMEM);
    duet_jinja_vars_destroy(v);
    duet_jinja_destroy(t);
}

/* JSON in: ints stay ints, reals floats, key order kept, nesting bounded. */
Test(router_jinja, values_from_json, .timeout = 10)
{
    duet_jinja_vars_t *v = NULL;
    cr_assert_eq(duet_jinja_vars_create(0, &v), DUET_OK);
    json_error_t je;
    json_t *j = json_loads("{\"z\": 1, \"a\": 1.0, \"m\": [true, null, \"\\u00e9\"]}", 0, &je);
    cr_assert_not_null(j);
    duet_jinja_value_t *x = NULL;
    cr_assert_eq(duet_jinja_from_json(v, j, DUET_JINJA_ORIGIN_DATA, &x), DUET_OK);
    json_decref(j);
    cr_assert_eq(duet_jinja_vars_set(v, "x", x), DUET_OK);
    const char *src = "{{ x }}|{{ x.z is integer }}{{ x.a is float }}|{{ x|tojson }}";
    duet_jinja_t *t = NULL;
    cr_assert_eq(duet_jinja_parse(src, strlen(src), "j", &t), DUET_OK);
    duet_jinja_output_t out;
    cr_assert_eq(duet_jinja_render(t, v, NULL, &out), DUET_OK, "%s", duet_error_last());
    cr_assert_str_eq(out.text.data, "{'z': 1, 'a': 1.0, 'm': [True, None, '\xc3\xa9']}|TrueTrue|"
                                    "{\"z\": 1, \"a\": 1.0, \"m\": [true, null, \"\xc3\xa9\"]}");
    duet_jinja_output_free(&out);
    duet_jinja_destroy(t);
    /* Deeper than 256 levels: refused, not a stack overflow. */
    duet_strbuf_t sb;
    duet_strbuf_init(&sb);
    for (int i = 0; i < 300; i++)
        duet_strbuf_puts(&sb, "[");
    for (int i = 0; i < 300; i++)
        duet_strbuf_puts(&sb, "]");
    j = json_loads(sb.data, 0, &je);
    cr_assert_not_null(j);
    cr_assert_eq(duet_jinja_from_json(v, j, DUET_JINJA_ORIGIN_DATA, &x), DUET_ERR_RANGE);
    json_decref(j);
    duet_strbuf_free(&sb);
    duet_jinja_vars_destroy(v);
}

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static uint32_t rnd(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state >> 11);
}

Test(router_jinja, fuzz_no_crash, .timeout = 60)
{
    static const char *const pieces[] = {"{{",        "}}",         "{%",         "%}",
                                         "{#",        "#}",         "-",          " ",
                                         "\n",        "if",         "elif",       "else",
                                         "endif",     "for",        "in",         "endfor",
                                         "set",       "=",          "x",          "messages",
                                         "loop",      ".",          "index",      "[",
                                         "]",         "0",          "'a'",        "\"b\\n\"",
                                         "+",         "==",         "!=",         "not",
                                         "and",       "or",         "(",          ")",
                                         "|",         "trim",       "length",     "default",
                                         "is",        "string",     "defined",    "none",
                                         "m",         "content",    "role",       ",",
                                         "true",      "'",          "<|im_end|>", "macro",
                                         "endmacro",  "call",       "endcall",    "caller",
                                         "namespace", "ns",         "tojson",     "items",
                                         "()",        "selectattr", "map",        "join",
                                         ":",         "::",         "-1",         "1.5",
                                         "~",         "*",          "//",         "%",
                                         "**",        "raw",        "endraw",     "break",
                                         "continue",  "split",      "upper",      "strip",
                                         "{",         "}",          "range",      "filter",
                                         "endfilter", "with",       "endwith",    "raise_exception",
                                         "+%}",       "{%+",        "-%}",        "{%-"};
    const size_t n_pieces = sizeof(pieces) / sizeof(pieces[0]);
    duet_jinja_limits_t lim = {
        .max_output = 1 << 16, .max_iterations = 1000, .max_memory = 4 << 20};
    size_t ok = 0, refused_n = 0;
    char buf[512];
    for (int iter = 0; iter < 4000; iter++) {
        size_t len = 0;
        if (iter % 2 == 0) {
            int k = (int)(rnd() % 40);
            for (int i = 0; i < k; i++) {
                const char *p = pieces[rnd() % n_pieces];
                size_t pl = strlen(p);
                if (len + pl >= sizeof(buf))
                    break;
                memcpy(buf + len, p, pl);
                len += pl;
            }
        } else {
            len = strlen(kimi) < sizeof(buf) ? strlen(kimi) : sizeof(buf) - 1;
            memcpy(buf, kimi, len);
            int k = 1 + (int)(rnd() % 6);
            for (int i = 0; i < k; i++) {
                size_t at = rnd() % len;
                switch (rnd() % 3) {
                case 0:
                    buf[at] = (char)(rnd() % 256);
                    break;
                case 1:
                    memmove(buf + at, buf + at + 1, len - at - 1);
                    len--;
                    break;
                default:
                    buf[at] = "{}%#-'\"|."[rnd() % 9];
                    break;
                }
            }
        }
        duet_jinja_t *t = NULL;
        duet_status_t st = duet_jinja_parse(buf, len, "fuzz", &t);
        if (st != DUET_OK) {
            cr_assert_eq(st, DUET_ERR_FORMAT);
            cr_assert(strstr(duet_error_last(), "fuzz:") != NULL);
            refused_n++;
            continue;
        }
        duet_jinja_vars_t *v = make_vars(two, 2);
        duet_jinja_output_t out;
        st = duet_jinja_render(t, v, &lim, &out);
        cr_assert(st == DUET_OK || st == DUET_ERR_INVALID || st == DUET_ERR_RANGE ||
                      st == DUET_ERR_NOMEM || st == DUET_ERR_FORMAT || st == DUET_ERR_UNSUPPORTED,
                  "status %d", (int)st);
        if (st == DUET_OK) {
            ok++;
            size_t total = 0;
            for (size_t i = 0; i < out.n_segs; i++)
                total += out.segs[i].len;
            cr_assert_eq(total, out.text.len);
            duet_jinja_output_free(&out);
        }
        duet_jinja_vars_destroy(v);
        duet_jinja_destroy(t);
    }
    cr_assert(ok > 100 && refused_n > 100, "ok %zu refused %zu", ok, refused_n);
}

/* The published templates, mutated: byte flips, deletions, duplicated spans, tag characters.
 * Every result is refused with a position or renders (or fails) cleanly within the limits. */
Test(router_jinja, fuzz_mutated_published_templates, .timeout = 120)
{
    char dir[600];
    snprintf(dir, sizeof(dir), "%s/tests/data/chat_templates", DUET_SOURCE_DIR);
    DIR *d = opendir(dir);
    cr_assert_not_null(d, "%s", dir);
    duet_jinja_limits_t lim = {
        .max_output = 1 << 16, .max_iterations = 2000, .max_memory = 8 << 20};
    size_t files = 0, parsed = 0, rendered = 0;
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        size_t nl = strlen(de->d_name);
        if (nl < 7 || strcmp(de->d_name + nl - 6, ".jinja") != 0)
            continue;
        char path[1200];
        snprintf(path, sizeof(path), "%s/%s", dir, de->d_name);
        duet_strbuf_t src;
        duet_strbuf_init(&src);
        cr_assert_eq(duet_strbuf_read_file(&src, path, 1 << 20), DUET_OK, "%s", path);
        files++;
        char *buf = malloc(2 * src.len + 64);
        cr_assert_not_null(buf);
        for (int iter = 0; iter < 150; iter++) {
            size_t len = src.len;
            memcpy(buf, src.data, len);
            int k = 1 + (int)(rnd() % 4);
            for (int i = 0; i < k && len > 2; i++) {
                size_t at = rnd() % len;
                switch (rnd() % 4) {
                case 0:
                    buf[at] = (char)(rnd() % 256);
                    break;
                case 1:
                    memmove(buf + at, buf + at + 1, len - at - 1);
                    len--;
                    break;
                case 2: {
                    size_t n = 1 + rnd() % 16;
                    if (at + n > len)
                        n = len - at;
                    memmove(buf + at + n, buf + at, len - at);
                    len += n; /* the span [at, at + n) now appears twice */
                    break;
                }
                default:
                    buf[at] = "{}%#-+'\"|.()[]:,~"[rnd() % 17];
                    break;
                }
            }
            duet_jinja_t *t = NULL;
            duet_status_t st = duet_jinja_parse(buf, len, "fz", &t);
            if (st != DUET_OK) {
                cr_assert_eq(st, DUET_ERR_FORMAT, "%s", duet_error_last());
                continue;
            }
            parsed++;
            duet_jinja_vars_t *v = make_vars(two, 2);
            duet_jinja_output_t out;
            st = duet_jinja_render(t, v, &lim, &out);
            cr_assert(st == DUET_OK || st == DUET_ERR_INVALID || st == DUET_ERR_RANGE ||
                          st == DUET_ERR_NOMEM || st == DUET_ERR_FORMAT ||
                          st == DUET_ERR_UNSUPPORTED,
                      "status %d", (int)st);
            if (st == DUET_OK) {
                rendered++;
                duet_jinja_output_free(&out);
            }
            duet_jinja_vars_destroy(v);
            duet_jinja_destroy(t);
        }
        free(buf);
        duet_strbuf_free(&src);
    }
    closedir(d);
    cr_assert(files >= 15, "%zu templates", files);
    cr_assert(parsed > 100 && rendered > 50, "parsed %zu rendered %zu", parsed, rendered);
    printf("[jinja fuzz] %zu templates, %zu mutants parsed, %zu rendered\n", files, parsed,
           rendered);
}
