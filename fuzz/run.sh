#!/usr/bin/env bash
# Builds the fuzz targets and runs each for SECONDS (default 60) on its corpus
# (fuzz/corpus/<target>), after replaying the reproducers kept in
# fuzz/regressions/<target>/. Exits non-zero if any target crashes, hangs or runs out
# of memory; libFuzzer saves the input under fuzz/artifacts/<target>/.
#
# Usage: fuzz/run.sh [SECONDS] [TARGET...]     (default: every target)
#
# Stable Rust only: RUSTC_BOOTSTRAP=1 lets cargo-fuzz pass its -Z flags (AddressSanitizer,
# sanitizer coverage) to the stable compiler; libfuzzer-sys compiles libFuzzer itself
# with the C++ compiler (g++). See fuzz/README.md.
set -euo pipefail
cd "$(dirname "$0")"

secs="${1:-60}"
shift || true
targets=("$@")
# A target with an unfixed crash in open-crashes/<target>/ leaves this list until it is
# fixed (fuzz/README.md, "Open crashes").
[[ ${#targets[@]} -gt 0 ]] || targets=(wire_decode blk_request pci_decode vhost_sequence)
export RUSTC_BOOTSTRAP=1

# libfuzzer-sys compiles libFuzzer (C++) with the cc crate: it needs a C++ compiler.
if ! command -v c++ >/dev/null 2>&1; then
	if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
		echo "fuzz: installing g++"
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends g++
	else
		echo "fuzz: needs a C++ compiler (apt-get install g++)" >&2
		exit 1
	fi
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
	echo "fuzz: installing cargo-fuzz"
	cargo install cargo-fuzz --locked
fi

# cargo-fuzz's default build: optimized, with debug assertions and overflow checks on
# (an arithmetic overflow on guest or peer input is a crash), under AddressSanitizer.
cargo fuzz build

failed=()
for t in "${targets[@]}"; do
	mkdir -p "corpus/$t" "artifacts/$t"
	shopt -s nullglob
	repro=(regressions/"$t"/*)
	shopt -u nullglob
	if [[ ${#repro[@]} -gt 0 ]]; then
		echo "== fuzz $t: replaying ${#repro[@]} regression input(s)"
		if ! cargo fuzz run "$t" "${repro[@]}" -- -runs=1 >"artifacts/$t/regressions.log" 2>&1; then
			cat "artifacts/$t/regressions.log"
			failed+=("$t (regressions)")
			continue
		fi
	fi
	echo "== fuzz $t: ${secs}s"
	if ! cargo fuzz run "$t" "corpus/$t" -- \
		-max_total_time="$secs" -max_len=4096 -timeout=10 \
		-artifact_prefix="artifacts/$t/" -print_final_stats=1; then
		failed+=("$t")
	fi
done

if [[ ${#failed[@]} -gt 0 ]]; then
	echo "fuzz: FAILED: ${failed[*]} (inputs in fuzz/artifacts/)" >&2
	exit 1
fi
echo "fuzz: ${targets[*]}: no crash in ${secs}s each"
