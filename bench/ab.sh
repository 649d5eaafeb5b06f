#!/usr/bin/env bash
# A/B of the block I/O path: the build of commit REV against the working tree (with its
# uncommitted changes), alternated round by round (bench/ab-bins.sh), each build with its
# own lender and borrower. Prints every run, then per workload the medians of IOPS,
# p50 latency and CPU per request, and the ratios working-tree/REV.
#
# usage: bench/ab.sh REV [ROUNDS]
#   REV     a commit (bed76ca, HEAD~1, a tag); ROUNDS defaults to 6.
# REV is built in a git worktree under $AB_CACHE (/var/tmp/devlend-ab), once: its
# binaries are kept for the next run (`git worktree remove` frees it). The working tree
# is built with `cargo build --release`. Both builds take a few minutes each on 2 cores.
# The environment variables of bench/ab-bins.sh apply (AB_RUNTIME, AB_WORKLOADS, ...);
# the working tree's `devlend` runs the benchmark for both builds.
set -euo pipefail

usage="usage: bench/ab.sh REV [ROUNDS]"
rev=${1:?$usage}
rounds=${2:-6}
here=$(cd "$(dirname "$0")/.." && pwd)
bins=(devlend devlend-device-agent devlend-compute-agent)
sha=$(git -C "$here" rev-parse --verify --quiet "$rev^{commit}") ||
    { echo "ab: $rev is not a commit here" >&2; exit 2; }
tree=${AB_CACHE:-/var/tmp/devlend-ab}/$sha

# build DIR TARGET_DIR: the three binaries of the workspace at DIR.
build() {
    local args=()
    for b in "${bins[@]}"; do args+=(--bin "$b"); done
    (cd "$1" && CARGO_TARGET_DIR=$2 cargo build --release --quiet "${args[@]}")
}

# built DIR: whether DIR holds all three binaries.
built() {
    for b in "${bins[@]}"; do [ -x "$1/$b" ] || return 1; done
}

if ! built "$tree/target/release"; then
    if [ ! -d "$tree/src" ]; then
        mkdir -p "$tree"
        git -C "$here" worktree add --quiet --detach "$tree/src" "$sha"
    fi
    echo "ab: building $rev ($sha) in $tree/src" >&2
    build "$tree/src" "$tree/target"
fi
echo "ab: building the working tree ($here)" >&2
build "$here" "${CARGO_TARGET_DIR:-$here/target}"

echo "ab: before = $rev ($sha), after = the working tree ($(git -C "$here" describe --always --dirty))" >&2
AB_CLIENT=${AB_CLIENT:-${CARGO_TARGET_DIR:-$here/target}/release/devlend} \
    exec bash "$here/bench/ab-bins.sh" "$tree/target/release" \
    "${CARGO_TARGET_DIR:-$here/target}/release" "$rounds"
