#!/bin/sh
# Runs once at image build time (docker build, no network) in the osworld profile's final image.
# Makes the session look like OSWorld's Ubuntu VM where its tasks depend on it:
# * /home/user is OSWorld's home (tasks use /home/user/Desktop and ~): a symlink to /root, so the controller's
#   /reset (which restores /root) also restores it; HOME=/home/user is set in the image;
# * the XDG home folders (Desktop, Documents, Downloads, Music, Pictures, Public, Templates, Videos);
# * `google-chrome` runs Debian's chromium (Google Chrome has no Debian package), with --no-sandbox: chromium
#   refuses to run as root without it, and its namespace sandbox cannot start under the container's seccomp
#   profile without CAP_SYS_ADMIN; /dev/shm is 64 MiB, so it keeps shared memory in /tmp;
# * sudo and vlc made to work for the root session (below);
# * Ctrl+Alt+T opens gnome-terminal and plain text opens in gedit, as on Ubuntu; VLC is not the default video
#   player; Thunderbird's WM_CLASS is Mail.thunderbird; VLC's windows are decorated (below);
# * dconf system defaults: toolkit-accessibility on, so GTK apps join the AT-SPI tree;
# * a sound sink at 50% volume and VLC's HTTP interface on, as in OSWorld's VM (below);
# * `code` runs VS Code (code-server from the image's VS Code layer in a Chromium app window; see the profile's
#   `code` script and actors/desktop/vscode_layer.py).
set -eu
mkdir -p /root /home
ln -sfn /root /home/user
for d in Desktop Documents Downloads Music Pictures Public Templates Videos; do mkdir -p "/root/$d"; done
cat > /root/.config-user-dirs.tmp <<'DIRS'
XDG_DESKTOP_DIR="$HOME/Desktop"
XDG_DOCUMENTS_DIR="$HOME/Documents"
XDG_DOWNLOAD_DIR="$HOME/Downloads"
XDG_MUSIC_DIR="$HOME/Music"
XDG_PICTURES_DIR="$HOME/Pictures"
XDG_PUBLICSHARE_DIR="$HOME/Public"
XDG_TEMPLATES_DIR="$HOME/Templates"
XDG_VIDEOS_DIR="$HOME/Videos"
DIRS
mkdir -p /root/.config
mv /root/.config-user-dirs.tmp /root/.config/user-dirs.dirs

mkdir -p /etc/chromium.d
cat > /etc/chromium.d/arpo <<'FLAGS'
export CHROMIUM_FLAGS="$CHROMIUM_FLAGS --no-sandbox --disable-dev-shm-usage --no-first-run --password-store=basic --force-renderer-accessibility"
FLAGS
cat > /usr/local/bin/google-chrome <<'CHROME'
#!/bin/sh
exec /usr/bin/chromium "$@"
CHROME
chmod 0755 /usr/local/bin/google-chrome

# sudo: the session is root, and real sudo cannot run under the fleet's hardening (it calls setresuid, and
# CAP_SETUID is dropped). As root, sudo would run the command without asking for a password and without reading
# stdin (so `echo password | sudo -S cmd`, as OSWorld's tasks write it, leaves stdin to cmd); this does the
# same for root targets and refuses -u/-g to another user, as the container could not switch to one anyway.
cat > /usr/local/bin/sudo <<'SUDO'
#!/bin/sh
while [ $# -gt 0 ]; do
    case "$1" in
        -u|-g) if [ "$2" != root ] && [ "$2" != 0 ] && [ "$2" != "#0" ]; then
                   echo "sudo: this desktop runs as root and cannot switch to $2" >&2; exit 1
               fi; shift 2 ;;
        --) shift; break ;;
        -*) shift ;;
        *) break ;;
    esac
