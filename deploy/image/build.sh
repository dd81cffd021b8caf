#!/usr/bin/env bash
# gpufed's container image (the broker and the member agent: one image, as
# member-agent/Dockerfile builds it), made from package registries alone, without Docker:
#
#   1. base  Debian (mmdebstrap): python3, libjemalloc2, ca-certificates, the user 10001:10001,
#            /usr/local/lib/libjemalloc.so.2 (deploy/image/rootfs-hook.sh)
#   2. deps  a venv at /opt/gpufed made by the rootfs's own python3 in a chroot, holding
#            pyproject.toml's dependencies: wheels from PyPI (pip download, on this machine,
#            for the rootfs's Python and glibc), installed offline, bytecode compiled
#   3. app   the gpufed wheel built from this checkout, the same way; /usr/local/bin/gpufed
#
# each an OCI layer, packed with umoci. Every stage is kept in a cache layout under a tag named
# after what went into it, so a run rebuilds only from the first stage whose inputs changed (a
# source change: the app layer only, a few seconds). The dependencies are resolved when the
# deps stage is built and kept until pyproject.toml's list changes: IMAGE_REFRESH=1 drops the
# cache (newer Debian packages and dependency versions).
#
# Writes, under IMAGE_DIR (default build/image):
#   oci/                  an OCI layout holding the one image, tagged IMAGE_TAG (default:
#                         pyproject's version): skopeo copy oci:build/image/oci:0.1.0 docker://...
#   gpufed-TAG.oci.tar    the same as an archive (podman load -i, skopeo's oci-archive:)
#   cache/                the stages
#
# Needs root (mmdebstrap's root mode, chroot, umoci unpack keeping file owners); installs
# mmdebstrap and umoci with apt-get when they are missing. See deploy/IMAGES.md.
set -euo pipefail
cd "$(dirname "$0")/../.."

IMAGE_DIR=${IMAGE_DIR:-build/image}
PYTHON=${PYTHON:-python3}
DEBIAN_SUITE=${DEBIAN_SUITE:-bookworm}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
DEBIAN_SECURITY_MIRROR=${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}
PACKAGES=python3,libjemalloc2,ca-certificates
HOOK=deploy/image/rootfs-hook.sh

say() { printf 'image [%3ds]: %s\n' "$SECONDS" "$*" >&2; }
die() { say "$*"; exit 1; }

[ "$(id -u)" = 0 ] || die "needs root (mmdebstrap's root mode, chroot, umoci unpack keeping \
file owners): run it as root, e.g. sudo make image"
for tool in unshare chroot flock; do
    command -v "$tool" >/dev/null || die "$tool is missing (util-linux, coreutils)"
done
if ! command -v mmdebstrap >/dev/null || ! command -v umoci >/dev/null; then
    command -v apt-get >/dev/null || die "mmdebstrap and umoci are missing, and there is no apt-get"
    say "installing mmdebstrap and umoci (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q mmdebstrap umoci debian-archive-keyring >/dev/null \
        || { apt-get update -q >/dev/null \
            && apt-get install -y -q mmdebstrap umoci debian-archive-keyring >/dev/null; }
fi

