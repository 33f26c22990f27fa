# DeltaBox: every target installs what it needs first; all are idempotent.
SHELL := /bin/bash
PYTHON ?= /root/.pyenv/versions/3.11.7/bin/python3
VENV := .venv
PY := $(VENV)/bin/python
CC ?= gcc
CFLAGS ?= -O2 -g -Wall -Wextra -Werror -std=gnu11 -D_GNU_SOURCE
LIBEXEC := deltabox/libexec
NATIVE_BINS := $(LIBEXEC)/dbx-init $(LIBEXEC)/dbx-enter $(LIBEXEC)/dbx-mkroot $(LIBEXEC)/libdbxcr.so
PROTO_OUT := deltabox/api/deltabox_pb2.py

.PHONY: install deps venv native proto demo test bench bench-all clean dbxcr-sources
install: deps venv native proto

deps:
	@bash scripts/install-deps.sh

venv: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || { p=$(PYTHON); command -v $$p >/dev/null || p=python3; $$p -m venv $(VENV); }
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

native: $(NATIVE_BINS)
# libdbxcr.so's sources: the one list (native/tests/run.sh and tests/conftest.py read it).
DBXCR_SRCS := native/fork_template.c native/threads.c native/timers.c native/dontfork.c \
	native/criu_incr.c native/ptrace_jobs.c native/ipcns.c native/prctls.c native/batch.c native/creds.c \
	native/reap_unseen.c native/orphan.c
dbxcr-sources:
	@echo $(DBXCR_SRCS)
$(LIBEXEC)/libdbxcr.so: $(DBXCR_SRCS) native/fork_template.h native/criu_incr.h \
		native/dbxcr_internal.h
	@mkdir -p $(LIBEXEC)
	$(CC) $(CFLAGS) -pthread -fPIC -shared -o $@ $(DBXCR_SRCS)
$(LIBEXEC)/dbx-%: native/%.c native/common.c native/common.h
	@mkdir -p $(LIBEXEC)
	$(CC) $(CFLAGS) -static -o $@ $< native/common.c

proto: $(PROTO_OUT)
$(PROTO_OUT): deltabox/api/deltabox.proto $(VENV)/.installed
	$(PY) -m grpc_tools.protoc -I deltabox/api --python_out=deltabox/api \
	  --grpc_python_out=deltabox/api --pyi_out=deltabox/api deltabox/api/deltabox.proto
	sed -i 's/^import deltabox_pb2 as/from . import deltabox_pb2 as/' deltabox/api/deltabox_pb2_grpc.py

demo: install
	$(PY) -m deltabox.demo

test: install
	bash native/tests/run.sh
	$(PY) -m pytest -q tests

# bench: the SWE-bench trajectory replay's short version (under 10 minutes here); bench-all:
# every benchmark's quick version (about 25 minutes).
bench: install
	$(PY) -m benchmarks.swebench.run --quick --out benchmarks/out/swebench

bench-all: install
	$(PY) -m benchmarks.fs_cr --quick
	$(PY) -m benchmarks.process_cr --quick
	$(PY) -m benchmarks.long_session
	$(PY) -m benchmarks.search_step
	$(PY) -m benchmarks.branch_rollback
	$(PY) -m benchmarks.neighbours --quick
	$(PY) -m benchmarks.process_kinds
	$(PY) -m benchmarks.notebook --reps 5
	$(PY) -m benchmarks.postgres_cr --reps 5
	$(PY) -m benchmarks.postgres_cr --server mariadb --reps 5
	$(PY) -m benchmarks.swebench.run --quick --out benchmarks/out/swebench

clean:
	rm -rf $(LIBEXEC) $(PROTO_OUT) deltabox/api/deltabox_pb2_grpc.py build
