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
# * dconf system defaults: toolkit-accessibility on, so GTK apps join the AT-SPI tree.
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

mkdir -p /etc/dconf/profile /etc/dconf/db/local.d
printf 'user-db:user\nsystem-db:local\n' > /etc/dconf/profile/user
cat > /etc/dconf/db/local.d/00-arpo <<'DCONF'
[org/gnome/desktop/interface]
toolkit-accessibility=true
DCONF
dconf update
