#!/usr/bin/env bash
# Sets up rootful podman for compose/ on a Debian 12 machine of this project's CI kind (root; cgroup v1 without
# systemd; no registry reachable but PyPI and Debian's mirrors) and makes the base image:
#   1. apt-get install podman, runc, netavark + aardvark-dns (the compose network and its DNS), iptables (port
#      publishing) and debootstrap, where any is missing (podman-compose comes from PyPI: make compose-test);
#   2. unless the image exists: debootstrap Debian 12 (minbase + python3, pip, redis-server, prometheus) into a
#      temporary directory and `podman import` it as $DCS_DEBIAN_IMAGE (default localhost/dcs-debian:bookworm):
#      the DCS image's BASE_IMAGE, and the image Redis and Prometheus run from (compose/podman/compose.override.yml).
# Every podman command here runs with CONTAINERS_CONF=compose/podman/containers.conf (runc, cgroupfs, lower
# nofile/nproc). Prints each phase's seconds. `--rebuild` makes the image again even if it exists.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
export CONTAINERS_CONF="${CONTAINERS_CONF:-$HERE/containers.conf}"
IMAGE="${DCS_DEBIAN_IMAGE:-localhost/dcs-debian:bookworm}"
MIRROR="${DCS_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
PACKAGES=(podman runc netavark aardvark-dns iptables debootstrap)
INCLUDE=python3,python3-pip,python3-venv,ca-certificates,redis-server,redis-tools,prometheus
REBUILD=0
[[ "${1:-}" == "--rebuild" ]] && REBUILD=1

if [[ "$(id -u)" != 0 ]]; then
    echo "compose/podman/setup.sh: needs root (apt-get, debootstrap, rootful podman)" >&2
    exit 1
fi

phase_start=$SECONDS
missing=()
for package in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" || missing+=("$package")
done
if ((${#missing[@]})); then
    echo "setup: apt-get install ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
echo "setup: phase apt ($(podman --version), $(runc --version | head -1)) took $((SECONDS - phase_start)) s"

phase_start=$SECONDS
if ((REBUILD == 0)) && podman image exists "$IMAGE"; then
    echo "setup: $IMAGE exists (--rebuild makes it again)"
else
    rootfs="$(mktemp -d /var/tmp/dcs-debootstrap.XXXXXX)"
    trap 'rm -rf "$rootfs"' EXIT
    echo "setup: debootstrap bookworm ($INCLUDE) from $MIRROR"
    debootstrap --variant=minbase --include="$INCLUDE" bookworm "$rootfs" "$MIRROR" >"$rootfs.log" 2>&1 || {
        tail -30 "$rootfs.log" >&2
        exit 1
    }
    rm -f "$rootfs.log"
    # An image's own Python: pip may install into it (PEP 668's marker is for a distribution's shared system).
    rm -f "$rootfs"/usr/lib/python3*/EXTERNALLY-MANAGED
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    echo "setup: phase debootstrap took $((SECONDS - phase_start)) s"
    phase_start=$SECONDS
    tar -C "$rootfs" -c . | podman import --quiet \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' \
        --change 'CMD ["/bin/bash"]' \
        - "$IMAGE" >/dev/null
    rm -rf "$rootfs"
    trap - EXIT
fi
echo "setup: phase import took $((SECONDS - phase_start)) s ($(podman image inspect --format '{{.Size}}' "$IMAGE") bytes)"
