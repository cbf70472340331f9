"""The incremental detokenizer (kiln/runtime/frontend/detokenizer.py) on the tiny Llama's tokenizer."""


def test_detokenizer_skips_ids_past_the_tokenizer(hf_model):
    """Models pad their vocabulary past the tokenizer's (Qwen2: 151936 against 151646): an id there
    adds no text instead of failing the request."""
    from transformers import AutoTokenizer

    from kiln.runtime.frontend.detokenizer import IncrementalDetokenizer

    tok = AutoTokenizer.from_pretrained(hf_model("llama"))
    ids = tok.encode("def f(x): return x", add_special_tokens=False)
    past = len(tok) + 5
    detok = IncrementalDetokenizer(tok, [past] + ids[:2])
    text = "".join(detok.add(t) for t in [ids[2], past, *ids[3:]]) + detok.flush()
    assert text == tok.decode(ids[2:]) and detok.text == text
