#!/bin/bash
# Build libdbxcr.so (production flags) and the fork_template C tests (ASan + UBSan), then
# run the tests.  Needs root.  Exits non-zero on any build or test failure.
set -euo pipefail
cd "$(dirname "$0")/../.."
CC=${CC:-gcc}
BASE=(-O2 -g -Wall -Wextra -Werror -std=gnu11 -D_GNU_SOURCE)
mkdir -p deltabox/libexec build/native-tests

# libdbxcr.so's sources, as the Makefile lists them (DBXCR_SRCS): one list to keep.
read -r -a SRCS <<< "$(make -s --no-print-directory dbxcr-sources)"

"$CC" "${BASE[@]}" -pthread -fPIC -shared -o deltabox/libexec/libdbxcr.so "${SRCS[@]}"

"$CC" "${BASE[@]}" -O1 -fno-omit-frame-pointer -fsanitize=address,undefined \
	-fno-sanitize-recover=undefined -pthread \
	-o build/native-tests/test_fork_template native/tests/test_fork_template.c "${SRCS[@]}"

"$CC" "${BASE[@]}" -O1 -fno-omit-frame-pointer -fsanitize=address,undefined \
	-fno-sanitize-recover=undefined -pthread \
	-o build/native-tests/test_criu_incr native/tests/test_criu_incr.c "${SRCS[@]}"
# The process the image tests dump and restore: no sanitizer runtime in it.
"$CC" "${BASE[@]}" -o build/native-tests/criu_target native/tests/criu_target.c
# A static program a held chain's ancestors exec to drop an address space (never run).
"$CC" "${BASE[@]}" -static -o build/native-tests/exec_stub native/tests/exec_stub.c

# LeakSanitizer stops the world with ptrace at exit; our forked tracees must not inherit
# its handling, and a tracee of ours must not be considered by it: children _exit().
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
build/native-tests/test_fork_template
exec build/native-tests/test_criu_incr build/native-tests/criu_target
