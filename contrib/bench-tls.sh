#!/usr/bin/env bash
# Plain TCP vs TLS, same machine, same run: two lenders (one plain, one with
# --tls-cert/--tls-key) lending a file each in /dev/shm to one compute agent, one
# attachment on each, then `devlend bench` on each socket in turn, each workload run
# on both back to back. Prints one line per workload with the TLS/plain ratios.
# Usage: contrib/bench-tls.sh [RUNTIME_S]   (after cargo build --release --workspace)
set -euo pipefail
runtime=${1:-5}
bin=$(cd "$(dirname "$0")/.." && pwd)/target/release
dir=$(mktemp -d /dev/shm/devlend-bench-tls.XXXXXX)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$dir"; }
trap cleanup EXIT
cd "$dir"

openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 \
  -subj "/CN=bench CA" -keyout ca.key -out ca.crt 2>/dev/null
openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=localhost" \
  -keyout lender.key -out lender.csr 2>/dev/null
openssl x509 -req -in lender.csr -CA ca.crt -CAkey ca.key -days 2 -out lender.crt \
  -extfile <(printf "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth") 2>/dev/null

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
plain=127.0.0.1:$(free_port)
tls=127.0.0.1:$(free_port)
for f in plain tls; do head -c 512M /dev/zero > "$f.img"; done

"$bin/devlend-device-agent" --listen "$plain" --device disk0="$dir/plain.img" --log-level warn 2> plain.log & pids+=($!); lp=$!
"$bin/devlend-device-agent" --listen "$tls" --device disk0="$dir/tls.img" --log-level warn \
  --tls-cert lender.crt --tls-key lender.key 2> tls.log & pids+=($!); lt=$!
"$bin/devlend-compute-agent" --api "$dir/api.sock" --tls-ca ca.crt --log-level warn 2> compute.log & pids+=($!); cp=$!
for _ in $(seq 100); do [ -S "$dir/api.sock" ] && break; sleep 0.1; done
sleep 0.5
dl() { "$bin/devlend" --api "$dir/api.sock" "$@"; }
dl attach --lender "$plain" --device disk0 --socket "$dir/plain.sock" --queues 2 --json > /dev/null
dl attach --lender "$tls" --device disk0 --socket "$dir/tls.sock" --queues 2 --json --tls > /dev/null

run() { # label, socket, lender pid, args...
  local sock=$2 pid=$3; shift 3
  dl bench --socket "$sock" --pid "$pid" --pid "$cp" --runtime "$runtime" --ramp 1 --json "$@"
}
printf '%-28s %12s %12s %7s %10s %10s %7s %s\n' workload plain_iops tls_iops ratio plain_MB/s tls_MB/s ratio "p50 us plain/tls, CPU us/IO plain/tls"
for w in "--rw randread --bs 4K --iodepth 1" "--rw randread --bs 4K --iodepth 32" \
         "--rw randwrite --bs 4K --iodepth 32" "--rw read --bs 128K --iodepth 8" \
         "--rw write --bs 128K --iodepth 8" "--rw randread --bs 4K --iodepth 32 --queues 2"; do
  # shellcheck disable=SC2086
  p=$(run plain "$dir/plain.sock" "$lp" $w)
  # shellcheck disable=SC2086
  t=$(run tls "$dir/tls.sock" "$lt" $w)
  jq -rn --argjson p "$p" --argjson t "$t" --arg w "$w" '
    def cpu(r): (r.cpu_us_per_io // 0);
    [$w, ($p.figures.iops|floor), ($t.figures.iops|floor), (($t.figures.iops/$p.figures.iops)*100|round/100),
     ($p.figures.mb_per_s*10|round/10), ($t.figures.mb_per_s*10|round/10), (($t.figures.mb_per_s/$p.figures.mb_per_s)*100|round/100),
     "\(($p.figures.latency.p50_us*10|round/10))/\(($t.figures.latency.p50_us*10|round/10)), \((cpu($p)*10|round/10))/\((cpu($t)*10|round/10))"]
    | @tsv' | awk -F'\t' '{printf "%-28s %12s %12s %7s %10s %10s %7s %s\n",$1,$2,$3,$4,$5,$6,$7,$8}'
done
dl detach "$dir/plain.sock" --json > /dev/null
dl detach "$dir/tls.sock" --json > /dev/null
