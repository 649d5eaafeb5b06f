#!/usr/bin/env bash
# Alternated A/B of the block I/O path: two builds' device agent and compute agent, one
# attachment (2 queues) on a 1 GiB file in /dev/shm, `devlend bench` through its
# vhost-user-blk socket. The builds alternate, the first one changing from round to
# round, so that a noisy machine weighs on both alike. Prints each run, then the medians
# and the ratio after/before per workload (docs/performance.md).
#
# usage: contrib/ab-bench.sh BEFORE_BIN_DIR AFTER_BIN_DIR [ROUNDS]
#   BIN_DIR holds devlend, devlend-device-agent and devlend-compute-agent (a
#   target/release directory). ROUNDS defaults to 6.
# Workloads: 4K randread QD32, 4K randwrite QD32, 128K read QD8; 5 s each after 1 s ramp.
set -euo pipefail

before=${1:?usage: ab-bench.sh BEFORE_BIN_DIR AFTER_BIN_DIR [ROUNDS]}
after=${2:?usage: ab-bench.sh BEFORE_BIN_DIR AFTER_BIN_DIR [ROUNDS]}
rounds=${3:-6}
runtime=${AB_RUNTIME:-5}
work=$(mktemp -d /tmp/devlend-ab.XXXXXX)
image=/dev/shm/devlend-ab-$$.img
results=$work/results.tsv
pids=()

cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -f "$image"
}
trap cleanup EXIT

truncate -s 1G "$image"
# Written once so reads hit real pages, not the sparse file's holes.
dd if=/dev/urandom of="$image" bs=1M count=1024 conv=notrunc status=none

workloads=("randread 4K 32" "randwrite 4K 32" "read 128K 8")

# run_build LABEL BIN_DIR ROUND: one lender and one borrower of that build, every workload.
run_build() {
    local label=$1 bin=$2 round=$3
    local dir=$work/$label-$round port
    mkdir -p "$dir"
    port=$((47100 + RANDOM % 800))
    "$bin/devlend-device-agent" --listen "127.0.0.1:$port" --device "disk0=$image" \
        >"$dir/lender.log" 2>&1 &
    local lender=$!
    "$bin/devlend-compute-agent" --api "$dir/api.sock" >"$dir/borrower.log" 2>&1 &
    local borrower=$!
    pids=("$lender" "$borrower")
    for _ in $(seq 50); do [ -S "$dir/api.sock" ] && break; sleep 0.1; done
    "$bin/devlend" --api "$dir/api.sock" attach --lender "127.0.0.1:$port" --device disk0 \
        --socket "$dir/d.sock" --queues 2 >/dev/null
    for w in "${workloads[@]}"; do
        read -r rw bs qd <<<"$w"
        local out
        out=$("$bin/devlend" bench --socket "$dir/d.sock" --rw "$rw" --bs "$bs" \
            --iodepth "$qd" --queues 2 --runtime "$runtime" --ramp 1 --json)
        local iops
        iops=$(python3 -c 'import json,sys; print(json.load(sys.stdin)["figures"]["iops"])' <<<"$out")
        printf '%s\t%s\t%s %s QD%s\t%s\n' "$round" "$label" "$rw" "$bs" "$qd" "$iops" | tee -a "$results"
    done
    kill "$borrower" "$lender" 2>/dev/null || true
    wait "$borrower" "$lender" 2>/dev/null || true
    pids=()
}

for r in $(seq "$rounds"); do
    if ((r % 2)); then
        run_build before "$before" "$r"
        run_build after "$after" "$r"
    else
        run_build after "$after" "$r"
        run_build before "$before" "$r"
    fi
done

python3 - "$results" <<'EOF'
import statistics, sys, collections
runs = collections.defaultdict(list)
for line in open(sys.argv[1]):
    _, label, workload, iops = line.rstrip("\n").split("\t")
    runs[(workload, label)].append(float(iops))
print("\nworkload                 before IOPS   after IOPS   after/before (medians)")
for workload in dict.fromkeys(w for w, _ in runs):
    b = statistics.median(runs[(workload, "before")])
    a = statistics.median(runs[(workload, "after")])
    print(f"{workload:22} {b:12.0f} {a:12.0f} {a / b:10.3f}")
EOF
