#!/bin/sh
# Desktop container entrypoint: Xvfb on :0, openbox, a session D-Bus and the AT-SPI bus (where installed), then
# exec the controller (OSWorld API on a Unix socket). Runs under docker's init (tini) as PID 1, which reaps
# orphaned app processes. Environment: ARPO_SCREEN (WxHxDEPTH, default 1280x720x24), DISPLAY (default :0).
set -eu
export DISPLAY="${DISPLAY:-:0}"
export XDG_SESSION_TYPE=x11  # an X11 session, as OSWorld's VM: pyautogui/pyscreeze choose scrot by it
SCREEN="${ARPO_SCREEN:-1280x720x24}"
mkdir -p /run/arpo /tmp/arpo /root
rm -f "/tmp/.X${DISPLAY#:}-lock" "/tmp/.X11-unix/X${DISPLAY#:}"

# wait_for WHAT LOG COMMAND...: poll COMMAND every 50 ms until it succeeds; after 20 s fail, printing LOG.
wait_for() {
    what="$1" log="$2"
    shift 2
    i=0
    until "$@" >/dev/null 2>&1; do
        i=$((i + 1))
        if [ "$i" -gt 400 ]; then
            echo "entrypoint: $what within 20 s" >&2
            cat "$log" >&2
            exit 1
        fi
        sleep 0.05
    done
}

Xvfb "$DISPLAY" -screen 0 "$SCREEN" -nolisten tcp -ac -noreset +extension XTEST >/tmp/arpo/xvfb.log 2>&1 &
wait_for "Xvfb did not answer on $DISPLAY" /tmp/arpo/xvfb.log xdpyinfo -display "$DISPLAY"

# openbox runs --startup once it has taken over the screen and is about to enter its event loop. Apps mapped
# before that can be left unmanaged as 1x1 windows, so the controller (and with it /health) starts after.
rm -f /tmp/arpo/wm-ready
openbox --config-file /opt/arpo/openbox-rc.xml --startup "touch /tmp/arpo/wm-ready" >/tmp/arpo/openbox.log 2>&1 &
wait_for "openbox did not start" /tmp/arpo/openbox.log test -e /tmp/arpo/wm-ready

# A session D-Bus and the AT-SPI accessibility bus, where the image has them (OSWorld's /accessibility and
# /terminal read the AT-SPI tree; dconf needs the session bus). Started before the controller, so /reset counts
# them as base processes; at-spi-bus-launcher publishes the a11y bus on the root window (AT_SPI_BUS), where
# toolkits find it. GTK apps always expose their tree; Qt and Chromium do when these variables are set.
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-/run/user/0}"  # the osworld image sets /run/user/1000 (OSWorld's)
mkdir -p "$XDG_RUNTIME_DIR" /root/Desktop
chmod 700 "$XDG_RUNTIME_DIR"
if command -v dbus-daemon >/dev/null 2>&1; then
    export DBUS_SESSION_BUS_ADDRESS="unix:path=$XDG_RUNTIME_DIR/bus"
    dbus-daemon --session --nofork --nopidfile --address="$DBUS_SESSION_BUS_ADDRESS" >/tmp/arpo/dbus.log 2>&1 &
    wait_for "the session D-Bus did not start" /tmp/arpo/dbus.log test -S "$XDG_RUNTIME_DIR/bus"
    if [ -x /usr/libexec/at-spi-bus-launcher ]; then
        export QT_ACCESSIBILITY=1 QT_LINUX_ACCESSIBILITY_ALWAYS_ON=1 ACCESSIBILITY_ENABLED=1 GNOME_ACCESSIBILITY=1
        /usr/libexec/at-spi-bus-launcher --launch-immediately >/tmp/arpo/at-spi.log 2>&1 &
        wait_for "the AT-SPI bus did not start" /tmp/arpo/at-spi.log \
            sh -c 'xprop -display "$DISPLAY" -root AT_SPI_BUS | grep -q unix:'
    fi
fi
# gsettings without dconf (the default image) keeps its values in GLib's keyfile under /root/.config, which
# /reset restores; an image with dconf uses it (through the session bus).
if ! ls /usr/lib/*/gio/modules/libdconfsettings.so >/dev/null 2>&1; then
    export GSETTINGS_BACKEND=keyfile
fi
cd /root
exec python3 /opt/arpo/controller.py
