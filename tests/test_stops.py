"""How requests stop, on a tiny random Llama (eager engine): stop strings (cut from the text or
kept, ending on the token that completed them, not checked before min_tokens), stop token ids,
the model's EOS (unless ignore_eos) and min_tokens masking them; each against the greedy reference."""
import pytest

from kiln import SamplingParams
from runtime_helpers import MAX_TOKENS, assert_all_blocks_free, assert_text_is_decode, greedy
from runtime_helpers import engine_dir, llm, reference, tok  # noqa: F401 - fixtures
from tiny_models import PROMPTS


def first_new_token(ids: list[int], start: int) -> int:
    """The first index >= start whose token does not occur earlier in ids."""
    return next(j for j in range(start, len(ids)) if ids[j] not in ids[:j])


@pytest.fixture(scope="module")
def ascii_ref(reference):
    """A reference output whose text is plain text, long enough to cut stop strings from."""
    return next(o for o in reference if o.outputs[0].text.isascii() and o.outputs[0].text.isprintable()
                and len(o.outputs[0].text) > 12)


def test_stop_strings(llm, ascii_ref, tok):
    prompt, ref = ascii_ref.prompt, ascii_ref.outputs[0]
    text = ref.text
    stop = text[6:9]
    cut = text.find(stop)
    for include in (False, True):
        out = llm.generate(prompt, greedy(stop=["never appears", stop], include_stop_str_in_output=include))
        c = out[0].outputs[0]
        assert c.finish_reason == "stop" and c.stop_reason == stop
        assert c.text == (text[:cut + len(stop)] if include else text[:cut])
        # generation ended on the token that completed the stop string
        assert c.token_ids == ref.token_ids[:len(c.token_ids)]
        assert stop in tok.decode(c.token_ids) and stop not in tok.decode(c.token_ids[:-1])
        assert tok.decode(c.token_ids).startswith(text[:cut] + stop)
    assert_all_blocks_free(llm.llm_engine)


def test_stop_token_ids_and_min_tokens(llm, reference):
    ref = reference[4].outputs[0].token_ids
    j = first_new_token(ref, 2)
    stop_id = ref[j]
    out = llm.generate(PROMPTS[4], greedy(stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.token_ids == ref[:j + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    # min_tokens: the stop token cannot come before min_tokens tokens
    m = j + 4
    out = llm.generate(PROMPTS[4], greedy(stop_token_ids=[stop_id], min_tokens=m))[0].outputs[0]
    assert len(out.token_ids) > m and stop_id not in out.token_ids[:m]
    assert out.finish_reason == "length" or out.token_ids[-1] == stop_id
    assert_all_blocks_free(llm.llm_engine)


def test_stop_string_waits_for_min_tokens(llm, ascii_ref, tok):
    """Stop strings are not checked before min_tokens (vLLM): the output runs past the first hit
    and stops at the first one that ends after min_tokens tokens."""
    prompt = ascii_ref.prompt
    stop = ascii_ref.outputs[0].text[6:9]
    first = llm.generate(prompt, greedy(stop=stop))[0].outputs[0]
    m = len(first.token_ids) + 2
    long = llm.generate(prompt, greedy(4 * MAX_TOKENS))[0].outputs[0]
    # Where the stop must come: its first occurrence in the greedy text that ends past the text of
    # the first m tokens (the tiny model repeats itself, so there is one; the test needs it).
    checked_from = len(tok.decode(long.token_ids[:m]))
    pos = next((i for i in range(len(long.text)) if long.text.startswith(stop, i) and i + len(stop) > checked_from),
               None)
    assert pos is not None and long.text[:checked_from].isascii(), (stop, long.text)
    out = llm.generate(prompt, greedy(4 * MAX_TOKENS, stop=stop, min_tokens=m))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert len(out.token_ids) > m and out.text == long.text[:pos] and len(out.text) > len(first.text)
    assert out.token_ids == long.token_ids[:len(out.token_ids)]
    # generation ended on the token that completed the stop string
    assert len(tok.decode(out.token_ids)) >= pos + len(stop) > len(tok.decode(out.token_ids[:-1]))
    assert_all_blocks_free(llm.llm_engine)


def test_eos_finish(llm, reference, tok):
    """The model's EOS (here: swapped for a token the tiny model does emit) ends a request with
    "stop" unless ignore_eos; min_tokens masks it."""
    engine = llm.llm_engine
    ref = reference[4].outputs[0].token_ids
    j = first_new_token(ref, 2)
    saved = engine.input_processor.eos_token_ids
    engine.input_processor.eos_token_ids = (ref[j],)
    try:
        plain = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
        outs = llm.generate([PROMPTS[4], PROMPTS[4], PROMPTS[4]], [
            plain, greedy(), SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=j + 3)])
    finally:
        engine.input_processor.eos_token_ids = saved
    eos, ignored, late = (o.outputs[0] for o in outs)
    assert eos.token_ids == ref[:j + 1] and eos.finish_reason == "stop" and eos.stop_reason is None
    assert ignored.token_ids == ref and ignored.finish_reason == "length"
    assert ref[j] not in late.token_ids[:j + 3] and len(late.token_ids) > j + 3
    assert_text_is_decode(tok, outs)
    assert_all_blocks_free(engine)
