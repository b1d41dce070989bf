#!/usr/bin/env bash
# train_gpt's live metrics read by a real Prometheus server (ctest's metrics_prometheus):
#   prometheus.sh TRAIN_GPT TEXT_FILE DIR
# starts, all on 127.0.0.1 and on free ports, train_gpt --devices host:2@speed=1,0.5 --metrics-port P
# --metrics-file DIR/textfile/train_gpt.prom, node_exporter with only its textfile collector over
# that folder, and prometheus scraping both every second (config and data under DIR). Then:
# promtool check metrics accepts the endpoint's exposition and the textfile; Prometheus's HTTP API
# has, for each device, from the endpoint and through node_exporter, a busy ratio in (0, 1] and
# memory in use <= peak (<= capacity where one is known), rows and tokens counters, the faster
# device's larger shard weight and row count; the job's tokens counter increases between scrapes. Every daemon and the trainer are stopped at the end,
# also on failure or a signal. Skipped (exit 77) with the reason when Debian's prometheus or
# prometheus-node-exporter is not installed (scripts/setup.sh lists them as optional); installs
# nothing.
set -euo pipefail
exe=$1 text=$2 dir=$3
for tool in prometheus promtool prometheus-node-exporter python3; do
  command -v "$tool" >/dev/null || { echo "SKIP: no $tool (Debian: prometheus, prometheus-node-exporter; scripts/setup.sh installs them where it can)"; exit 77; }
