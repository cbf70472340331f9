"""Writes a small random-weight Llama (GQA, tied embeddings) with a BPE tokenizer trained on the
standard library's `json` package: a stand-in default model until a trained one ships."""
import glob
import sys
import sysconfig
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast


def main(out: Path) -> None:
    files = sorted(glob.glob(str(Path(sysconfig.get_paths()["stdlib"]) / "json" / "*.py")))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator((Path(f).read_text() for f in files), trainers.BpeTrainer(
        vocab_size=1024, special_tokens=["<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    config = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=256, intermediate_size=768,
                         num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                         max_position_embeddings=1024, tie_word_embeddings=True,
                         bos_token_id=0, eos_token_id=1, architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    print(f"wrote a random-weight Llama ({sum(1 for _ in files)} tokenizer files) -> {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "demo_out/hf"))
