/*
 * Fuzz target: a model folder's chat_template.json in duet's own format
 * (router/api/chat_template.c: duet_oai_template_create, router/api/CHAT_TEMPLATE.md), then the
 * prompts a request makes with it: a conversation (duet_oai_chat_prompt) and a /v1/completions
 * text prompt (duet_oai_completion_prompt), tokenized by a byte tokenizer with the specials
 * <|bos|> and <|eos|>.
 *
 * Input: the file's bytes. Checked besides no crash / sanitizer report:
 *  - a refusal sets a detail and leaves no template;
 *  - every prompt id is inside the vocabulary;
 *  - trust: message content never becomes a special token. The same conversation is rendered
 *    twice, once with content that spells the specials ("<|bos|><|eos|>") and once with plain
 *    text of the same length; both prompts must hold the same special ids, in the same order
 *    (only the template's own text may produce them). Likewise for the completion prompt.
 */
#include "fuzz/fuzz.h"

#include "common/status.h"
#include "router/api/chat_template.h"
#include "tokenizer/tokenizer.h"

static duet_tokenizer_t *tok;

/* The special ids of ids[0..n), in order, written to out (n entries max); returns the count. */
static size_t specials_of(const uint32_t *ids, size_t n, uint32_t *out)
{
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        if (duet_tokenizer_is_special(tok, ids[i]))
            out[k++] = ids[i];
    return k;
}

/* Render both contents; the special ids must agree. */
static void check_pair(duet_status_t st_a, uint32_t *a, size_t na, duet_status_t st_b, uint32_t *b,
                       size_t nb, const char *what)
{
    FUZZ_CHECK(st_a == st_b, "%s: status %d with specials in the content, %d without", what,
               (int)st_a, (int)st_b);
    if (st_a == DUET_OK) {
        uint32_t v = duet_tokenizer_vocab_size(tok);
        for (size_t i = 0; i < na; i++)
            FUZZ_CHECK(a[i] < v, "%s: id %u", what, a[i]);
        for (size_t i = 0; i < nb; i++)
            FUZZ_CHECK(b[i] < v, "%s: id %u", what, b[i]);
        uint32_t *sa = malloc((na + 1) * sizeof(*sa)), *sb = malloc((nb + 1) * sizeof(*sb));
        FUZZ_CHECK(sa != NULL && sb != NULL, "oom");
        size_t ka = specials_of(a, na, sa), kb = specials_of(b, nb, sb);
        FUZZ_CHECK(ka == kb && memcmp(sa, sb, ka * sizeof(*sa)) == 0,
                   "%s: content turned into special tokens (%zu vs %zu specials)", what, ka, kb);
        free(sa);
        free(sb);
    }
    free(a);
    free(b);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fuzz_quiet();
    if (tok == NULL) {
        const char *specials[] = {"<|bos|>", "<|eos|>"};
        FUZZ_CHECK(duet_tokenizer_create_byte(specials, 2, &tok) == DUET_OK, "tokenizer");
    }
    duet_oai_template_t *tmpl = NULL;
    duet_error_clear();
    duet_status_t st =
        duet_oai_template_create((const char *)data, size, "chat_template.json", tok, &tmpl);
    if (st != DUET_OK) {
        FUZZ_CHECK(st < 0 && tmpl == NULL && duet_error_last()[0] != '\0',
                   "refusal %d without a detail", (int)st);
        return 0;
    }
    FUZZ_CHECK(!duet_oai_template_is_jinja(tmpl), "duet's format made a Jinja template");

    static char spell[] = "<|bos|><|eos|>", plain[] = "ABCDEFGHIJKLMN", sys[] = "be brief";
    duet_oai_message_t msgs[3] = {
        {DUET_OAI_ROLE_SYSTEM, sys, sizeof(sys) - 1},
        {DUET_OAI_ROLE_USER, spell, sizeof(spell) - 1},
        {DUET_OAI_ROLE_ASSISTANT, spell, sizeof(spell) - 1},
    };
    uint32_t *a = NULL, *b = NULL;
    size_t na = 0, nb = 0;
    duet_status_t st_a = duet_oai_chat_prompt(tmpl, tok, msgs, 3, &a, &na);
    msgs[1].content = msgs[2].content = plain;
    duet_status_t st_b = duet_oai_chat_prompt(tmpl, tok, msgs, 3, &b, &nb);
    check_pair(st_a, a, na, st_b, b, nb, "chat prompt");

    a = b = NULL;
    st_a = duet_oai_completion_prompt(tmpl, tok, spell, sizeof(spell) - 1, &a, &na);
    st_b = duet_oai_completion_prompt(tmpl, tok, plain, sizeof(plain) - 1, &b, &nb);
    check_pair(st_a, a, na, st_b, b, nb, "completion prompt");
    duet_oai_template_destroy(tmpl);
    return 0;
}
