VENV ?= .venv
PY := $(VENV)/bin/python
# A second venv with the newest transformers 5.x pyproject.toml allows (the first has the 4.57.6
# oracle): the converter's and HF-parity tests run under both majors.
VENV5 ?= .venv-transformers5
PY5 := $(VENV5)/bin/python
# Under 5.x: the converter's and config tests, and eager parity of one dense, one windowed and one MoE
# family (the first pass already holds every family to both majors' oracles).
TESTS5 := tests/test_convert.py tests/test_hf_config.py \
	$(foreach f,llama3.2 gemma3 qwen3-moe,'tests/test_hf_parity.py::test_greedy_matches_hf[$(f)-eager]')
DEMO := demo_out
MODEL := models/kiln-tiny-stdlib

# Prometheus for tests/test_vllm_commands.py: Debian's package, unpacked here (no service, no root-owned
# files outside the checkout).
PROMETHEUS := .prometheus/usr/bin/prometheus

.PHONY: install test demo clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml requirements/cpu.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements/cpu.txt
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m kiln.plugins.cpp
	touch $@

$(VENV5)/.installed: pyproject.toml requirements/cpu.txt requirements/transformers5.txt
	python3 -m venv $(VENV5)
	$(PY5) -m pip install -q --upgrade pip
	$(PY5) -m pip install -q $$(grep '^torch==' requirements/cpu.txt) -r requirements/transformers5.txt \
		-e . 'pytest>=8'
	touch $@

# The first run also asks the 5.x venv to save the published-config models and answer for them
# (tests/test_hf_parity.py); the second runs the converter and eager parity tests under 5.x itself.
# KILN_TEST_STRICT: a test whose dependency is missing fails here instead of skipping.
$(PROMETHEUS):
	mkdir -p .prometheus
	cd .prometheus && (apt-get download prometheus || (apt-get update -qq && apt-get download prometheus)) \
		&& dpkg-deb -x prometheus_*.deb . && rm prometheus_*.deb

# --durations: the slowest tests, named in every CI log (the suite has a time budget: 25 minutes on 2 cores).
test: install $(VENV5)/.installed $(PROMETHEUS)
	KILN_TEST_STRICT=1 KILN_TRANSFORMERS5_PYTHON=$(abspath $(PY5)) $(PY) -m pytest -q --durations=25 tests
	KILN_TEST_STRICT=1 $(PY5) -m pytest -q $(TESTS5)

# The default model: a 6M-parameter Llama trained on the standard library's source by
# examples/train_default_model.py (see models/kiln-tiny-stdlib/README.md).
demo: install
	$(VENV)/bin/convert_checkpoint --model_dir $(MODEL) --output_dir $(DEMO)/checkpoint --dtype bfloat16 \
		--eagle_model_dir $(MODEL)-eagle3
	$(VENV)/bin/engine-build --checkpoint_dir $(DEMO)/checkpoint --output_dir $(DEMO)/engine \
		--max_batch_size 8 --max_input_len 256 --max_seq_len 512 --max_num_tokens 512
	$(VENV)/bin/kiln run --engine_dir $(DEMO)/engine --max_tokens 64 \
		--temperature 0.7 --top_p 0.9 --repetition_penalty 1.1 --seed 0 \
		--prompt 'def fibonacci(n):' --prompt 'class Stack:'
	$(VENV)/bin/kiln run --engine_dir $(DEMO)/engine --max_tokens 64 --prompt 'def parse_args(argv):' \
		--speculative_config '{"method": "eagle3", "num_speculative_tokens": 3}'

clean:
	rm -rf $(DEMO) $(VENV) $(VENV5) .prometheus