VERSION=$("$PYTHON" -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')
IMAGE_TAG=${IMAGE_TAG:-$VERSION}
CACHE="$IMAGE_DIR/cache"
LAYOUT="$CACHE/oci"
mkdir -p "$CACHE"
exec 9>"$CACHE/lock"
flock 9  # one build at a time in this IMAGE_DIR
if [ "${IMAGE_REFRESH:-0}" = 1 ]; then
    say "IMAGE_REFRESH=1: dropping the cached stages"
    rm -rf "$LAYOUT" "$CACHE"/wheels-* "$CACHE"/rootfs-*
fi
WORK=$(mktemp -d "$CACHE/work.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
[ -d "$LAYOUT" ] || umoci init --layout "$LAYOUT"

key() { sha256sum | cut -c1-16; }
has_tag() { umoci ls --layout "$LAYOUT" | grep -x "$1" >/dev/null; }  # no -q: SIGPIPE under pipefail

# Runs a command chrooted into rootfs $1 with a clean environment: /dev and /proc from the host,
# a tmpfs on /tmp, and the directory $wheels at /tmp/wheels. With $2 (an empty directory, or
# one of an earlier call), the rootfs is the lower layer of an overlay whose changes land in
# $2/upper: what the command adds, and nothing else. Every mount lives in a mount namespace of
# its own and ends with it: nothing of them is left in the rootfs.
in_root() {
    local rootfs=$1 over=$2
    shift 2
    # shellcheck disable=SC2016 # the inner shell expands them
    unshare --mount --propagation private -- sh -euc '
        root=$1 over=$2 wheels=$3; shift 3
        if [ -n "$over" ]; then
            mkdir -p "$over/upper" "$over/work" "$over/merged"
            mount -t overlay overlay \
                -o "lowerdir=$root,upperdir=$over/upper,workdir=$over/work" "$over/merged"
            root=$over/merged
        fi
        mkdir -p "$root/dev" "$root/proc"
        mount --rbind /dev "$root/dev"
        mount -t proc proc "$root/proc"
        mount -t tmpfs tmpfs "$root/tmp"
        mkdir "$root/tmp/wheels"
        mount --bind "$wheels" "$root/tmp/wheels"
        exec env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 \
            PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 \
            chroot "$root" "$@"
    ' in_root "$rootfs" "$over" "$wheels" "$@"
}
# pip, unpacked from its wheel into $wheels/pip (where it keeps its bytecode), run by the
# venv's python: it installs into /opt/gpufed and is never installed in the image
pip_in_root() {
    local rootfs=$1 over=$2
    shift 2
    in_root "$rootfs" "$over" env PYTHONPATH=/tmp/wheels/pip /opt/gpufed/bin/python -m pip "$@"
}

# --- 1. base: Debian ------------------------------------------------------------------------
recipe=(
    --variant=essential --include="$PACKAGES"
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright'
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*'
    --dpkgopt='path-exclude=/usr/share/locale/*'
    --skip=output/dev
)
sources=(
    "deb $DEBIAN_MIRROR $DEBIAN_SUITE main"
    "deb $DEBIAN_MIRROR $DEBIAN_SUITE-updates main"
    "deb $DEBIAN_SECURITY_MIRROR $DEBIAN_SUITE-security main"
)
ARCH=$(dpkg --print-architecture)
# Debian's keys, also where the host is not Debian (Ubuntu's debian-archive-keyring has them
# there); not part of the key: the same packages whatever vouched for them
keyring=()
if [ -f /usr/share/keyrings/debian-archive-keyring.gpg ]; then
    keyring=(--keyring=/usr/share/keyrings/debian-archive-keyring.gpg)
fi
base_tag=base-$( { printf '%s\n' "$ARCH" "$DEBIAN_SUITE" "${recipe[@]}" "${sources[@]}"; cat "$HOOK"; } | key)
if has_tag "$base_tag"; then
    say "base: cached ($base_tag)"
else
    say "base: Debian $DEBIAN_SUITE with $PACKAGES (mmdebstrap, a minute or two)"
    mmdebstrap --quiet "${recipe[@]}" "${keyring[@]}" --customize-hook="sh '$PWD/$HOOK' \"\$1\"" \
        "$DEBIAN_SUITE" "$WORK/base.tar" "${sources[@]}"
    umoci new --image "$LAYOUT:$base_tag"
    umoci raw add-layer --image "$LAYOUT:$base_tag" \
        --history.created_by "mmdebstrap --variant=essential $DEBIAN_SUITE + $PACKAGES; $HOOK" \
        "$WORK/base.tar"
    rm -f "$WORK/base.tar"
fi

# --- 2. deps: the venv and pyproject's dependencies -----------------------------------------
"$PYTHON" -c '
import tomllib
print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))
' >"$WORK/requirements.txt"
deps_tag=deps-$(cat <(echo "$base_tag") "$WORK/requirements.txt" | key)
wheels="$CACHE/wheels-${deps_tag#deps-}"  # the wheelhouse, pip, and the gpufed wheel
rootfs="$CACHE/rootfs-${deps_tag#deps-}"  # the deps stage unpacked: the app stage's lower layer
if has_tag "$deps_tag" && [ -d "$wheels/pip" ] && [ -d "$rootfs" ]; then
    say "deps: cached ($deps_tag)"
