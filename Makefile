# Two entry points: `make demo` and `make test`. Both build .venv from scratch when it is missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch is pinned here (the CPU wheel on this kind of machine); the package's own range stays open.
TORCH_PIN ?= torch==2.13.0

# torchtitan's checkpoint component alone (16 MB): the extra [torchtitan] brings its datasets,
# wandb and tensorboard too (about 580 MB), none of which the component imports. Installed last,
# so that no later pip run reports the dependencies left out.
$(BIN)/.installed: pyproject.toml setup.py
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH_PIN)
	$(BIN)/pip install -q -e '.[test,demo,hf,lightning,accelerate,torchdata,torchft,s3,docs]'
	$(BIN)/pip install -q tyro==1.0.17 spmd_types==0.2.3
	$(BIN)/pip install -q --no-deps torchtitan==0.3.0
	touch $@

.PHONY: venv demo test check lint docs busy-test busy-demos bench fuzz clean
venv: $(BIN)/.installed

# the demo refuses a used directory (it never overwrites a tape): start demo-out afresh
demo: venv
	rm -rf demo-out
	$(BIN)/ckpt demo --out demo-out

# Every bound in the suite is a hang detector, never a speed verdict; on a machine loaded far
# beyond 2x its cores, CKPT_TIMEOUT_SCALE=4 (say) widens them all (a hang dumps every stack).
# Independent tests run side by side (pytest-xdist): many wait on subprocesses, so more
# workers than cores pays; `--dist loadgroup` keeps each shared run's readers on one worker.
# TEST_WORKERS=0 runs them in this one process.
TEST_WORKERS ?= 4
XDIST = -n $(TEST_WORKERS) --dist loadgroup
test: venv
	$(BIN)/python -m pytest -q -m "not cuda" $(XDIST)

# the edit-test loop: the unit tier (no multi-process runs, no demos)
check: venv
	$(BIN)/python -m pytest -q -m "not cuda and not slow" $(XDIST)

# dead code at 80% confidence and above (unused imports, variables, arguments, unreachable
# code); a false positive goes in tests/vulture_whitelist.py, naming its caller
lint: venv
	$(BIN)/python -m vulture ckpt replay cli runs tests/vulture_whitelist.py --min-confidence 80

# the documentation site, into site/ (strict: a broken link or a missing page fails it);
# `$(BIN)/mkdocs serve` serves it while you edit
docs: venv
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# the suite and the demos on a busy machine: four CPU hogs beside them (bench/busy.py)
BUSY_RUNS ?= 1
busy-test: venv
	$(BIN)/python bench/busy.py --runs $(BUSY_RUNS) -- $(BIN)/python -m pytest -q -m "not cuda" $(XDIST)

BUSY_DEMOS ?= diloco stages basic replicas rollback
busy-demos: venv
	for d in $(BUSY_DEMOS); do $(BIN)/python bench/busy.py --runs $(BUSY_RUNS) --demo $$d --quick || exit 1; \
	  $(BIN)/python bench/busy.py --runs $(BUSY_RUNS) --demo $$d || exit 1; done

bench: venv
	for b in save_load async_save resume tape ledger snapshot replicas cli_hf object_store compress dedup scale stages optim_startup; do $(BIN)/python bench/$$b.py || exit 1; done

# the long fuzz run: mutated, re-signed checkpoints and tapes, then the fault simulator over
# every write path (bench/sim.py), then random-kill trials of every trainer integration
# (bench/trainer_trials.py); each prints the counts the docs quote
FUZZ_CASES ?= 5000
SIM_TRIALS ?= 700
TRAINER_TRIALS ?= 10
fuzz: venv
	$(BIN)/python bench/fuzz.py --cases $(FUZZ_CASES)
	$(BIN)/python bench/sim.py --trials $(SIM_TRIALS)
	$(BIN)/python bench/trainer_trials.py --trials $(TRAINER_TRIALS)

clean:
	rm -rf $(VENV) demo-out site
