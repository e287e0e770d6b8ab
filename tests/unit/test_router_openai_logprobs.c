/*
 * router/api/openai_logprobs.c: the logprobs / processing fields parse into duet_oai_lp_params_t,
 * and recorded logprobs serialise in OpenAI's shapes (chat "content" entries with bytes and
 * top_logprobs; completions' four parallel lists, echo's prompt first with null), read back with
 * jansson and compared with what was recorded.
 */
#include <criterion/criterion.h>
#include <jansson.h>
#include <math.h>
#include <string.h>

#include "router/api/openai_logprobs.h"

static const duet_oai_limits_t lim = {
    .model_name = "m",
    .max_tokens_default = 16,
    .max_tokens_cap = 512,
    .max_body_bytes = 1 << 16,
    .vocab_size = 258,
    .max_context = 1024,
};

static duet_tokenizer_t *byte_tok(void)
{
    static const char *const specials[] = {"<|bos|>", "<|eos|>"};
    duet_tokenizer_t *tok = NULL;
    cr_assert_eq(duet_tokenizer_create_byte(specials, 2, &tok), DUET_OK, "%s", duet_error_last());
    return tok;
}

Test(router_openai_logprobs, fields_parse, .timeout = 10)
{
    duet_oai_request_t r;
    duet_oai_error_t e;
    const char *chat = "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],"
                       "\"logprobs\":true,\"top_logprobs\":20,\"presence_penalty\":-2,"
                       "\"frequency_penalty\":1.5,\"repetition_penalty\":1.3,\"min_tokens\":3,"
                       "\"logit_bias\":{\"65\":-100,\"257\":2.5},\"stop_token_ids\":[10,0]}";
    cr_assert_eq(duet_oai_request_parse(&lim, DUET_OAI_ENDPOINT_CHAT, chat, strlen(chat), &r, &e),
                 DUET_OK, "%s", e.message);
    cr_expect(r.lp.logprobs);
    cr_expect_eq(r.lp.top_logprobs, 20);
    cr_expect_eq(r.lp.presence_penalty, -2.0);
    cr_expect_eq(r.lp.frequency_penalty, 1.5);
    cr_expect_eq(r.lp.repetition_penalty, 1.3);
    cr_expect_eq(r.lp.min_tokens, 3);
    cr_expect(r.lp.n_stop_token_ids == 2 && r.lp.stop_token_ids[0] == 10 &&
              r.lp.stop_token_ids[1] == 0);
    cr_assert_eq(r.lp.n_bias, 2);
    for (size_t i = 0; i < 2; i++) /* jansson keeps insertion order */
        cr_expect(r.lp.bias_ids[i] == (i ? 257u : 65u) && r.lp.bias[i] == (i ? 2.5f : -100.0f));
    duet_oai_request_free(&r);

    const char *compl = "{\"model\":\"m\",\"prompt\":\"x\",\"logprobs\":0,\"echo\":true,"
                        "\"max_tokens\":0}";
    cr_assert_eq(
        duet_oai_request_parse(&lim, DUET_OAI_ENDPOINT_COMPLETIONS, compl, strlen(compl ), &r, &e),
        DUET_OK, "%s", e.message);
    cr_expect(r.lp.logprobs && r.lp.top_logprobs == 0 && r.lp.echo && r.max_tokens == 0);
    cr_expect_eq(r.lp.repetition_penalty, 1.0, "the default is off");
    duet_oai_request_free(&r);

    const char *plain = "{\"model\":\"m\",\"prompt\":\"x\",\"logprobs\":null}";
    cr_assert_eq(
        duet_oai_request_parse(&lim, DUET_OAI_ENDPOINT_COMPLETIONS, plain, strlen(plain), &r, &e),
        DUET_OK, "%s", e.message);
    cr_expect(!r.lp.logprobs && !r.lp.echo && r.lp.n_bias == 0 && r.max_tokens == 16);
    duet_oai_request_free(&r);
}

/* Entries over the byte tokenizer: ids 'a'.. with descending logprobs, top ids in order. */
static void fill(duet_oai_lp_entry_t *e, size_t n, int n_top)
{
    memset(e, 0, n * sizeof(*e));
    for (size_t i = 0; i < n; i++) {
        e[i].id = (uint32_t)('a' + i);
        e[i].logprob = -0.5f * (float)(i + 1);
        e[i].n_top = n_top;
        for (int k = 0; k < n_top; k++) {
            e[i].top_ids[k] = (uint32_t)('A' + k);
            e[i].top_lps[k] = -0.25f * (float)(k + 1);
        }
    }
}

