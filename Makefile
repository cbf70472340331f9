VENV ?= .venv
PY := $(VENV)/bin/python
DEMO := demo_out

.PHONY: install test demo clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml requirements/cpu.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements/cpu.txt
	$(PY) -m pip install -q -e '.[test]'
	touch $@

test: install
	$(PY) -m pytest -q tests

demo: install
	$(PY) examples/make_tiny_model.py $(DEMO)/hf
	$(VENV)/bin/convert_checkpoint --model_dir $(DEMO)/hf --output_dir $(DEMO)/checkpoint --dtype bfloat16
	$(VENV)/bin/engine-build --checkpoint_dir $(DEMO)/checkpoint --output_dir $(DEMO)/engine \
		--max_batch_size 8 --max_input_len 256 --max_seq_len 512 --max_num_tokens 512
	$(VENV)/bin/kiln run --engine_dir $(DEMO)/engine --max_tokens 48 \
		--prompt 'def fibonacci(n):' --prompt 'import os'

clean:
	rm -rf $(DEMO) $(VENV)
