"""Incremental detokenization: text deltas per new token, without re-decoding the whole output.

Decodes a short window of tokens (the previous read position onwards) and emits only the text that
window adds, holding back text that ends in an incomplete UTF-8 sequence (U+FFFD) until the
bytes are complete. The window starts a few prompt tokens back so that a leading space or a
multi-token character at the prompt's end decodes as it would in the whole text.
"""

PROMPT_CONTEXT = 5


class IncrementalDetokenizer:
    """tokenizer None (an engine loaded with skip_tokenizer_init): the text stays empty."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.text = ""
        self.tokens = []
        self.prefix_offset = self.read_offset = 0
        if tokenizer is None:
            return
        # Looked up once: transformers rebuilds its special-token list on every skip_special_tokens call.
        self.special_ids = frozenset(tokenizer.all_special_ids) if skip_special_tokens else frozenset()
        self.tokens = [t for t in tokenizer.convert_ids_to_tokens(prompt_token_ids[-PROMPT_CONTEXT:],
                                                                  skip_special_tokens=skip_special_tokens)
                       if t is not None]
        self.prefix_offset = max(len(self.tokens) - PROMPT_CONTEXT, 0)
        self.read_offset = len(self.tokens)

    def add(self, token_id: int) -> str:
        """Append one token; returns the text it completes (possibly empty)."""
        if self.tokenizer is None:
            return ""
        token = self.tokenizer.convert_ids_to_tokens(token_id)
        # None: an id past the tokenizer's vocabulary (a model whose vocab is padded, as Qwen2's is)
        if token_id in self.special_ids or token is None:
            return ""
        self.tokens.append(token)
        return self._advance(final=False)

    def flush(self) -> str:
        """At the end of the sequence: the text held back for more bytes, as decode() writes it."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        prefix = self._string(self.tokens[self.prefix_offset:self.read_offset])
        full = self._string(self.tokens[self.prefix_offset:])
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return ""
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        self.text += delta
        return delta

    def _string(self, tokens: list[str]) -> str:
        return self.tokenizer.convert_tokens_to_string(tokens) if tokens else ""
