# Sourced by scripts/spdk.sh and scripts/fio.sh: downloads a Debian source package's files
# through a private apt configuration (one deb-src line), so the system's sources stay as they
# are.
#
#   debian_source_download WORKDIR SUITE PACKAGE
#
# leaves what apt fetched in WORKDIR/dl (apt may report a 404 for the .dsc while the orig
# tarball, all the callers need, arrives anyway). Uses $MIRROR (default deb.debian.org).
debian_source_download() {
    local work=$1 suite=$2 pkg=$3
    local mirror=${MIRROR:-http://deb.debian.org/debian}
    mkdir -p "$work/apt/lists/partial" "$work/dl"
    echo "deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror $suite main" \
        >"$work/apt/sources.list"
    local aptopts=(-q -o "Dir::Etc::SourceList=$work/apt/sources.list" -o Dir::Etc::SourceParts=/dev/null
        -o "Dir::State::Lists=$work/apt/lists")
    apt-get "${aptopts[@]}" update >/dev/null 2>&1
    (cd "$work/dl" && apt-get "${aptopts[@]}" source --download-only "$pkg" >/dev/null 2>&1 || true)
}