else
    say "deps: pyproject's dependencies from PyPI into /opt/gpufed"
    rm -rf "$wheels" "$rootfs" && mkdir -p "$wheels"
    umoci unpack --image "$LAYOUT:$base_tag" "$WORK/bundle" >/dev/null
    # wheels for the rootfs's Python and C library, whatever this machine runs
    read -r pyver glibc < <(in_root "$WORK/bundle/rootfs" "" python3 -c \
        'import platform, sys; print("%d.%d" % sys.version_info[:2], platform.libc_ver()[1])')
    [ -n "${glibc:-}" ] || die "no python3 in the base layer"
    # every manylinux tag that glibc runs, newest first (pip takes --platform literally)
    platforms=()
    for minor in $(seq "${glibc#2.}" -1 17); do
        platforms+=(--platform "manylinux_2_${minor}_$(uname -m)")
    done
    for legacy in manylinux2014 manylinux2010 manylinux1; do
        platforms+=(--platform "${legacy}_$(uname -m)")
    done
    cp "$WORK/requirements.txt" "$wheels/"
    "$PYTHON" -m pip download --quiet --disable-pip-version-check --dest "$wheels" \
        --only-binary=:all: --implementation cp --python-version "$pyver" \
        --abi "cp${pyver/./}" "${platforms[@]}" -r "$wheels/requirements.txt" pip
    "$PYTHON" -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' \
        "$(ls "$wheels"/pip-*.whl)" "$wheels/pip"
    in_root "$WORK/bundle/rootfs" "" python3 -m venv --without-pip /opt/gpufed
    pip_in_root "$WORK/bundle/rootfs" "" install --quiet --no-index --find-links /tmp/wheels \
        --compile -r /tmp/wheels/requirements.txt
    umoci repack --image "$LAYOUT:$deps_tag" \
        --history.created_by "python3 -m venv /opt/gpufed; pip install -r requirements.txt" \
        "$WORK/bundle" >/dev/null
    mv "$WORK/bundle/rootfs" "$rootfs"
    rm -rf "$WORK/bundle"
fi

