#!/usr/bin/env bash
# CPU used by each container of a running Compose project over a window, read from the container's own cgroup
# counter (v1 cpuacct.usage, v2 cpu.stat usage_usec): everything the container ran, healthcheck processes
# included. Needs a local Docker engine (the cgroup files are read on this machine) and read access to /proc.
#
#   docker compose up -d --wait                  # leave it idle: no requests
#   bash scripts/idle-cpu.sh openengine-serve 60 # project name, window in seconds (default 60)
#
# Prints one line per container: CPU seconds in the window and the average share of one core.
set -euo pipefail
project=${1:?usage: idle-cpu.sh COMPOSE_PROJECT [SECONDS]}
window=${2:-60}
docker=${DOCKER:-docker}

usage_ns() {  # cumulative CPU nanoseconds of the cgroup of process $1
    local line path
    if line=$(grep -E '^[0-9]+:([^:]*,)?cpuacct(,[^:]*)?:' "/proc/$1/cgroup"); then
        path=${line#*:*:}
        for mount in /sys/fs/cgroup/cpuacct /sys/fs/cgroup/cpu,cpuacct /sys/fs/cgroup/cpuacct,cpu; do
            [[ -r $mount$path/cpuacct.usage ]] && { cat "$mount$path/cpuacct.usage"; return; }
        done
    fi
    line=$(grep -E '^0::' "/proc/$1/cgroup")
    path=${line#0::}
    awk '$1 == "usage_usec" { printf "%d\n", $2 * 1000 }' "/sys/fs/cgroup$path/cpu.stat"
}

mapfile -t ids < <("$docker" ps -q --filter "label=com.docker.compose.project=$project")
(( ${#ids[@]} )) || { echo "no running containers in project $project" >&2; exit 1; }
declare -A name pid before
for id in "${ids[@]}"; do
    name[$id]=$("$docker" inspect -f '{{.Name}}' "$id")
    pid[$id]=$("$docker" inspect -f '{{.State.Pid}}' "$id")
    before[$id]=$(usage_ns "${pid[$id]}")
done
sleep "$window"
total=0
for id in "${ids[@]}"; do
    used=$(( $(usage_ns "${pid[$id]}") - before[$id] ))
    total=$(( total + used ))
    awk -v n="${name[$id]#/}" -v u="$used" -v w="$window" \
        'BEGIN { printf "%-40s %8.2f s CPU in %d s  (%5.2f %% of one core)\n", n, u / 1e9, w, 100 * u / 1e9 / w }'
done
awk -v u="$total" -v w="$window" \
    'BEGIN { printf "%-40s %8.2f s CPU in %d s  (%5.2f %% of one core)\n", "total", u / 1e9, w, 100 * u / 1e9 / w }'
