"""Text <-> token ids for the pre/postprocessing models (numpy only, no Triton imports)."""
import csv

import numpy as np


def text_of(value) -> str:
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)


def word_lists(rows, tokenizer) -> np.ndarray:
    """TensorRT-LLM's word lists ([batch, 2, L]: token ids, then each word's end offset, -1 padded)
    from, per batch row, strings of comma-separated words (CSV quoting, as its preprocessing)."""
    encoded = []
    for row in rows:
        ids, offsets = [], []
        for entry in np.asarray(row).reshape(-1):
            for word in next(csv.reader([text_of(entry)]), []):
                tokens = tokenizer.encode(word, add_special_tokens=False) if word else []
                if tokens:
                    ids += tokens
                    offsets.append(len(ids))
        encoded.append((ids, offsets))
    width = max([1] + [max(len(i), len(o)) for i, o in encoded])
    out = np.zeros((len(encoded), 2, width), np.int32)
    out[:, 1] = -1
    for b, (ids, offsets) in enumerate(encoded):
        out[b, 0, :len(ids)] = ids
        out[b, 1, :len(offsets)] = offsets
    return out


def decode(tokenizer, tokens: list[int], prefix: list[int], skip_special_tokens: bool) -> str:
    """The text `tokens` add after `prefix` (the tokens before them), so that a streamed chunk keeps
    the leading space or the bytes it shares with the tokens before it."""
    if not prefix:
        return tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)
    before = tokenizer.decode(prefix, skip_special_tokens=skip_special_tokens)
    full = tokenizer.decode(prefix + tokens, skip_special_tokens=skip_special_tokens)
    if full.startswith(before):
        return full[len(before):]
    return tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)