done
rm -rf "$dir" && mkdir -p "$dir/textfile" "$dir/data"
start_s=$(date +%s.%N)
pids=()
stop_all() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
}
trap stop_all EXIT
trap 'exit 1' INT TERM HUP
fail() { echo "FAIL: $*" >&2; for f in "$dir"/*.log; do echo "---- $f" >&2; tail -20 "$f" >&2; done; exit 1; }
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
trainer_port=$(free_port) exporter_port=$(free_port) prometheus_port=$(free_port)

"$exe" --data "$text" --n-layer 1 --n-head 2 --n-embd 16 --block-size 8 --batch-size 4 --iters 1000000 --eval-every 0 \
  --eval-iters 1 --log-every 1000000 --devices host:2@speed=1,0.5 --metrics-port "$trainer_port" \
  --metrics-file "$dir/textfile/train_gpt.prom" >"$dir/train_gpt.log" 2>&1 &
pids+=($!)
prometheus-node-exporter --web.listen-address="127.0.0.1:$exporter_port" --collector.disable-defaults \
  --collector.textfile --collector.textfile.directory="$dir/textfile" >"$dir/node_exporter.log" 2>&1 &
pids+=($!)
cat >"$dir/prometheus.yml" <<YAML
global:
  scrape_interval: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: mgpu
    honor_labels: true  # keep the trainer's job label
    static_configs: [{targets: ["127.0.0.1:$trainer_port"]}]
  - job_name: node
    honor_labels: true
    static_configs: [{targets: ["127.0.0.1:$exporter_port"]}]
YAML
promtool check config "$dir/prometheus.yml" >"$dir/promtool_config.log" 2>&1 || fail "promtool check config"
prometheus --config.file="$dir/prometheus.yml" --storage.tsdb.path="$dir/data" \
  --web.listen-address="127.0.0.1:$prometheus_port" >"$dir/prometheus.log" 2>&1 &
pids+=($!)

for _ in $(seq 100); do grep -q "^metrics: http://" "$dir/train_gpt.log" && break; sleep 0.1; done
grep -q "^metrics: http://127.0.0.1:$trainer_port/metrics" "$dir/train_gpt.log" || fail "train_gpt does not serve its metrics"
for _ in $(seq 100); do grep -q "mgpu_device_busy_ratio" "$dir/textfile/train_gpt.prom" && break; sleep 0.1; done
python3 -c "import urllib.request, sys; sys.stdout.write(urllib.request.urlopen('http://127.0.0.1:$trainer_port/metrics').read().decode())" \
  >"$dir/exposition.prom"
promtool check metrics <"$dir/exposition.prom" >"$dir/promtool_metrics.log" 2>&1 || fail "promtool check metrics (endpoint): $(cat "$dir/promtool_metrics.log")"
promtool check metrics <"$dir/textfile/train_gpt.prom" >>"$dir/promtool_metrics.log" 2>&1 || fail "promtool check metrics (textfile)"
ls "$dir/textfile" | grep -v '^train_gpt.prom$' | grep -q . && fail "the textfile folder holds more than train_gpt.prom: $(ls "$dir/textfile")"

python3 - "$prometheus_port" "$trainer_port" "$exporter_port" >"$dir/queries.log" 2>&1 <<'PY' || fail "the queries: $(cat "$dir/queries.log")"
import json, sys, time, urllib.parse, urllib.request
prometheus, trainer, exporter = sys.argv[1:4]
def query(q):
    url = f"http://127.0.0.1:{prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": q})
    body = json.load(urllib.request.urlopen(url, timeout=5))
    assert body["status"] == "success", body
    return body["data"]["result"]
def by_device(q):
    return {r["metric"]["device"]: float(r["value"][1]) for r in query(q)}
devices = {"host:0", "host:1"}
sources = {"endpoint": f'instance="127.0.0.1:{trainer}"', "node_exporter": f'instance="127.0.0.1:{exporter}"'}
deadline = time.time() + 15
while True:  # until every series has been scraped at least 3 times
    counts = [by_device(f'count_over_time(mgpu_device_busy_ratio{{{s}}}[1m])') for s in sources.values()]
    if all(set(c) == devices and min(c.values()) >= 3 for c in counts):
        break
    assert time.time() < deadline, f"series not scraped 3 times within 15 s: {counts}"
    time.sleep(0.5)
for name, s in sources.items():
    busy = by_device(f'mgpu_device_busy_ratio{{{s},job="train_gpt",kind="host"}}')
    assert set(busy) == devices and all(0 < b <= 1 for b in busy.values()), (name, busy)
    window = by_device(f'mgpu_device_busy_window_ratio{{{s}}}')
    assert set(window) == devices and all(0 < b <= 1 for b in window.values()), (name, window)
    memory = {state: by_device(f'mgpu_device_memory_bytes{{{s},state="{state}"}}') for state in ("in_use", "peak", "capacity")}
    for d in devices:
        assert 0 < memory["in_use"][d] <= memory["peak"][d], (name, d, memory)
        assert d not in memory["capacity"] or memory["peak"][d] <= memory["capacity"][d], (name, d, memory)
    rows = by_device(f'mgpu_device_rows_total{{{s}}}')
    tokens = by_device(f'mgpu_device_tokens_total{{{s}}}')
    assert set(rows) == devices and all(v > 0 for v in rows.values()) and all(tokens[d] == 8 * rows[d] for d in devices), (name, rows, tokens)
    weights = by_device(f'mgpu_device_shard_weight{{{s}}}')
    assert set(weights) == devices and all(w > 0 for w in weights.values()), (name, weights)
    # host:1 runs at half speed: the faster host:0 gets the larger weight and more of the rows
    assert weights["host:0"] > weights["host:1"] and rows["host:0"] > rows["host:1"], (name, weights, rows)
    samples = [float(v) for _, v in query(f'mgpu_tokens_total{{{s}}}[1m]')[0]["values"]]
    assert len(samples) >= 3 and all(b > a for a, b in zip(samples, samples[1:])), (name, "tokens_total", samples)
    rate = query(f'rate(mgpu_tokens_total{{{s}}}[5s])')
    layout = query(f'mgpu_layout_info{{{s}}}')[0]["metric"]
    assert (layout["dp"], layout["tp"], layout["pp"], layout["zero"]) == ("2", "1", "1", "1"), layout
    print(f"{name}: busy {busy}, weights {weights}, memory in use {memory['in_use']}, peak {memory['peak']}, rows {rows}, "
          f"tokens_total {samples[0]:.0f} -> {samples[-1]:.0f} over {len(samples)} scrapes, "
          f"rate {float(rate[0]['value'][1]):.0f} tokens/s")
PY
cat "$dir/queries.log"
kill "${pids[0]}" && wait "${pids[0]}" 2>/dev/null || true  # the trainer, mid-training
echo "metrics_prometheus: ok in $(python3 -c "import time; print(f'{time.time() - $start_s:.1f}')") s"
