#!/bin/sh
# Desktop container entrypoint: Xvfb on :0, openbox, then exec the controller (OSWorld API on a Unix socket).
# Runs under docker's init (tini) as PID 1, which reaps orphaned app processes.
# Environment: ARPO_SCREEN (WxHxDEPTH, default 1280x720x24), DISPLAY (default :0).
set -eu
export DISPLAY="${DISPLAY:-:0}"
SCREEN="${ARPO_SCREEN:-1280x720x24}"
mkdir -p /run/arpo /tmp/arpo /root
rm -f "/tmp/.X${DISPLAY#:}-lock" "/tmp/.X11-unix/X${DISPLAY#:}"

Xvfb "$DISPLAY" -screen 0 "$SCREEN" -nolisten tcp -ac -noreset +extension XTEST >/tmp/arpo/xvfb.log 2>&1 &

# Wait (up to 20 s) until the X server answers before starting clients.
i=0
until xdpyinfo -display "$DISPLAY" >/dev/null 2>&1; do
    i=$((i + 1))
    if [ "$i" -gt 400 ]; then
        echo "entrypoint: Xvfb did not answer on $DISPLAY within 20 s" >&2
        cat /tmp/arpo/xvfb.log >&2
        exit 1
    fi
    sleep 0.05
done

# openbox runs --startup once it has taken over the screen and is about to enter its event loop. Apps mapped
# before that can be left unmanaged as 1x1 windows, so the controller (and with it /health) starts after.
rm -f /tmp/arpo/wm-ready
openbox --config-file /opt/arpo/openbox-rc.xml --startup "touch /tmp/arpo/wm-ready" >/tmp/arpo/openbox.log 2>&1 &
i=0
until [ -e /tmp/arpo/wm-ready ]; do
    i=$((i + 1))
    if [ "$i" -gt 400 ]; then
        echo "entrypoint: openbox did not start within 20 s" >&2
        cat /tmp/arpo/openbox.log >&2
        exit 1
    fi
    sleep 0.05
done
cd /root
exec python3 /opt/arpo/controller.py