Test(router_openai_logprobs, chat_shape, .timeout = 10)
{
    duet_tokenizer_t *tok = byte_tok();
    duet_oai_request_t req = {.endpoint = DUET_OAI_ENDPOINT_CHAT,
                              .lp = {.logprobs = true, .top_logprobs = 2}};
    duet_oai_lp_t *lp = NULL;
    cr_assert_eq(duet_oai_lp_create(tok, &req, &lp), DUET_OK);
    duet_oai_lp_entry_t e[3];
    fill(e, 3, 2);
    e[2].id = 0xe2; /* a lone UTF-8 lead byte: U+FFFD, bytes [226] */
    cr_assert_eq(duet_oai_lp_add(lp, e, 3), DUET_OK);
    duet_strbuf_t sb;
    duet_strbuf_init(&sb);
    cr_assert_eq(duet_oai_lp_json(lp, 1, 3, false, &sb), DUET_OK);
    json_error_t je;
    json_t *o = json_loads(sb.data, 0, &je);
    cr_assert_not_null(o, "%s: %s", sb.data, je.text);
    json_t *c = json_object_get(o, "content");
    cr_assert_eq(json_array_size(c), 2, "%s", sb.data);
    json_t *c0 = json_array_get(c, 0), *c1 = json_array_get(c, 1);
    cr_expect_str_eq(json_string_value(json_object_get(c0, "token")), "b");
    cr_expect_float_eq(json_number_value(json_object_get(c0, "logprob")), -1.0, 1e-7);
    cr_expect_eq(json_integer_value(json_array_get(json_object_get(c0, "bytes"), 0)), 'b');
    cr_expect_str_eq(json_string_value(json_object_get(c1, "token")), "\xef\xbf\xbd");
    cr_expect_eq(json_integer_value(json_array_get(json_object_get(c1, "bytes"), 0)), 0xe2);
    json_t *top = json_object_get(c0, "top_logprobs");
    cr_assert_eq(json_array_size(top), 2);
    cr_expect_str_eq(json_string_value(json_object_get(json_array_get(top, 1), "token")), "B");
    cr_expect_float_eq(json_number_value(json_object_get(json_array_get(top, 1), "logprob")), -0.5,
                       1e-7);
    json_decref(o);
    duet_strbuf_free(&sb);
    duet_oai_lp_destroy(lp);
    duet_tokenizer_destroy(tok);
}

Test(router_openai_logprobs, completions_shape_with_echo, .timeout = 10)
{
    duet_tokenizer_t *tok = byte_tok();
    duet_oai_request_t req = {.endpoint = DUET_OAI_ENDPOINT_COMPLETIONS,
                              .skip_special_tokens = true,
                              .lp = {.logprobs = true, .top_logprobs = 1, .echo = true}};
    duet_oai_lp_t *lp = NULL;
    cr_assert_eq(duet_oai_lp_create(tok, &req, &lp), DUET_OK);
    const uint32_t prompt[3] = {256, 'h', 'i'}; /* <|bos|> h i */
    duet_oai_lp_entry_t pe[2], ge[2];
    fill(pe, 2, 1);
    fill(ge, 2, 1);
    cr_assert_eq(duet_oai_lp_set_prompt(lp, prompt, 3, pe), DUET_OK);
    cr_assert_eq(duet_oai_lp_add(lp, ge, 2), DUET_OK);
    duet_strbuf_t sb;
    duet_strbuf_init(&sb);
    cr_assert_eq(duet_oai_lp_json(lp, 0, 2, true, &sb), DUET_OK);
    json_t *o = json_loads(sb.data, 0, NULL);
    cr_assert_not_null(o, "%s", sb.data);
    json_t *tokens = json_object_get(o, "tokens"), *lps = json_object_get(o, "token_logprobs"),
           *tops = json_object_get(o, "top_logprobs"), *off = json_object_get(o, "text_offset");
    cr_assert_eq(json_array_size(tokens), 5, "%s", sb.data);
    cr_assert(json_array_size(lps) == 5 && json_array_size(tops) == 5 && json_array_size(off) == 5);
    cr_expect_str_eq(json_string_value(json_array_get(tokens, 0)), "<|bos|>");
    cr_expect(json_is_null(json_array_get(lps, 0)) && json_is_null(json_array_get(tops, 0)));
    /* the prompt's second token has the first prompt entry's logprob */
    cr_expect_str_eq(json_string_value(json_array_get(tokens, 1)), "h");
    cr_expect_float_eq(json_number_value(json_array_get(lps, 1)), -0.5, 1e-7);
    cr_expect_str_eq(json_string_value(json_array_get(tokens, 3)), "a");
    /* top 1 ("A") plus the chosen token, which is not among them */
    json_t *t3 = json_array_get(tops, 3);
    cr_expect_eq(json_object_size(t3), 2, "%s", sb.data);
    cr_expect_float_eq(json_number_value(json_object_get(t3, "A")), -0.25, 1e-7);
    cr_expect_float_eq(json_number_value(json_object_get(t3, "a")), -0.5, 1e-7);
    /* <|bos|> is skipped: it adds no text */
    const json_int_t want_off[5] = {0, 0, 1, 2, 3};
    for (size_t i = 0; i < 5; i++)
        cr_expect_eq(json_integer_value(json_array_get(off, i)), want_off[i], "offset %zu", i);
    json_decref(o);

    /* a later streamed range: offsets go on after the prompt and the earlier positions */
    duet_strbuf_free(&sb);
    duet_strbuf_init(&sb);
    cr_assert_eq(duet_oai_lp_json(lp, 1, 2, false, &sb), DUET_OK);
    o = json_loads(sb.data, 0, NULL);
    cr_assert_not_null(o);
    cr_expect_eq(json_array_size(json_object_get(o, "tokens")), 1);
    cr_expect_eq(json_integer_value(json_array_get(json_object_get(o, "text_offset"), 0)), 3, "%s",
                 sb.data);
    json_decref(o);
    duet_strbuf_free(&sb);
    duet_oai_lp_destroy(lp);
    duet_tokenizer_destroy(tok);
}
