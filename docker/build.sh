#!/usr/bin/env bash
# Build the four pdserve images: pdserve-bootstrap, pdserve-gateway, pdserve-prefill, pdserve-decode.
#
#   docker/build.sh                  # tag :latest
#   IMAGE_TAG=dev docker/build.sh
#
# Works both where Docker Hub and PyPI are reachable from builds (a normal machine) and on a
# machine like the project's own, where no registry is reachable and HTTPS from inside a build
# fails. Choices, each overridable:
#   BASE_IMAGE  unset: python:3.11-slim-bookworm if it is present or can be pulled; otherwise a
#               local Debian bookworm base `pdserve-base:bookworm` made once with debootstrap
#               (python3 3.11, python3-venv and Mooncake's libraries) and `docker import`.
#   OFFLINE     1: wheels are downloaded on the host (its pip, its index and certificates) into
#               $CACHE/wheels and the images install only those (--no-index). Default: 1 when the
#               local base is used, else 0 (pip inside the build uses PyPI + PyTorch's CPU index).
#   CACHE       where the local base's root file system (a tarball) and the wheels are kept between
#               runs on this machine, outside any checkout: default /var/cache/pdserve-docker.
# Idempotent: the base is made once (debootstrap once per package list; a later `docker import`
# from the cached tarball takes seconds if Docker's images were wiped), wheels are downloaded once
# per pyproject.toml, and image layers come from Docker's cache when nothing changed. Heavy steps
# run under `nice -n 10`.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

