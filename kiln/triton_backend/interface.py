"""The ensemble's wiring as Python, for tensorrt_llm_bls to call the same models the same way
(tests/test_triton.py holds it to the ensemble's config.pbtxt): its inputs to preprocessing's, the
preprocessed tensors to tensorrt_llm's inputs, its other inputs straight to tensorrt_llm, and
tensorrt_llm's outputs to postprocessing or straight out."""

TO_PREPROCESSING = {"text_input": "QUERY", "max_tokens": "REQUEST_OUTPUT_LEN", "bad_words": "BAD_WORDS_DICT",
                    "stop_words": "STOP_WORDS_DICT", "end_id": "END_ID", "pad_id": "PAD_ID",
                    "embedding_bias_words": "EMBEDDING_BIAS_WORDS",
                    "embedding_bias_weights": "EMBEDDING_BIAS_WEIGHTS", "decoder_text_input": "DECODER_QUERY"}
PREPROCESSED = {"INPUT_ID": "input_ids", "REQUEST_INPUT_LEN": "input_lengths",
                "REQUEST_OUTPUT_LEN": "request_output_len", "BAD_WORDS_IDS": "bad_words_list",
                "STOP_WORDS_IDS": "stop_words_list", "OUT_END_ID": "end_id", "OUT_PAD_ID": "pad_id",
                "DECODER_INPUT_ID": "decoder_input_ids", "REQUEST_DECODER_INPUT_LEN": "decoder_input_lengths"}
TO_ENGINE = {"top_k": "runtime_top_k", "top_p": "runtime_top_p", "temperature": "temperature",
             "length_penalty": "len_penalty", "repetition_penalty": "repetition_penalty",
             "min_tokens": "min_tokens", "presence_penalty": "presence_penalty",
             "frequency_penalty": "frequency_penalty", "seed": "seed", "num_return_sequences": "num_return_sequences",
             "return_log_probs": "return_log_probs", "return_context_logits": "return_context_logits",
             "return_generation_logits": "return_generation_logits", "return_perf_metrics": "return_perf_metrics",
             "return_num_input_tokens": "return_num_input_tokens",
             "return_num_output_tokens": "return_num_output_tokens",
             "exclude_input_in_output": "exclude_input_in_output", "beam_width": "beam_width", "stream": "streaming",
             **{name: name for name in ("prompt_embedding_table", "prompt_vocab_size", "lora_task_id", "lora_weights",
                                        "lora_config", "guided_decoding_guide_type", "guided_decoding_guide")}}
PASSED_THROUGH = ["cum_log_probs", "output_log_probs", "context_logits", "generation_logits", "batch_index",
                  "sequence_index", "kv_cache_alloc_new_blocks", "kv_cache_reused_blocks",
                  "kv_cache_alloc_total_blocks",
                  "arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns",
                  "acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens", "num_input_tokens",
                  "num_output_tokens"]
TO_POSTPROCESSING = {"output_ids": "TOKENS_BATCH", "sequence_length": "SEQUENCE_LENGTH", "prefix_ids": "PREFIX_IDS"}
