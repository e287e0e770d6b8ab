#!/usr/bin/env python3
"""Write the demo model's tokenizer as a Hugging Face tokenizer directory, for clients that
tokenize themselves (lm-evaluation-harness's local-completions: tokenizer=OUT_DIR).

models/duet-demo/duet_tokenizer.json is byte-level: each byte is its own id (0..255), <|bos|> is
256, <|eos|> 257, and a text prompt gets BOS first. The same as a `tokenizers` BPE without merges
over GPT-2's byte-to-character map (so every byte is one token with its own value as id), the two
specials added after it, and a post-processor putting <|bos|> first when special tokens are
added. Needs the `tokenizers` and `transformers` packages (no torch).

Usage: bench/demo_hf_tokenizer.py OUT_DIR
"""
import sys

BOS, EOS = 256, 257


def byte_chars():
    """GPT-2's byte-level map: printable bytes stand for themselves, the others for U+0100 on."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    char = {b: chr(b) for b in printable}
    extra = iter(range(256, 512))
    for b in range(256):
        if b not in char:
            char[b] = chr(next(extra))
    return char


def make_tokenizer(path):
    """Save the demo tokenizer as a PreTrainedTokenizerFast in `path`; returns it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    char = byte_chars()
    tok = Tokenizer(models.BPE(vocab={char[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|bos|>", "<|eos|>"])
    tok.post_processor = processors.TemplateProcessing(single="<|bos|> $A",
                                                       special_tokens=[("<|bos|>", BOS)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>")
    if fast.convert_tokens_to_ids(["<|bos|>", "<|eos|>"]) != [BOS, EOS]:
        raise SystemExit("demo_hf_tokenizer: the special tokens did not get ids 256, 257")
    fast.save_pretrained(path)
    return fast


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    make_tokenizer(sys.argv[1])