DOCKER=${DOCKER:-docker}
IMAGE_TAG=${IMAGE_TAG:-latest}
PUBLIC_BASE=python:3.11-slim-bookworm
LOCAL_BASE=pdserve-base:bookworm
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
# Python 3.11 with venv, the shared libraries Mooncake's non-CUDA wheel links and g++ for the
# engine's C++ CPU kernels (the same list the Dockerfile installs with apt on a public base).
BASE_PACKAGES=python3,python3-venv,ca-certificates,libibverbs1,libnuma1,libcurl4,g++
HOST_PYTHON=${HOST_PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
CACHE=${CACHE:-/var/cache/pdserve-docker}
WHEELS=$CACHE/wheels
CONTEXT=docker/.context
SERVICES=(bootstrap gateway prefill decode)

say() { echo "[docker/build] $*"; }
have_image() { "$DOCKER" image inspect "$1" >/dev/null 2>&1; }

make_local_base() {
    # The packages are recorded in a label: a changed list makes a new base.
    if [ "$("$DOCKER" image inspect -f '{{ index .Config.Labels "pdserve.packages" }}' "$LOCAL_BASE" 2>/dev/null)" \
         = "$BASE_PACKAGES" ]; then
        say "base: $LOCAL_BASE (already imported)"
        return
    fi
    local tarball
    tarball=$CACHE/base-bookworm-$(echo "$BASE_PACKAGES" | sha1sum | cut -c1-12).tar
    if [ ! -s "$tarball" ]; then
        command -v debootstrap >/dev/null || { say "debootstrap missing: apt-get install -y debootstrap"; exit 1; }
        [ "$(id -u)" -eq 0 ] || { say "debootstrap needs root"; exit 1; }
        mkdir -p "$CACHE"
        local rootfs
        rootfs=$(mktemp -d /tmp/pdserve-rootfs.XXXXXX)
        say "base: debootstrap bookworm into $rootfs (about a minute)"
        nice -n 10 debootstrap --variant=minbase --include="$BASE_PACKAGES" bookworm "$rootfs" "$DEBIAN_MIRROR" \
            >"$rootfs.log" 2>&1 || { tail -20 "$rootfs.log"; rm -rf "$rootfs"; exit 1; }
        rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
        tar -C "$rootfs" -cf "$tarball.part" . && mv "$tarball.part" "$tarball"
        rm -rf "$rootfs" "$rootfs.log"
        say "base: root file system cached in $tarball"
    fi
    "$DOCKER" import --change "LABEL pdserve.packages=$BASE_PACKAGES" --change 'CMD ["/bin/bash"]' \
        "$tarball" "$LOCAL_BASE" >/dev/null
    say "base: imported $LOCAL_BASE"
}

choose_base() {
    if [ -n "${BASE_IMAGE:-}" ]; then
        say "base: $BASE_IMAGE (from BASE_IMAGE)"
    elif have_image "$PUBLIC_BASE" || timeout 60 "$DOCKER" pull -q "$PUBLIC_BASE" >/dev/null 2>&1; then
        BASE_IMAGE=$PUBLIC_BASE
        say "base: $BASE_IMAGE"
    else
        say "base: $PUBLIC_BASE cannot be pulled (no registry): using a local debootstrap base"
        make_local_base
        BASE_IMAGE=$LOCAL_BASE
        OFFLINE=${OFFLINE:-1}
    fi
    OFFLINE=${OFFLINE:-0}
}

download_wheels() {
    # The images run Debian bookworm's Python 3.11 on x86_64: the host's pip must pick wheels for it.
    local version
    version=$("$HOST_PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
    [ "$version" = "3.11" ] || { say "OFFLINE=1 needs a Python 3.11 host interpreter (HOST_PYTHON), got $version"; exit 1; }
    local want stamp=$WHEELS/.downloaded
    want=$(cat pyproject.toml docker/requirements.py | sha1sum | cut -c1-16)
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
        say "wheels: $WHEELS up to date ($(find "$WHEELS" -name '*.whl' | wc -l) files)"
        return
    fi
    mkdir -p "$WHEELS"
    say "wheels: downloading into $WHEELS with the host's pip (a few minutes the first time)"
    "$HOST_PYTHON" docker/requirements.py worker >"$WHEELS/.worker.txt"
    "$HOST_PYTHON" docker/requirements.py no-deps >"$WHEELS/.no-deps.txt"
    nice -n 10 "$HOST_PYTHON" -m pip download -q --only-binary=:all: -d "$WHEELS" -r "$WHEELS/.worker.txt" \
        2> >(grep -v "^WARNING: Location" >&2)
    nice -n 10 "$HOST_PYTHON" -m pip download -q --only-binary=:all: --no-deps -d "$WHEELS" -r "$WHEELS/.no-deps.txt" \
        2> >(grep -v "^WARNING: Location" >&2)
    echo "$want" >"$stamp"
}

stage_context() {
    # The build context is the working tree's source files (what git tracks or would track, so no
    # .venv or .cache) plus the wheels; hard links keep it cheap.
    rm -rf "$CONTEXT"
    mkdir -p "$CONTEXT"
    git ls-files -z --cached --others --exclude-standard \
        | "$HOST_PYTHON" -c 'import os, sys; sys.stdout.write("".join(p + "\0" for p in sys.stdin.read().split("\0") if p and os.path.isfile(p) and not p.startswith("docker/.context/")))' \
        | tar --null -T - -c | tar -x -C "$CONTEXT"
    mkdir -p "$CONTEXT/docker/wheels"
    if [ "$OFFLINE" = 1 ]; then  # the Dockerfile takes them from docker/wheels in the context
        cp -al "$WHEELS"/*.whl "$CONTEXT/docker/wheels/" 2>/dev/null || cp "$WHEELS"/*.whl "$CONTEXT/docker/wheels/"
        # the repository's .dockerignore keeps a checkout's docker/wheels out of a context made
        # from the repository root; here they are meant to go in
        sed -i '\#^docker/wheels/\?$#d' "$CONTEXT/.dockerignore"
    fi
    say "context: $CONTEXT ($(du -sh "$CONTEXT" | cut -f1))"
}

build_images() {
    local pip_args=() target
    if [ "$OFFLINE" = 1 ]; then
        pip_args=(--build-arg "PIP_ARGS=--no-index")
    fi
    for target in "${SERVICES[@]}"; do
        say "image: pdserve-$target:$IMAGE_TAG"
        local log=/tmp/pdserve-docker-build-$target.log
        nice -n 10 "$DOCKER" build --force-rm -f "$CONTEXT/docker/Dockerfile" --target "$target" \
            --build-arg "BASE_IMAGE=$BASE_IMAGE" "${pip_args[@]}" -t "pdserve-$target:$IMAGE_TAG" "$CONTEXT" \
            >"$log" 2>&1 || { tail -40 "$log"; say "image pdserve-$target failed: full log in $log"; exit 1; }
    done
}

started=$(date +%s)
choose_base
[ "$OFFLINE" = 1 ] && download_wheels
stage_context
build_images
rm -rf "$CONTEXT"
say "done in $(( $(date +%s) - started ))s:"
"$DOCKER" image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' \
    | grep -E "^pdserve-($(IFS='|'; echo "${SERVICES[*]}")):$IMAGE_TAG " | sed 's/^/  /' || true
