#!/usr/bin/env bash
# A local base image for docker/Dockerfile on a machine with no container registry: a minimal Debian made with
# debootstrap (python3 and its venv module included; iproute2 and iptables for the compose file's NAT router and
# the volunteer behind it), imported with `docker import`. Cached by tag: an image already there is kept, so this
# runs once per machine; the tag's suffix changes whenever the package set does, so an older base is never reused.
# Needs root, debootstrap and a Debian mirror.
# Usage: docker/make-base-image.sh [TAG]   (prints the tag; default swarmd-base:bookworm-2)
set -euo pipefail
SUITE=${SUITE:-bookworm}   # Debian 12: Python 3.11, what the project targets
TAG=${1:-swarmd-base:$SUITE-2}
MIRROR=${MIRROR:-http://deb.debian.org/debian}

if docker image inspect "$TAG" >/dev/null 2>&1; then
    echo "$TAG"
    exit 0
fi
command -v debootstrap >/dev/null || { echo "make-base-image: needs debootstrap (apt-get install debootstrap)" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "make-base-image: debootstrap needs root" >&2; exit 2; }

root=$(mktemp -d /tmp/swarmd-base.XXXXXX)
# debootstrap mounts /proc and /sys inside the tree: never delete through a mount left behind
cleanup() {
    awk -v root="$root" 'index($2, root) == 1 {print $2}' /proc/mounts | sort -r | xargs -r umount -l
    rm -rf --one-file-system "$root"
}
trap cleanup EXIT
debootstrap --variant=minbase --include=python3,python3-venv,iproute2,iptables "$SUITE" "$root" "$MIRROR" >&2
# what an image never needs: apt's lists and caches, documentation, manual pages, translations
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/* "$root"/usr/share/doc/* "$root"/usr/share/man/* \
       "$root"/usr/share/info/* "$root"/usr/share/locale/*
tar --numeric-owner -C "$root" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["python3"]' - "$TAG" >&2
echo "$TAG"
