# thunder-runbook: corpus -> LoRA adapter with data-parallel MLX across Macs.
# `make help` lists the targets; `make -n <stage>` prints what a stage runs.
# Works with GNU make 3.81 (macOS) and 4.x.

# GNU make 3.81 ignores .SHELLFLAGS but splits SHELL into words, so the strict flags live
# in SHELL itself and hold under 3.81 and 4.x alike (tests/test_macos_tools.py proves it).
SHELL := bash -eu -o pipefail
.SHELLFLAGS := -c
.DELETE_ON_ERROR:
.SUFFIXES:
MAKEFLAGS += --warn-undefined-variables --no-builtin-rules
.DEFAULT_GOAL := help

# ---- the operator's settings ----------------------------------------------------
# settings.mk (git-ignored) holds this Mac1's values, so bare `make smoke` / `make train`
# use them; its shape is in README.md#settings. The command line overrides it.
SETTINGS ?= settings.mk
-include $(SETTINGS)

# ---- variables (all overridable: make smoke RUN=... HOSTFILE=...) ----------
# MODEL and CORPUS have no default: the demo's tiny model and sample corpus are `make demo`'s
# own, and never reach the Macs unless asked for by name.
RUN         ?= stage1
HOSTFILE    ?= hostfile.json
CORPUS      ?=
DATASET     ?= domain_sft_v1_high_signal_thunder
MODEL       ?=
CONFIG      ?= configs/stage1.yaml
REMOTE_ROOT ?= $(CURDIR)
PYTHON      ?= $(REMOTE_ROOT)/.venv/bin/python
ARCH        ?= gemma4
SEED        ?=
TINY_SEED   ?= 0
LAYOUT      ?= text
QUANT       ?=
TEMPLATE    ?= launch
HF_REPO     ?=
REVISION    ?=
QUANTIZE    ?=
HOSTS       ?= 2
JSON        ?=
WATCH       ?=
DEEP        ?=
DRY_RUN     ?=
SYNC_MODEL  ?=
RSYNC       ?=
RSYNC_PATH  ?=
RESUME      ?=
PYTEST_ARGS ?=
REPLACE     ?=
CONTROL_HOST ?=
WATCHDOG    ?=
RESTARTS    ?=
FALLBACK    ?=
PORT        ?=
SMOKE_CONFIG ?= configs/smoke.yaml
TOLERANCE   ?=
MIN_SPEEDUP ?=
MIN_GAIN    ?=
TEST_BATCHES ?=
SAMPLES     ?=
MAX_TOKENS  ?=
# The interpreter that builds .venv: the first Python >= 3.11 found, unless given.
BOOTSTRAP_PYTHON ?=

