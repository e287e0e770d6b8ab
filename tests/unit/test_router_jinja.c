/*
 * The Jinja subset renderer (router/jinja.c) and the chat template that uses it: each expression
 * and statement with its exact output, a Kimi-style template over a few conversations, segment
 * origins (user text never becomes template text), refused templates with line:column, a
 * deterministic fuzz of random and mutated templates, and the output / loop / memory limits.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/strbuf.h"
#include "router/chat_template.h"
#include "router/jinja.h"

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
        cr_assert_eq(duet_jinja_map_set(v, m, "content",
                                        duet_jinja_string(v, msgs[i].content,
                                                          strlen(msgs[i].content),
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
    cr_assert_eq(duet_jinja_vars_set(v, "s", duet_jinja_string(v, "  hi  ", 6,
                                                               DUET_JINJA_ORIGIN_DATA)),
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

static void expect(const char *src, const char *want)
{
    duet_status_t st;
    char *got = render_with(src, two, 2, false, NULL, &st);
    cr_assert_eq(st, DUET_OK, "%s: %s", src, duet_error_last());
    cr_assert_str_eq(got, want, "template %s", src);
    free(got);
}

Test(router_jinja, expressions, .timeout = 10)
{
    expect("a{{ 'b' }}c", "abc");
    expect("{{ \"q\\\"\\n\\t\\\\\" }}", "q\"\n\t\\");
    expect("{{ 'x' 'y' }}", "xy");
    expect("{{ 42 }}|{{ -7 }}|{{ 2 + 3 }}|{{ 5 - 8 }}", "42|-7|5|-3");
    expect("{{ true }}{{ False }}{{ none }}{{ None }}", "TrueFalseNoneNone");
    expect("{{ n }}{{ nope }}{{ nope.x }}{{ nope['y'] }}", "3");
    expect("{{ messages[0].role }} {{ messages[1]['content'] }} {{ messages[-1].role }}",
           "user Hi! assistant");
    expect("{{ messages[5] }}{{ messages[0].zzz }}", "");
    expect("{{ 'a' + 'b' + messages[0].content }}", "abHello");
    expect("{{ 1 == 1 }}{{ 'a' != 'a' }}{{ n < 4 }}{{ n >= 4 }}", "TrueFalseTrueFalse");
    expect("{{ 'ell' in messages[0].content }}{{ 'x' not in 'abc' }}{{ 2 in [1, 2] }}",
           "TrueTrueTrue");
    expect("{{ 'role' in messages[0] }}{{ 'name' in messages[0] }}", "TrueFalse");
    expect("{{ not true }}{{ not nope }}{{ true and false }}{{ false or 'x' }}",
           "FalseTrueFalsex");
    expect("{{ (1 == 2 or 2 == 2) and not (3 == 4) }}", "True");
    expect("{{ s is string }}{{ n is string }}{{ nope is defined }}{{ n is defined }}",
           "TrueFalseFalseTrue");
    expect("{{ tools is none }}{{ n is not none }}{{ nope is undefined }}", "TrueTrueTrue");
    expect("[{{ s|trim }}]{{ messages|length }}{{ 'abc'|length }}", "[hi]23");
    expect("{{ nope|default('d') }}{{ n|default(9) }}{{ s|trim|length }}", "d32");
    expect("{{ messages[0].content|length > 3 }}", "True");
}

Test(router_jinja, statements, .timeout = 10)
{
    expect("{% if n == 3 %}three{% endif %}", "three");
    expect("{% if n == 1 %}a{% elif n == 3 %}b{% else %}c{% endif %}", "b");
    expect("{% if nope %}a{% elif false %}b{% else %}c{% endif %}", "c");
    expect("{% for m in messages %}{{ loop.index0 }}{{ loop.index }}{{ m.role }}"
           "{% if loop.first %}F{% endif %}{% if loop.last %}L{% endif %},{% endfor %}",
           "01userF,12assistantL,");
    expect("{% for x in [1, 2, 3] %}{{ x }}{% endfor %}", "123");
    expect("{% for x in nope %}x{% endfor %}", "");
    expect("{% set a = 'v' + 'w' %}{{ a }}", "vw");
    expect("{% set a = 1 %}{% for m in messages %}{% set a = 2 %}{% endfor %}{{ a }}", "1");
    expect("a{# comment {{ x }} #}b", "ab");
    expect("a  {{- 'b' -}}  \n c", "abc");
    expect("a \n {%- if true -%} \n b {%- endif %}", "ab");
    /* trim_blocks and lstrip_blocks, as Hugging Face sets them. */
    expect("x\n  {% if true %}\ny\n  {% endif %}\nz", "x\ny\nz");
    expect("x {%+ if true %}y{% endif %}", "x y");
}

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
        duet_jinja_map_set(v, p, "text",
                           duet_jinja_string(v, texts[i], strlen(texts[i]),
                                             DUET_JINJA_ORIGIN_DATA));
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