# --- 3. app: gpufed -------------------------------------------------------------------------
say "app: the gpufed wheel of this checkout"
rm -f "$wheels"/gpufed-*.whl
"$PYTHON" -m pip wheel --quiet --disable-pip-version-check --no-deps --wheel-dir "$wheels" .
gpufed_wheel=$(cd "$wheels" && ls gpufed-*.whl)
# the wheel's RECORD lists every file with its hash: the same sources, the same key
app_tag=app-$( { echo "$deps_tag"; cat "$0"; "$PYTHON" -c '
import sys, zipfile
wheel = zipfile.ZipFile(sys.argv[1])
print(wheel.read(next(n for n in wheel.namelist() if n.endswith(".dist-info/RECORD"))).decode())
' "$wheels/$gpufed_wheel"; } | key)
if has_tag "$app_tag"; then
    say "app: cached ($app_tag)"
else
    # installed on an overlay of the deps stage: the overlay's upper directory is the layer
    pip_in_root "$rootfs" "$WORK/app" install --quiet --no-index --no-deps --compile \
        "/tmp/wheels/$gpufed_wheel"
    pip_in_root "$rootfs" "$WORK/app" check >/dev/null \
        || die "the cached dependencies do not satisfy gpufed's: IMAGE_REFRESH=1 make image"
    in_root "$rootfs" "$WORK/app" ln -s /opt/gpufed/bin/gpufed /usr/local/bin/gpufed
    rm -rf "$WORK/app/upper/dev" "$WORK/app/upper/proc" "$WORK/app/upper/tmp"  # mount points
    [ -z "$(find "$WORK/app/upper" -type c -print -quit)" ] \
        || die "the app stage removed files of the deps stage (overlay whiteouts)"
    tar --create --numeric-owner --file "$WORK/app.tar" -C "$WORK/app/upper" .
    umoci raw add-layer --image "$LAYOUT:$deps_tag" --tag "$app_tag" \
        --history.created_by "pip install --no-deps $gpufed_wheel" "$WORK/app.tar"
    # as member-agent/Dockerfile has them (e2e/test_image.py compares the two); the Dockerfile's
    # python:3.11-slim base adds LANG, and its PATH has no /opt/gpufed/bin
    umoci config --image "$LAYOUT:$app_tag" \
        --config.user 10001:10001 --config.workingdir / --config.exposedports 8081/tcp \
        --config.env PATH=/opt/gpufed/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        --config.env LANG=C.UTF-8 \
        --config.env PYTHONDONTWRITEBYTECODE=1 --config.env PYTHONUNBUFFERED=1 \
        --config.env PIP_NO_CACHE_DIR=1 --config.env PIP_DISABLE_PIP_VERSION_CHECK=1 \
        --config.entrypoint gpufed --config.entrypoint agent \
        --config.entrypoint=--backend --config.entrypoint kubernetes \
        --config.label "org.opencontainers.image.title=gpufed" \
        --config.label "org.opencontainers.image.version=$VERSION" \
        --config.label "org.opencontainers.image.source=https://github.com/gpufed/gpufed" \
        --history.created_by "umoci config: user 10001:10001, entrypoint gpufed agent"
fi

# --- the output: a layout with the one image, and its archive --------------------------------
say "writing $IMAGE_DIR/oci ($IMAGE_TAG) and $IMAGE_DIR/gpufed-$IMAGE_TAG.oci.tar"
rm -rf "$IMAGE_DIR/oci" "$IMAGE_DIR"/gpufed-*.oci.tar
"$PYTHON" - "$LAYOUT" "$app_tag" "$IMAGE_DIR/oci" "$IMAGE_TAG" <<'EOF'
"""Copy one tagged image of an OCI layout into a new layout (its blobs hard-linked)."""
import json, os, shutil, sys
from pathlib import Path

source, tag, target, name = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), sys.argv[4]
REF = "org.opencontainers.image.ref.name"
entry = next(m for m in json.loads((source / "index.json").read_text())["manifests"]
             if m.get("annotations", {}).get(REF) == tag)

def blob(digest):
    return Path("blobs", *digest.split(":", 1))

manifest = json.loads((source / blob(entry["digest"])).read_text())
(target / "blobs" / "sha256").mkdir(parents=True)
for digest in [entry["digest"], manifest["config"]["digest"],
               *(layer["digest"] for layer in manifest["layers"])]:
    os.chmod(source / blob(digest), 0o644)
    try:
        os.link(source / blob(digest), target / blob(digest))
    except OSError:
        shutil.copyfile(source / blob(digest), target / blob(digest))
(target / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
entry = {**entry, "annotations": {REF: name}}
(target / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [entry]}))
EOF
tar -C "$IMAGE_DIR/oci" -cf "$IMAGE_DIR/gpufed-$IMAGE_TAG.oci.tar" oci-layout index.json blobs

# only the stages of this build stay cached
for tag in $(umoci ls --layout "$LAYOUT"); do
    case "$tag" in "$base_tag" | "$deps_tag" | "$app_tag") ;; *) umoci rm --image "$LAYOUT:$tag" ;; esac
done
umoci gc --layout "$LAYOUT"
for dir in "$CACHE"/wheels-* "$CACHE"/rootfs-*; do
    [ "$dir" = "$wheels" ] || [ "$dir" = "$rootfs" ] || rm -rf "$dir"
done
say "done: $(du -sh "$IMAGE_DIR/gpufed-$IMAGE_TAG.oci.tar" | cut -f1) ($IMAGE_DIR/oci:$IMAGE_TAG)"
