#!/usr/bin/env bash
# Makes .gpu-carry/: what building corpc needs beyond a PyTorch wheel, copied from this machine's Debian packages, for
# scripts/gpu_check.sh on a GPU machine that has the wheel, a compiler, Meson and ninja but no package registry.
#   scripts/gpu_carry.sh            (re)make .gpu-carry/ in the repository root and ignore it in .git/info/exclude
# Then name .gpu-carry in the device tool's `carry` list; gpu_check.sh reads it from the repository root.
#
# What it holds, and why each part is laid out so:
#   include/          asio.hpp, asio/, doctest/: header-only, found by meson.build's cxx.has_header() through an
#                     -isystem in cpp_args (Asio ships no pkg-config file; doctest is looked up by CMake, then the header)
#   include-fmt/      fmt 9's headers, used header-only (FMT_HEADER_ONLY: no libfmt to carry); fmt.pc puts them on -I,
#                     which the compiler searches before any -isystem, so a wheel that ships fmt headers of its own
#                     under torch/include cannot mix versions inside one translation unit
#   include-openssl/  OpenSSL's headers, Debian's multiarch configuration.h and opensslconf.h merged in
#   lib/              libcrypto.a and libssl.a: linked statically, so the binaries do not depend on whether the GPU
#                     machine has libssl.so.3 (nor on the -dev symlinks libssl.so / libcrypto.so, which it may lack)
#   pkgconfig/        fmt.pc, libcrypto.pc, libssl.pc, openssl.pc, relative to their own folder (${pcfiledir})
#   pkgconf/          Debian's pkgconf and libpkgconf behind bin/pkg-config, for a machine without a pkg-config
#   MANIFEST          the packages and versions copied, and the date
# Needs: libasio-dev, libfmt-dev, doctest-dev, libssl-dev, pkgconf (scripts/setup.sh installs the first four).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
dest=$repo/.gpu-carry
multiarch=$(dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null || gcc -print-multiarch 2>/dev/null || echo x86_64-linux-gnu)
libdir=/usr/lib/$multiarch

missing=()
for pkg in libasio-dev libfmt-dev doctest-dev libssl-dev pkgconf libpkgconf3; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' || missing+=("$pkg")
done
if ((${#missing[@]})); then
  echo "gpu_carry: these Debian packages are not installed here: ${missing[*]} (apt-get install them first)" >&2
  exit 1
fi

rm -rf "$dest.tmp"
mkdir -p "$dest.tmp"/{include,include-fmt,include-openssl/openssl,lib,pkgconfig,pkgconf/bin,pkgconf/libexec,pkgconf/lib}
cd "$dest.tmp"

# Header-only libraries found through cpp_args.
cp -a /usr/include/asio.hpp /usr/include/asio include/
cp -a /usr/include/doctest include/
# fmt, header-only.
cp -a /usr/include/fmt include-fmt/
# OpenSSL: the generic headers and the architecture's configuration in one folder.
cp -a /usr/include/openssl/. include-openssl/openssl/
cp -a "/usr/include/$multiarch/openssl/." include-openssl/openssl/
cp -a "$libdir/libcrypto.a" "$libdir/libssl.a" lib/

version() { dpkg-query -W -f='${Version}' "$1" | sed 's/^[0-9]*://; s/[-+~].*//'; }
fmt_version=$(version libfmt-dev)
ssl_version=$(version libssl-dev)

cat >pkgconfig/fmt.pc <<EOF
prefix=\${pcfiledir}/..
includedir=\${prefix}/include-fmt

Name: fmt
Description: fmt $fmt_version headers, header-only (carried by scripts/gpu_carry.sh)
Version: $fmt_version
Cflags: -I\${includedir} -DFMT_HEADER_ONLY=1
Libs:
EOF
cat >pkgconfig/libcrypto.pc <<EOF
prefix=\${pcfiledir}/..
includedir=\${prefix}/include-openssl
libdir=\${prefix}/lib

Name: OpenSSL-libcrypto
Description: OpenSSL $ssl_version libcrypto, static (carried by scripts/gpu_carry.sh)
Version: $ssl_version
Cflags: -I\${includedir}
Libs: \${libdir}/libcrypto.a -ldl -pthread
EOF
cat >pkgconfig/libssl.pc <<EOF
prefix=\${pcfiledir}/..
includedir=\${prefix}/include-openssl
libdir=\${prefix}/lib

Name: OpenSSL-libssl
Description: OpenSSL $ssl_version libssl, static (carried by scripts/gpu_carry.sh)
Version: $ssl_version
Requires: libcrypto
Cflags: -I\${includedir}
Libs: \${libdir}/libssl.a
EOF
cat >pkgconfig/openssl.pc <<EOF
Name: OpenSSL
Description: OpenSSL $ssl_version, static (carried by scripts/gpu_carry.sh)
Version: $ssl_version
Requires: libssl libcrypto
EOF

# pkgconf for a machine without pkg-config: the binary and its library, started with that library on its path only.
cp -a "$(readlink -f /usr/bin/pkgconf)" pkgconf/libexec/pkgconf
cp -aL "$(ldconfig -p | awk '/libpkgconf\.so\.3 .*x86-64/ {print $NF; exit}')" pkgconf/lib/libpkgconf.so.3
cat >pkgconf/bin/pkg-config <<'EOF'
#!/bin/sh
# Debian's pkgconf, carried by scripts/gpu_carry.sh; its library beside it, for this process only.
here=$(dirname "$(readlink -f "$0")")/..
LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$here/libexec/pkgconf" "$@"
EOF
chmod +x pkgconf/bin/pkg-config

{
  echo "# .gpu-carry: made by scripts/gpu_carry.sh on $(date -u +%Y-%m-%dT%H:%MZ) from $(. /etc/os-release && echo "$PRETTY_NAME")"
  for pkg in libasio-dev libfmt-dev doctest-dev libssl-dev pkgconf libpkgconf3; do
    dpkg-query -W -f='${Package} ${Version}\n' "$pkg"
  done
} >MANIFEST

# Each .pc file must answer through the carried pkgconf, from wherever the folder lies.
for m in fmt libcrypto libssl openssl; do
  PKG_CONFIG_PATH="$dest.tmp/pkgconfig" PKG_CONFIG_LIBDIR=/nonexistent pkgconf/bin/pkg-config --cflags --libs "$m" >/dev/null \
    || { echo "gpu_carry: pkgconfig/$m.pc does not resolve" >&2; exit 1; }
done

cd "$repo"
rm -rf "$dest"
mv "$dest.tmp" "$dest"

exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qxF '/.gpu-carry/' "$exclude" 2>/dev/null || echo '/.gpu-carry/' >>"$exclude"

echo "gpu_carry: made $dest ($(du -sh "$dest" | cut -f1), $(find "$dest" -type f | wc -l) files); ignored through $exclude"
cat "$dest/MANIFEST"
