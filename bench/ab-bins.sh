#!/usr/bin/env bash
# Alternated A/B of the block I/O path between two builds' device agent and compute
# agent: one attachment (2 queues) on a 1 GiB file in /dev/shm (random bytes), `devlend bench` through
# its vhost-user-blk socket, with both agents' CPU measured (`--pid`). The builds
# alternate, the first one changing from round to round, so that a noisy machine weighs
# on both alike. Prints each run, then per workload the medians of IOPS, p50 latency
# (µs) and CPU per request (µs, both agents), and after/before of each
# (docs/performance.md, "How to compare two builds").
#
# usage: bench/ab-bins.sh BEFORE_BIN_DIR AFTER_BIN_DIR [ROUNDS]
#   BIN_DIR holds devlend, devlend-device-agent and devlend-compute-agent (a
#   target/release directory). ROUNDS defaults to 6.
# Environment:
#   AB_RUNTIME   seconds per workload after a 1 s ramp (5)
#   AB_CLIENT    the `devlend` that runs the benchmark for both builds (AFTER's), so
#                that only the agents differ; each build attaches with its own CLI
#   AB_WORKLOADS workloads, "RW BS QD [QUEUES]" separated by commas; QUEUES of the
#                2 the attachment has, 2 by default ("randread 4K 32,randwrite 4K 32,
#                read 128K 8,randread 4K 1 1": QD1 on one queue is one request at a time)
#   AB_RESULTS   where the runs are written as TSV (a temporary file)
#   AB_SIZE_MIB  the file's size in MiB (1024)
#   AB_LENDER_ARGS_BEFORE, AB_LENDER_ARGS_AFTER, AB_ATTACH_ARGS_BEFORE,
#   AB_ATTACH_ARGS_AFTER
#                more arguments for each build's device agent and `devlend attach`
#                (split on spaces): one build twice, with and without a flag, is an
#                A/B of that flag (`--poll-us 50`)
set -euo pipefail

usage="usage: ab-bins.sh BEFORE_BIN_DIR AFTER_BIN_DIR [ROUNDS]"
before=${1:?$usage}
after=${2:?$usage}
rounds=${3:-6}
runtime=${AB_RUNTIME:-5}
client=${AB_CLIENT:-$after/devlend}
for d in "$before" "$after"; do
    for b in devlend devlend-device-agent devlend-compute-agent; do
        [ -x "$d/$b" ] || { echo "ab-bins: no $d/$b" >&2; exit 2; }
    done
done
work=$(mktemp -d /tmp/devlend-ab.XXXXXX)
image=/dev/shm/devlend-ab-$$.img
results=${AB_RESULTS:-$work/results.tsv}
: >"$results"
pids=()

cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -f "$image"
}
trap cleanup EXIT

size_mib=${AB_SIZE_MIB:-1024}
# Written once so reads hit real pages, not a sparse file's holes.
dd if=/dev/urandom of="$image" bs=1M count="$size_mib" status=none

IFS=, read -r -a workloads <<<"${AB_WORKLOADS:-randread 4K 32,randwrite 4K 32,read 128K 8,randread 4K 1 1}"

# run_build LABEL BIN_DIR ROUND: one lender and one borrower of that build, every workload.
run_build() {
    local label=$1 bin=$2 round=$3
    local dir=$work/$label-$round port lender_args attach_args
    if [ "$label" = before ]; then
        read -r -a lender_args <<<"${AB_LENDER_ARGS_BEFORE:-}"
        read -r -a attach_args <<<"${AB_ATTACH_ARGS_BEFORE:-}"
    else
        read -r -a lender_args <<<"${AB_LENDER_ARGS_AFTER:-}"
        read -r -a attach_args <<<"${AB_ATTACH_ARGS_AFTER:-}"
    fi
    mkdir -p "$dir"
    port=$((47100 + RANDOM % 800))
    "$bin/devlend-device-agent" --listen "127.0.0.1:$port" --device "disk0=$image" \
        "${lender_args[@]}" >"$dir/lender.log" 2>&1 &
    local lender=$!
    "$bin/devlend-compute-agent" --api "$dir/api.sock" >"$dir/borrower.log" 2>&1 &
    local borrower=$!
    pids=("$lender" "$borrower")
    for _ in $(seq 50); do [ -S "$dir/api.sock" ] && break; sleep 0.1; done
    # The lender listens (an attach before that is refused).
    for _ in $(seq 50); do (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break; sleep 0.1; done
    "$bin/devlend" --api "$dir/api.sock" attach --lender "127.0.0.1:$port" --device disk0 \
        --socket "$dir/d.sock" --queues 2 "${attach_args[@]}" >/dev/null
    for w in "${workloads[@]}"; do
        local rw bs qd nq name out
        read -r rw bs qd nq <<<"$w"
        nq=${nq:-2}
        name="$rw $bs QD$qd"
        [ "$nq" = 2 ] || name="$name ${nq}q"
        out=$("$client" bench --socket "$dir/d.sock" --rw "$rw" --bs "$bs" \
            --iodepth "$qd" --queues "$nq" --runtime "$runtime" --ramp 1 \
            --pid "$lender" --pid "$borrower" --json)
        local figures
        figures=$(python3 -c '
import json, sys
r = json.load(sys.stdin)
cpu = r.get("cpu_us_per_io")
print("%s\t%s\t%s" % (r["figures"]["iops"], r["figures"]["latency"]["p50_us"], "" if cpu is None else cpu))' <<<"$out")
        printf '%s\t%s\t%s\t%s\n' "$round" "$label" "$name" "$figures" | tee -a "$results"
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

python3 - "$results" <<'PY'
import collections, statistics, sys
runs = collections.defaultdict(lambda: ([], [], []))
for line in open(sys.argv[1]):
    _, label, workload, iops, p50, cpu = line.rstrip("\n").split("\t")
    r = runs[(workload, label)]
    r[0].append(float(iops))
    r[1].append(float(p50))
    if cpu:
        r[2].append(float(cpu))

def med(v):
    return statistics.median(v) if v else float("nan")

metrics = (("IOPS", 0, 0), ("p50 µs", 1, 1), ("CPU µs/IO", 2, 1))
print("\nmedians, after/before (IOPS: higher is better; p50 and CPU per request: lower)")
head = f"{'workload':18}"
for name, _, _ in metrics:
    head += f" {name + ' before':>17} {'after':>9} {'ratio':>6}"
print(head)
for workload in dict.fromkeys(w for w, _ in runs):
    b, a = runs[(workload, "before")], runs[(workload, "after")]
    line = f"{workload:18}"
    for _, i, digits in metrics:
        mb, ma = med(b[i]), med(a[i])
        ratio = ma / mb if mb else float("nan")
        line += f" {mb:17.{digits}f} {ma:9.{digits}f} {ratio:6.3f}"
    print(line)
PY
