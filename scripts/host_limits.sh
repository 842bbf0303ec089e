#!/usr/bin/env bash
# Raises the host limits that hundreds of live desktops on one machine run into (root; safe to run again: it only
# raises). What each desktop uses, measured with `python -m bench.bench_desktops --live 32,64,128,256` (see
# docs/benchmarks.md, "bench_desktops, live"):
#   - inotify instances: 2 per desktop (its session D-Bus and its AT-SPI bus, both dbus-daemon). They are
#     charged to uid 0 host-wide (no user namespace), and Debian's default fs.inotify.max_user_instances = 128
#     is spent by 64 desktops: later desktops' buses run without inotify ("Cannot initialize inotify"), and every
#     other root process on the host (chromium, editors, file watchers) can no longer create one. -> 8192.
#   - threads: ~23 per desktop (containerd-shim ~11, the container's processes and their threads);
#     kernel.pid_max = 32768 counts threads, so about 1,400 desktops share it with the rest of the host.
#     -> 4194304 (the 64-bit maximum).
#   - dockerd's open files: ~6.3 per desktop (containerd's: ~4). A dockerd limited to 1024 open files stops near
#     160 desktops; scripts/bootstrap.sh starts it with the soft limit raised to the hard one (systemd's
#     docker.service sets LimitNOFILE=infinity); here we only warn about a running one with a low limit.
# Memory, not a limit here, is what stops a 24 GiB machine: ~70 MiB of host memory per idle desktop.
set -euo pipefail
say() { printf '[host-limits] %s\n' "$*"; }

raise() {  # raise SYSCTL VALUE: set it when it is lower
    local now
    now=$(sysctl -n "$1")
    if [ "$now" -lt "$2" ]; then
        if sysctl -qw "$1=$2" 2>/dev/null; then say "$1: $now -> $2"; else say "cannot raise $1 ($now; not root?)"; fi
    fi
}
raise fs.inotify.max_user_instances 8192
raise kernel.pid_max 4194304

if pid=$(pgrep -xo dockerd); then
    files=$(awk '/^Max open files/ {print $4}' "/proc/$pid/limits")
    if [ "$files" != unlimited ] && [ "$files" -lt 16384 ]; then
        say "dockerd (pid $pid) may open only $files files (~6.3 per desktop): restart it after 'ulimit -n 1048576'"
    fi
fi