done
[ $# -gt 0 ] || exit 0
exec "$@"
SUDO
chmod 0755 /usr/local/bin/sudo

# VLC: Debian's /usr/bin/vlc exits at once when geteuid() is 0 ("VLC is not supposed to be run as root"), and
# the session is root. The usual fix renames the imported symbol to getppid (same length, never 0 here).
sed -i 's/geteuid/getppid/' /usr/bin/vlc

# Ctrl+Alt+T opens a GNOME terminal, as on OSWorld's Ubuntu: many os tasks' setup and evaluator postconfig press
# it through pyautogui, then type into the terminal and read it back with /terminal. Only this profile: the
# default image's openbox has no key bindings.
bind='<keybind key="C-A-t"><action name="Execute"><command>gnome-terminal</command></action></keybind>'
sed -i "s#</openbox_config>#  <keyboard>$bind</keyboard>\n</openbox_config>#" /opt/arpo/openbox-rc.xml
grep -q 'key="C-A-t"' /opt/arpo/openbox-rc.xml

# Plain text opens in gedit, as on OSWorld's Ubuntu (otherwise xdg-open picks LibreOffice Writer, listed first
# for text/plain in mimeinfo.cache).
# Video: VLC is not the default player, as on OSWorld's Ubuntu, where most video types open in GNOME's Videos
# (Totem) and an untouched multi_apps/937087b6 ("set VLC as the default video player": the most common
# `xdg-mime query default video/<type>` answer over 43 types) scores 0; VLC was the only video app in
# mimeinfo.cache here, so it scored 1. Totem is not in this image, so the other types go to Chromium, which plays
# video; video/mp4 stays VLC's, as OSWorld's multi_apps/9f3bb592 opens a .mp4 and waits for VLC's window.
# A user's ~/.config/mimeapps.list (what `xdg-mime default` writes) comes first.
{
    printf '[Default Applications]\ntext/plain=org.gnome.gedit.desktop\n'
    for t in 3gp 3gpp 3gpp2 avi divx dv fli flv mp2t mp4v-es mpeg mpeg-system msvideo ogg quicktime vnd.divx \
             vnd.mpegurl vnd.rn-realvideo webm x-anim x-avi x-flc x-fli x-flv x-m4v x-matroska x-mpeg \
             x-mpeg-system x-mpeg2 x-ms-asf x-ms-asf-plugin x-ms-asx x-ms-wm x-ms-wmv x-ms-wmx x-ms-wvx x-msvideo \
             x-nsv x-ogm x-ogm+ogg x-theora x-theora+ogg; do
        printf 'video/%s=chromium.desktop\n' "$t"
    done
} > /etc/xdg/mimeapps.list
test -f /usr/share/applications/chromium.desktop

# Thunderbird's windows have the WM_CLASS of OSWorld's Ubuntu, "Mail.thunderbird": Debian's Thunderbird 140 names
# its class after its remoting name, thunderbird-default ("Mail.thunderbird-default"), so OSWorld's postconfig
# close_window 'Mail.thunderbird' (strict, by class) never found the window. MOZ_APP_REMOTINGNAME sets that name.
sed -i '2i export MOZ_APP_REMOTINGNAME="${MOZ_APP_REMOTINGNAME:-thunderbird}"' /usr/bin/thunderbird
sed -i 's/^StartupWMClass=thunderbird-default$/StartupWMClass=thunderbird/' /usr/share/applications/thunderbird.desktop
grep -q '^export MOZ_APP_REMOTINGNAME=' /usr/bin/thunderbird

# VLC's windows keep openbox's title bar (other apps' are undecorated): on OSWorld's GNOME a maximised window is
# smaller than the screen, so OSWorld's is_vlc_fullscreen (VLC's window size == the screen's) is 1 only in full
# screen; with every window maximised and undecorated here an untouched vlc/8d9fd4e2 scored 1.
vlc_rule='<application class="vlc"><decor>yes</decor></application>'
sed -i "s#</applications>#  $vlc_rule\n  </applications>#" /opt/arpo/openbox-rc.xml
grep -q 'application class="vlc"' /opt/arpo/openbox-rc.xml

mkdir -p /etc/dconf/profile /etc/dconf/db/local.d
printf 'user-db:user\nsystem-db:local\n' > /etc/dconf/profile/user
cat > /etc/dconf/db/local.d/00-arpo <<'DCONF'
[org/gnome/desktop/interface]
toolkit-accessibility=true
DCONF
dconf update

# Sound: a null sink at 50% volume, the default (PulseAudio's own fallback sink starts at 100%, which would
# make os/28cc3b7e, "turn the volume up to the max", score 1 before the agent does anything; OSWorld's VM does
# not start at 100% either).
mkdir -p /etc/pulse/default.pa.d
cat > /etc/pulse/default.pa.d/arpo.pa <<'PULSE'
load-module module-null-sink sink_name=arpo_null sink_properties=device.description=Speakers
set-sink-volume arpo_null 32768
set-default-sink arpo_null
PULSE

# VLC as OSWorld's VM has it: no privacy dialog at first start, and the HTTP interface on (port 8080, password
# "password"), which OSWorld's vlc_playing_info getter reads.
mkdir -p /root/.config/vlc
cat > /root/.config/vlc/vlcrc <<'VLCRC'
[qt]
qt-privacy-ask=0
[core]
extraintf=http
[lua]
http-password=password
VLCRC

# VS Code: the profile's `code` launcher, and code-server's config file (present, so code-server does not write
# one with a generated password under ~/.config/code-server; the launcher passes every setting as a flag).
install -m 0755 /opt/arpo-profile/code /usr/local/bin/code
mkdir -p /etc/code-server
printf 'auth: none\ncert: false\n' > /etc/code-server/config.yaml
test -x /opt/node/bin/node
test -f /opt/code-server/lib/node_modules/code-server/out/node/entry.js
