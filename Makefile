VENV ?= .venv
PY := $(VENV)/bin/python
DEMO := demo_out
MODEL := models/kiln-tiny-stdlib

.PHONY: install test demo clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml requirements/cpu.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements/cpu.txt
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m kiln.plugins.cpp
	touch $@

# KILN_TEST_STRICT: a test whose dependency is missing fails here instead of skipping.
test: install
	KILN_TEST_STRICT=1 $(PY) -m pytest -q tests

# The default model: a 6M-parameter Llama trained on the standard library's source by
# examples/train_default_model.py (see models/kiln-tiny-stdlib/README.md).
demo: install
	$(VENV)/bin/convert_checkpoint --model_dir $(MODEL) --output_dir $(DEMO)/checkpoint --dtype bfloat16
	$(VENV)/bin/engine-build --checkpoint_dir $(DEMO)/checkpoint --output_dir $(DEMO)/engine \
		--max_batch_size 8 --max_input_len 256 --max_seq_len 512 --max_num_tokens 512
	$(VENV)/bin/kiln run --engine_dir $(DEMO)/engine --max_tokens 64 \
		--temperature 0.7 --top_p 0.9 --repetition_penalty 1.1 --seed 0 \
		--prompt 'def fibonacci(n):' --prompt 'class Stack:'

clean:
	rm -rf $(DEMO) $(VENV)
