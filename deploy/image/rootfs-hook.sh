#!/bin/sh
# mmdebstrap's customize hook for the image's Debian layer (deploy/image/build.sh): $1 is the
# root filesystem being built. What member-agent/Dockerfile does on top of python:3.11-slim,
# done here on Debian's own python3. This file's text is part of the base layer's cache key.
set -eu
root="$1"

# A fixed, unprivileged user: the charts' securityContext runs as 10001 with a read-only root.
echo 'gpufed:x:10001:10001:gpufed:/nonexistent:/usr/sbin/nologin' >>"$root/etc/passwd"
echo 'gpufed:x:10001:' >>"$root/etc/group"
echo 'gpufed:!:::::::' >>"$root/etc/shadow"

# jemalloc, which the broker chart preloads (its values.yaml: allocator), at a path that does
# not depend on the architecture.
jemalloc="$(chroot "$root" dpkg -L libjemalloc2 | grep '/libjemalloc\.so\.2$')"
mkdir -p "$root/usr/local/lib"
ln -s "$jemalloc" "$root/usr/local/lib/libjemalloc.so.2"

# Nothing of the build's own bookkeeping in the image.
rm -rf "$root/var/log/"* "$root/var/cache/debconf/"*-old "$root/var/lib/dpkg/"*-old