Test(router_jinja, origins_survive_concat_and_filters, .timeout = 10)
{
    const msg_t m[] = {{"user", " <|im_end|> "}};
    duet_status_t st;
    char *got = render_with("{% set x = '<a>' + messages[0].content|trim + '<b>' %}{{ x }}"
                            "{{ messages[0].content[1] }}{{ bos_token }}",
                            m, 1, true, NULL, &st);
    cr_assert_eq(st, DUET_OK, "%s", duet_error_last());
    cr_assert_str_eq(got, "<a>[<|im_end|>]<b>[<]<s>");
    free(got);
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
    refused("{% foo %}", "tpl:1:4: unknown");
    refused("a\n{% if x %}b", "tpl:2:1: unclosed 'if'");
    refused("{% for x in y %}", "tpl:1:1: unclosed 'for'");
    refused("{{ x ", "tpl:1:1: unclosed");
    refused("{% if x %", "tpl:1:1: unclosed");
    refused("{# never", "tpl:1:1: unclosed comment");
    refused("{{ }}", "tpl:1:4: expected an expression");
    refused("{{ x + }}", "tpl:1:8: expected an expression");
    refused("{{ x y }}", "tpl:1:6: unexpected");
    refused("\n\n  {{ x|upper }}", "tpl:3:8: unsupported filter 'upper'");
    refused("{{ x is odd }}", "tpl:1:9: unsupported test 'odd'");
    refused("{{ f(x) }}", "tpl:1:5: function calls");
    refused("{{ 'abc }}", "tpl:1:1: unclosed");
    refused("{% endif %}", "tpl:1:4: unknown or misplaced tag 'endif'");
    refused("{% if a %}{% endfor %}", "unknown or misplaced tag 'endfor'");
    refused("{% for a, b in c %}{% endfor %}", "tpl:1:9: tuple unpacking");
    refused("{% set x %}", "tpl:1:10: expected '='");
    refused("{{ x @ y }}", "tpl:1:6: unexpected character '@'");
    refused("{{ '\\q' }}", "tpl:1:5: unsupported escape");
    refused("{{ 99999999999999999999 }}", "tpl:1:4: integer literal too large");
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

Test(router_jinja, render_errors_and_limits, .timeout = 20)
{
    duet_status_t st;
    char *got = render_with("{{ messages }}", two, 2, false, NULL, &st);
    cr_assert_eq(st, DUET_ERR_INVALID);
    cr_assert_null(got);
    cr_assert(strstr(duet_error_last(), "t:1:1: cannot render a list") != NULL, "%s",
              duet_error_last());
    got = render_with("{{ 'a' + 1 }}", two, 2, false, NULL, &st);
    cr_assert_eq(st, DUET_ERR_INVALID);

    duet_jinja_limits_t lim = {.max_output = 100, .max_iterations = 50, .max_memory = 1 << 20};
    got = render_with("{% for m in messages %}{% for x in [1,2,3,4,5,6,7,8,9,10] %}"
                      "{% for y in [1,2,3] %}{% endfor %}{% endfor %}{% endfor %}",
                      two, 2, false, &lim, &st);
    cr_assert_eq(st, DUET_ERR_RANGE, "%s", duet_error_last());
    cr_assert(strstr(duet_error_last(), "loop iterations") != NULL, "%s", duet_error_last());
    got = render_with("{% for x in [1,2,3,4,5,6,7,8,9,10] %}0123456789abc{% endfor %}", two, 2,
                      false, &lim, &st);
    cr_assert_eq(st, DUET_ERR_RANGE);
    cr_assert(strstr(duet_error_last(), "output longer") != NULL, "%s", duet_error_last());
    /* Doubling a string: bounded by the output limit on values, not by memory exhaustion. */
    got = render_with("{% set s = 'ab' %}{% for a in [1,2,3,4,5,6,7,8,9,10] %}"
                      "{% set s = s + s %}{% endfor %}",
                      two, 2, false, &lim, &st);
    cr_assert_eq(st, DUET_OK); /* the loop scope drops s each iteration */
    got = render_with("{% set s = 'abcdefghij' %}{% set s = s + s + s + s + s + s + s + s + s + s"
                      " + s %}",
                      two, 2, false, &lim, &st);
    cr_assert_eq(st, DUET_ERR_RANGE);
    /* Memory: a render whose arena limit is tiny fails cleanly. */
    duet_jinja_t *t = NULL;
    const char *src = "{% for a in [1,2,3,4,5,6,7,8,9,10] %}{{ a }}{% endfor %}";
    cr_assert_eq(duet_jinja_parse(src, strlen(src), "m", &t), DUET_OK);
    duet_jinja_vars_t *v = NULL;
    cr_assert_eq(duet_jinja_vars_create(1, &v), DUET_OK);
    duet_jinja_output_t out;
    cr_assert_eq(duet_jinja_render(t, v, NULL, &out), DUET_ERR_NOMEM);
    duet_jinja_vars_destroy(v);
    duet_jinja_destroy(t);
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
    static const char *const pieces[] = {
        "{{", "}}", "{%", "%}", "{#", "#}", "-", " ", "\n", "if", "elif", "else", "endif", "for",
        "in", "endfor", "set", "=", "x", "messages", "loop", ".", "index", "[", "]", "0", "'a'",
        "\"b\\n\"", "+", "==", "!=", "not", "and", "or", "(", ")", "|", "trim", "length",
        "default", "is", "string", "defined", "none", "m", "content", "role", ",", "true", "'",
        "<|im_end|>"};
    const size_t n_pieces = sizeof(pieces) / sizeof(pieces[0]);
    duet_jinja_limits_t lim = {.max_output = 1 << 16, .max_iterations = 1000,
                               .max_memory = 4 << 20};
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
                case 0: buf[at] = (char)(rnd() % 256); break;
                case 1: memmove(buf + at, buf + at + 1, len - at - 1); len--; break;
                default: buf[at] = "{}%#-'\"|."[rnd() % 9]; break;
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
                  st == DUET_ERR_NOMEM, "status %d", (int)st);
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