VENV   := .venv
PY     := $(VENV)/bin/python
STAMPS := .stamps
LIB    := $(wildcard lib/*.py)
LOCK   := requirements.lock

# ---- help --------------------------------------------------------------------
## help: list the targets (the default goal)
.PHONY: help
help:
	@echo "thunder-runbook: make <target> [VAR=value ...]"
	@echo
	@sed -n 's/^## \([^:]*\): \(.*\)/\1@@\2/p' $(MAKEFILE_LIST) | awk -F'@@' '{printf "  %-16s %s\n", $$1, $$2}'
	@echo
	@echo "Variables: RUN=$(RUN) HOSTFILE=$(HOSTFILE) DATASET=$(DATASET) MODEL=$(MODEL)"
	@echo "           CONFIG=$(CONFIG) CORPUS=$(CORPUS) REMOTE_ROOT=$(REMOTE_ROOT) PYTHON=$(PYTHON)"

# ---- environment ---------------------------------------------------------------
## setup: create .venv from requirements.lock (hash-checked); re-runs only when the lock changes
.PHONY: setup
setup: $(VENV)/.stamp

$(VENV)/.stamp: $(LOCK) bin/find_python.sh
	rm -rf $(VENV)
	"$$(bash bin/find_python.sh $(BOOTSTRAP_PYTHON))" -m venv $(VENV)
	@echo "setup: installing $(LOCK) into $(VENV) (hash-checked; seconds from uv's cache, a minute or two the first time)"
	awk '/^uv==/ {p = 1} p {print} p && !/\\$$/ {exit}' $(LOCK) > $(VENV)/uv.lock
	$(PY) -m pip install --quiet --disable-pip-version-check --require-hashes --no-deps -r $(VENV)/uv.lock
	$(VENV)/bin/uv pip install --quiet --python $(PY) --require-hashes --no-deps -r $(LOCK)
	$(VENV)/bin/uv pip check --python $(PY)
	touch $@

## lock: regenerate requirements.lock (hashed, universal: macOS arm64 + Linux x86_64, Python >= 3.11)
.PHONY: lock
lock: $(VENV)/.stamp
	$(VENV)/bin/uv pip compile --universal --generate-hashes --python-version 3.11 requirements.in -o $(LOCK)

$(STAMPS):
	mkdir -p $@

# ---- generated inputs ----------------------------------------------------------
## tiny-model: generate models/tiny-$(ARCH) (random weights, local BPE tokenizer; ARCH=gemma4|llama; LAYOUT=released, QUANT=4|8 and TEMPLATE=current add -released, -q4, -current)
.PHONY: tiny-model
tiny-model: models/tiny-$(ARCH)$(if $(filter released,$(LAYOUT)),-released)$(if $(QUANT),-q$(QUANT))$(if $(filter current,$(TEMPLATE)),-current)/config.json

# Not on $(LIB): the generator is deterministic and a rebuilt model (new mtime) would show as
# changed on every host; a change to the generator itself does rebuild it, and so does
# another TINY_SEED (its stamp is rewritten only when the seed changes).
# The folder name says what is in it: tiny-<arch>[-released][-q4|-q8][-current] (gemma4's chat template).
tiny_words = $(subst -, ,$*)
models/tiny-%/config.json: demo/make_tiny_model.py $(VENV)/.stamp $(STAMPS)/tiny-%.seed
	$(PY) demo/make_tiny_model.py --arch $(firstword $(tiny_words)) --seed $(TINY_SEED) --out models/tiny-$*$(if $(filter released,$(tiny_words)), --layout released)$(if $(filter q4 q8,$(tiny_words)), --quantize $(patsubst q%,%,$(filter q4 q8,$(tiny_words))))$(if $(filter current,$(tiny_words)), --template current)

.PRECIOUS: $(STAMPS)/tiny-%.seed
$(STAMPS)/tiny-%.seed: export TINY_SEED_VALUE = $(TINY_SEED)
$(STAMPS)/tiny-%.seed: FORCE | $(STAMPS)
	@printf '%s\n' "$$TINY_SEED_VALUE" > $@.tmp; if cmp -s $@.tmp $@; then rm -f $@.tmp; else mv -f $@.tmp $@; fi

## model: fetch HF_REPO from the Hugging Face Hub into MODEL (REVISION=tag|branch|commit, QUANTIZE=4|8 with mlx-lm's convert; provenance.json); REPLACE=1 replaces another model there
.PHONY: model
model: $(VENV)/.stamp
	$(call need,HF_REPO)$(call need,MODEL)$(PY) bin/model.py --repo $(HF_REPO) --out $(MODEL)$(if $(REVISION), --revision $(REVISION))$(if $(QUANTIZE), --quantize $(QUANTIZE))$(if $(REPLACE), --replace)

## sample-corpus: write datasets/sample/corpus.jsonl from CPython's pydoc_data.topics
.PHONY: sample-corpus
sample-corpus: datasets/sample/corpus.jsonl

datasets/sample/corpus.jsonl: demo/make_sample_corpus.py $(VENV)/.stamp
	$(PY) demo/make_sample_corpus.py --out $@

# ---- stages, in pipeline order -------------------------------------------------
## export: CORPUS -> datasets/$(DATASET)/ (mlx-lm chat JSONL, splits, manifest, rejects); REPLACE=1 replaces another corpus's dataset
# The only stage that writes a dataset: later stages never re-export. The same corpus and
# settings again is a no-op; another corpus into an existing dataset is refused unless REPLACE=1.
# CORPUS: files and/or globs ('data/*.jsonl.gz'). EXPORT_ARGS: more bin/export.py flags,
# e.g. EXPORT_ARGS='--field text=body --ratios 0.8,0.1,0.1'.
EXPORT_CONFIG ?= configs/export.yaml
EXPORT_ARGS   ?=
.PHONY: export
export: $(VENV)/.stamp $(filter datasets/sample/corpus.jsonl,$(CORPUS))
	$(call need,CORPUS)$(PY) bin/export.py $(CORPUS) --dataset $(DATASET) --config $(EXPORT_CONFIG)$(if $(REPLACE), --replace) $(EXPORT_ARGS)

# A stage that needs the dataset finds it exported, or says how to export it (never exports).
datasets/%/manifest.json:
	@echo "error: datasets/$*/manifest.json is missing: export the corpus first, make export CORPUS=<files> DATASET=$*; see RUNBOOK.md#export" >&2; exit 2

# A literal '#' for messages: 3.81 reads one inside a function call as a comment, 4.3+ does not.
HASH := \#
# `$(call need,VAR)`: stop, before anything runs, when VAR has no value (no settings file yet).
need = $(if $($(1)),,$(error $(1) is not set: put `$(1) = ...` in $(SETTINGS) or pass $(1)=... on the command line; see RUNBOOK.md$(HASH)settings))
# The demo's generated model never goes to the real Macs by default: with hostfile.json and
# no $(SETTINGS), a tiny model stops here.
guard_real = $(if $(and $(filter hostfile.json,$(HOSTFILE)),$(filter models/tiny-%,$(MODEL)),$(if $(wildcard $(SETTINGS)),,no)),$(error MODEL=$(MODEL) is the generated tiny model and HOSTFILE=hostfile.json names the real Macs: write $(SETTINGS) with your MODEL, CORPUS, DATASET, HOSTFILE, REMOTE_ROOT, PYTHON; see RUNBOOK.md$(HASH)settings))
# A stage's stamp stands only while its summary says PASS ("ok": true in runs/RUN/<stage>.json;
# the control's is runs/RUN-control/control.json): a removed or failed run re-runs its stage.
passed = $(shell grep -qs '^  "ok": true,\{0,1\}$$' $(1) && echo yes)
stale  = $(if $(call passed,$(1)),,FORCE)

.PHONY: FORCE
FORCE:

# check-parity and provision knobs: free disk needed at REMOTE_ROOT; the Python X.Y that
# provision builds venvs with on the hosts (default: found there); RECREATE=1 rebuilds them.
MIN_DISK_GB ?= 10
BASE_PYTHON ?=
RECREATE    ?=

## check-parity: preflight every host in HOSTFILE (JSON=1: one JSON object; DEEP=1: hash the model; exit 0/1/2/3)
# Phony: it is cheap and host state changes behind make's back. WARNING (exit 1) passes;
# with JSON=1 stdout is the JSON object alone.
.PHONY: check-parity
check-parity: $(VENV)/.stamp
	$(if $(JSON),@)$(PARITY_CMD)$(if $(JSON), --json)$(if $(DEEP), --deep) || [ $$? -eq 1 ]

## provision: create or repair PYTHON's venv on every host from requirements.lock, then check-parity's runtime gate
# Fresh hosts have no code, model or dataset yet: only the runtime gate runs here (sync comes next).
.PHONY: provision
provision: $(VENV)/.stamp | $(STAMPS)
	$(PY) bin/provision.py --hostfile $(HOSTFILE) --python $(PYTHON)$(if $(BASE_PYTHON), --base-python $(BASE_PYTHON))$(if $(RECREATE), --recreate)
	$(PARITY_CMD) --gate runtime || [ $$? -eq 1 ]

## sync: code + dataset (+ model with SYNC_MODEL=1) to REMOTE_ROOT on every host, verified by hash
# Always runs (a no-op sync is one hash probe per host): host state changes behind make's back.
.PHONY: sync
sync: datasets/$(DATASET)/manifest.json $(VENV)/.stamp
	$(call need,MODEL)$(guard_real)$(SYNC_CMD)$(if $(DRY_RUN), --dry-run)

# What smoke, train and control share: the launch flags, and the sync and parity
# commands they re-run before every launch (host state changes behind make's back).
CODE        := $(wildcard bin/*.py) $(LIB) $(wildcard configs/*.yaml) $(LOCK)
LAUNCH_ARGS  = --run $(RUN) --hostfile $(HOSTFILE) --model $(MODEL) --dataset $(DATASET) --remote-root $(REMOTE_ROOT) --python $(PYTHON)$(if $(SEED), --seed $(SEED))$(if $(WATCHDOG), --watchdog $(WATCHDOG))$(if $(PORT), --port $(PORT))
SYNC_CMD     = $(PY) bin/sync.py --hostfile $(HOSTFILE) --remote-root $(REMOTE_ROOT) --dataset $(DATASET) --model=$(MODEL) --run $(RUN)$(if $(SYNC_MODEL), --sync-model)$(if $(RSYNC), --rsync $(RSYNC))$(if $(RSYNC_PATH), --rsync-path $(RSYNC_PATH))
PARITY_ARGS  = --hostfile $(HOSTFILE) --python $(PYTHON) --remote-root $(REMOTE_ROOT) --model=$(MODEL) --dataset=$(DATASET) --config=$(CONFIG) --min-disk-gb $(MIN_DISK_GB)
PARITY_CMD   = $(PY) bin/check_parity.py $(PARITY_ARGS)

# macOS: Mac1's orchestrating train/control runs under caffeinate -i (idle sleep would stop the
# run); every rank keeps its own Mac awake (bin/train.py). Linux has none: the same recipe, bare.
CAFFEINATE_BIN ?= /usr/bin/caffeinate
CAFFEINATE   = $(if $(wildcard $(CAFFEINATE_BIN)),$(CAFFEINATE_BIN) -i )

RESTART_ARGS = $(if $(RESTARTS), --restarts $(RESTARTS))$(if $(FALLBACK), --fallback)

# check-parity exit 1 is WARNING (e.g. a slow link): reported, not blocking.
# Its own state dir (runs/RUN/parity: lock and last.json), so a cron check-parity holding
# runs/parity/.lock never stops a launch, and the run folder keeps the check that let it start.
# --run: one launch per run folder (no supervisor of RUN here, no rank of RUN on any host).
PARITY_GATE  = $(PARITY_CMD) --state-dir runs/$(RUN)/parity --run $(RUN) || [ $$? -eq 1 ]

## smoke: sync + check-parity, then a tiny run through mlx.launch: checkpoint, resume, criteria
.PHONY: smoke
smoke: $(STAMPS)/smoke.$(RUN)

$(STAMPS)/smoke.$(RUN): datasets/$(DATASET)/manifest.json $(CODE) $(SMOKE_CONFIG) $(HOSTFILE) $(VENV)/.stamp $(call stale,runs/$(RUN)/smoke.json) | $(STAMPS)
	$(call need,MODEL)$(guard_real)$(SYNC_CMD)
	$(PARITY_GATE)
	$(PY) bin/smoke.py --config $(SMOKE_CONFIG) --train-config $(CONFIG) $(LAUNCH_ARGS)
	touch $@

## train: the real run (CONFIG) after a passing smoke; RESUME=1 continues from the latest good checkpoint
.PHONY: train
train: $(STAMPS)/train.$(RUN)

$(STAMPS)/train.$(RUN): $(STAMPS)/smoke.$(RUN) $(CONFIG) $(call stale,runs/$(RUN)/train.json) | $(STAMPS)
	$(SYNC_CMD)
	$(PARITY_GATE)
	$(CAFFEINATE)$(PY) bin/run.py --stage train --config $(CONFIG) $(LAUNCH_ARGS)$(RESTART_ARGS)$(if $(RESUME), --resume)
	touch $@

## control: the single-host control (CONTROL_HOST, default rank 0's) on the same data, seed and global batch
.PHONY: control
control: $(STAMPS)/control.$(RUN)

$(STAMPS)/control.$(RUN): $(STAMPS)/smoke.$(RUN) $(CONFIG) $(call stale,runs/$(RUN)-control/control.json) | $(STAMPS)
	$(SYNC_CMD)
	$(PARITY_GATE)
	$(CAFFEINATE)$(PY) bin/run.py --stage control --config $(CONFIG) $(LAUNCH_ARGS)$(RESTART_ARGS)$(if $(CONTROL_HOST), --control-host $(CONTROL_HOST))
	touch $@

## compare: dual vs control vs base on the test split (TOLERANCE=0.02 MIN_SPEEDUP=1 MIN_GAIN=0 TEST_BATCHES=-1 SAMPLES=4 MAX_TOKENS=128); writes runs/$(RUN)/compare/
# Phony: evaluation is cheap and TOLERANCE may change; it always re-reads the run folders.
# Train and control are built when their stamp is missing, never re-run by compare (not even
# when code, config or hostfile changed since: retraining is `make train`'s decision).
.PHONY: compare
compare: $(VENV)/.stamp | $(if $(wildcard $(STAMPS)/train.$(RUN)),,$(STAMPS)/train.$(RUN)) $(if $(wildcard $(STAMPS)/control.$(RUN)),,$(STAMPS)/control.$(RUN))
	$(PY) bin/compare.py --run $(RUN)$(if $(TOLERANCE), --tolerance $(TOLERANCE))$(if $(MIN_SPEEDUP), --min-speedup $(MIN_SPEEDUP))$(if $(MIN_GAIN), --min-gain $(MIN_GAIN))$(if $(TEST_BATCHES), --test-batches $(TEST_BATCHES))$(if $(SAMPLES), --samples $(SAMPLES))$(if $(MAX_TOKENS), --max-tokens $(MAX_TOKENS))

## stop: stop RUN on every host (its supervisor, here or dead, then any rank left); the newest verified checkpoint stays for RESUME=1
.PHONY: stop
stop: $(VENV)/.stamp
	$(PY) bin/run.py --stop $(RUN)

## status: where RUN stands (step, ETA, loss, tok/s and last step per rank, checkpoint, failures, verdict); WATCH=N redraws; JSON=1; exit as check-parity
.PHONY: status
status:
	@$(PY) bin/status.py --run $(RUN) --remote-root $(REMOTE_ROOT) --python $(PYTHON)$(if $(JSON), --json)$(if $(WATCH), --watch $(WATCH)) || [ $$? -eq 1 ]

## calibrate: sync + check-parity, then per-host tok/s and memory, the all_sum curve and the expected speedup -> runs/calibration-<time>.json
# Phony: a measurement, not a build product. CALIBRATE_ARGS: more bin/calibrate.py flags,
# e.g. CALIBRATE_ARGS='--budget-s 300 --max-bytes 67108864' or '--skip-compute'.
CALIBRATE_ARGS ?=
.PHONY: calibrate
calibrate: datasets/$(DATASET)/manifest.json $(VENV)/.stamp
	$(call need,MODEL)$(guard_real)$(SYNC_CMD)
	$(PARITY_GATE)
	$(PY) bin/calibrate.py --hostfile $(HOSTFILE) --model $(MODEL) --config $(CONFIG) --remote-root $(REMOTE_ROOT) --python $(PYTHON)$(if $(PORT), --port $(PORT))$(if $(CALIBRATE_ARGS), $(CALIBRATE_ARGS))

## plan: the training plan JSON (coordinator format 2.0.0) from the hostfile, config, last check-parity and calibration -> runs/plan.json
.PHONY: plan
plan: $(VENV)/.stamp
	$(call need,MODEL)$(PY) bin/plan.py --run $(RUN) --hostfile $(HOSTFILE) --config $(CONFIG) --model $(MODEL) --dataset $(DATASET) --remote-root $(REMOTE_ROOT) --python $(PYTHON)$(if $(MIN_SPEEDUP), --min-speedup $(MIN_SPEEDUP))

## cron-line: print the crontab line for a check-parity of this checkout every EVERY minutes (JSON in runs/parity/, alert on a non-zero exit)
EVERY ?= 15
.PHONY: cron-line
cron-line: $(VENV)/.stamp
	@$(PY) bin/schedule.py cron-line --every-min $(EVERY) -- $(PARITY_ARGS)

## launchd-plist: write runs/parity/com.thunder-runbook.check-parity.plist, the same check as a launchd job (macOS's scheduler)
.PHONY: launchd-plist
launchd-plist: $(VENV)/.stamp
	$(PY) bin/schedule.py launchd-plist --every-min $(EVERY) -- $(PARITY_ARGS)

## demo: the whole chain on hostfile.local.json with the sample corpus and the tiny model; prints the report's path
# The demo's own dataset (datasets/demo) and model (models/tiny-gemma4): it never touches
# the operator's settings. Two ranks on one machine cannot be faster than one: the demo
# accepts any speedup (MIN_SPEEDUP=0) and the report still shows the measured one.
DEMO_RUN         ?= demo
DEMO_HOSTFILE    ?= hostfile.local.json
DEMO_REMOTE_ROOT ?= $(CURDIR)
DEMO_VARS = RUN=$(DEMO_RUN) HOSTFILE=$(DEMO_HOSTFILE) REMOTE_ROOT=$(DEMO_REMOTE_ROOT) \
	PYTHON=$(CURDIR)/$(VENV)/bin/python MODEL=models/tiny-gemma4 CONFIG=configs/demo.yaml \
	CORPUS=datasets/sample/corpus.jsonl DATASET=demo MIN_SPEEDUP=0 SETTINGS=/dev/null
# Before a minute goes on the venv, `make demo` checks what it needs besides make: a Python >= 3.11
# (bin/find_python.sh) and rsync (sync copies through it, to 127.0.0.1 too). Each missing one is
# named with the command that installs it (README.md#requirements).
ifneq ($(filter demo,$(MAKECMDGOALS)),)
demo_python := $(if $(shell bash bin/find_python.sh $(BOOTSTRAP_PYTHON) 2>/dev/null),,Python-3.11)
demo_rsync  := $(if $(RSYNC)$(shell command -v rsync 2>/dev/null),,rsync)
$(if $(demo_python),$(warning missing: Python >= 3.11 (with venv): install it with `sudo apt-get install -y python3 python3-venv` (Debian/Ubuntu) or `brew install python@3.12` (macOS), or name one with BOOTSTRAP_PYTHON=/path/to/python3))
$(if $(demo_rsync),$(warning missing: rsync: install it with `sudo apt-get install -y rsync` (Debian/Ubuntu); macOS ships it; or name one with RSYNC=/path/to/rsync))
$(if $(demo_python)$(demo_rsync),$(error make demo stopped before building anything: install what is missing (above); see README.md$(HASH)requirements))
endif
.PHONY: demo
demo: $(VENV)/.stamp
	$(MAKE) --no-print-directory tiny-model sample-corpus ARCH=gemma4
	$(MAKE) --no-print-directory export $(DEMO_VARS) REPLACE=1
	$(MAKE) --no-print-directory train control compare $(DEMO_VARS)
	@echo "demo: report at runs/$(DEMO_RUN)/compare/report.md (curves: runs/$(DEMO_RUN)/compare/loss_curves.png)"

# ---- test, bench, clean --------------------------------------------------------
## test: the whole test suite (pytest; the README's test command)
.PHONY: test
test: $(VENV)/.stamp
	$(PY) -m pytest $(PYTEST_ARGS)

## fabric-up: multi-host test fabric of HOSTS hosts (1-4; Linux, root); then `. runs/fabric/env.sh`
.PHONY: fabric-up
fabric-up: $(VENV)/.stamp
	$(PY) tests/fabric.py up --hosts $(HOSTS)

## fabric-down: remove every namespace, process, link and file fabric-up made
.PHONY: fabric-down
fabric-down:
	$(PY) tests/fabric.py down

## lint: ruff over bin/ lib/ tests/ bench/ demo/
.PHONY: lint
lint: $(VENV)/.stamp
	$(VENV)/bin/ruff check bin lib tests bench demo

## bench: build the tiny model and datasets/bench, then run bench/ (ratios against same-run baselines; BENCH_ARGS=--quick: each row once, smallest sizes)
BENCH_ARGS ?=
.PHONY: bench
bench: $(VENV)/.stamp
	$(PY) bench/run_all.py$(if $(BENCH_ARGS), $(BENCH_ARGS))

## clean: remove stamps and generated models (keeps .venv, datasets and runs)
.PHONY: clean
clean:
	rm -rf $(STAMPS) models
