#!/usr/bin/env bash
# Scale of lenders and one compute agent (docs/performance.md, "Scale"): N disks (sparse
# files in /dev/shm), each attached once with QUEUES queues, spread over LENDERS lenders
# (disk i on lender i % LENDERS), so the compute agent holds N attachments. Prints, for
# every agent: RSS, threads, open descriptors and CPU over an idle minute; the time the N
# attaches took; and attachment 0's 4K randread QD1 p50 alone (before the others) and
# among the N-1 idle others.
#
# usage: contrib/scale.sh [N] [BIN_DIR]
#   N defaults to 1000; BIN_DIR (holding devlend, devlend-device-agent and
#   devlend-compute-agent) to target/release. IDLE_S (default 60) is the idle window.
#   POLL_US (default: unset, each agent's default) is the lenders' and every
#   attachment's --poll-us; with WARM_S
#   (default 0) each attachment first serves WARM_S seconds of 4K QD1 reads, so that
#   every worker has polled before the idle window. QUEUES (default 1) is each disk's
#   queue count, LENDERS (default 1) the number of lenders. With FRONTENDS=1 every
#   attachment but 0 gets a frontend (tests' devlend-idle-frontends: a VMM whose guest
#   set up every queue and kicked it once, then submits nothing), so that every queue's
#   fabric session is open; without, an attachment holds only its holding session
#   until a VMM connects.
set -euo pipefail

n=${1:-1000}
bin=${2:-target/release}
idle=${IDLE_S:-60}
poll=${POLL_US:-}
warm=${WARM_S:-0}
queues=${QUEUES:-1}
frontends=${FRONTENDS:-0}
nl=${LENDERS:-1}
work=$(mktemp -d /tmp/devlend-scale.XXXXXX)
shm=/dev/shm/devlend-scale-$$
pids=()

cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$shm"
}
trap cleanup EXIT

mkdir -p "$shm"
base=$((47000 + RANDOM % 800))
lenders=()
ports=()
for l in $(seq 0 $((nl - 1))); do
    port=$((base + l))
    ports+=("$port")
    {
        echo "listen = \"127.0.0.1:$port\""
        # Each disk: one session per queue and the holding session.
        echo "max_sessions = $(((n / nl + 1) * (queues + 1) + 16))"
        echo 'io_mode = "sync"'
        [ -z "$poll" ] || echo "poll_us = $poll"
        for i in $(seq "$l" "$nl" $((n - 1))); do
            truncate -s 64M "$shm/d$i.img"
            printf '[[device]]\nname = "d%s"\npath = "%s/d%s.img"\n' "$i" "$shm" "$i"
        done
    } >"$work/lender$l.toml"
done
dd if=/dev/urandom of="$shm/d0.img" bs=1M count=64 conv=notrunc status=none

for l in $(seq 0 $((nl - 1))); do
    "$bin/devlend-device-agent" --config "$work/lender$l.toml" >"$work/lender$l.log" 2>&1 &
    lenders+=("$!")
done
"$bin/devlend-compute-agent" --api "$work/api.sock" >"$work/borrower.log" 2>&1 &
borrower=$!
pids=("${lenders[@]}" "$borrower")
for _ in $(seq 100); do [ -S "$work/api.sock" ] && break; sleep 0.1; done

attach() {
    "$bin/devlend" --api "$work/api.sock" attach --lender "127.0.0.1:${ports[$(($1 % nl))]}" \
        --device "d$1" --socket "$work/d$1.sock" --queues "$queues" ${poll:+--poll-us "$poll"} >/dev/null
}
qd1_p50() {
    "$bin/devlend" bench --socket "$work/d0.sock" --rw randread --bs 4K --iodepth 1 \
        --runtime 5 --ramp 1 --json |
        python3 -c 'import json,sys; print(round(json.load(sys.stdin)["figures"]["latency"]["p50_us"], 1))'
}
# proc_figures PID: RSS in MiB, threads, descriptors.
proc_figures() {
    local rss threads fds
    rss=$(awk '/^VmRSS:/ {printf "%.1f", $2 / 1024}' "/proc/$1/status")
    threads=$(awk '/^Threads:/ {print $2}' "/proc/$1/status")
    fds=$(find "/proc/$1/fd" -mindepth 1 -maxdepth 1 | wc -l)
    echo "$rss $threads $fds"
}
# cpu_ticks PID: user + system clock ticks so far.
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }

attach 0
alone=$(qd1_p50)
start=$(date +%s.%N)
for i in $(seq 1 $((n - 1))); do attach "$i"; done
took=$(python3 -c "import sys; print(round($(date +%s.%N) - $start, 1))")
if [ "$frontends" = 1 ] && [ "$n" -gt 1 ]; then
    socks=()
    for i in $(seq 1 $((n - 1))); do socks+=("$work/d$i.sock"); done
    mkfifo "$work/hold"
    "$bin/devlend-idle-frontends" "$queues" "${socks[@]}" <"$work/hold" >"$work/frontends.out" 2>&1 &
    pids+=("$!")
    exec 9>"$work/hold"
    for _ in $(seq 600); do grep -q DEVLEND-READY "$work/frontends.out" && break; sleep 0.5; done
    grep DEVLEND-READY "$work/frontends.out" || { cat "$work/frontends.out"; exit 1; }
fi
if [ "$warm" != 0 ]; then
    for i in $(seq 0 $((n - 1))); do
        "$bin/devlend" bench --socket "$work/d$i.sock" --rw randread --bs 4K --iodepth 1 \
            --runtime "$warm" --ramp 0 >/dev/null
    done
fi
sleep 5
l0=()
for p in "${lenders[@]}"; do l0+=("$(cpu_ticks "$p")"); done
b0=$(cpu_ticks "$borrower")
sleep "$idle"
l1=()
for p in "${lenders[@]}"; do l1+=("$(cpu_ticks "$p")"); done
b1=$(cpu_ticks "$borrower")
hz=$(getconf CLK_TCK)
among=$(qd1_p50)

read -r brss bthr bfd <<<"$(proc_figures "$borrower")"
pct() { python3 -c "print(round(100 * ($2 - $1) / $hz / $idle, 2))"; }
echo
echo "N = $n disks of $queues queue(s), $nl lender(s), frontends $frontends, one compute agent ($(nproc) CPUs: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')), poll_us ${poll:-default}, warm-up ${warm} s each"
echo "attach of disks 1..$((n - 1)), one after another: $took s"
printf '%-14s %9s %8s %12s %14s\n' agent "RSS MiB" threads descriptors "idle CPU %"
for l in $(seq 0 $((nl - 1))); do
    read -r lrss lthr lfd <<<"$(proc_figures "${lenders[$l]}")"
    printf '%-14s %9s %8s %12s %14s\n' "lender $l" "$lrss" "$lthr" "$lfd" "$(pct "${l0[$l]}" "${l1[$l]}")"
done
printf '%-14s %9s %8s %12s %14s\n' compute-agent "$brss" "$bthr" "$bfd" "$(pct "$b0" "$b1")"
echo "attachment 0, 4K randread QD1 p50: alone $alone µs, among $((n - 1)) idle others $among µs"
