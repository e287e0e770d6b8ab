#!/bin/bash
# Carry duet's build dependencies to a GPU machine that has CUDA, NCCL and Open MPI but no package
# registry (and lacks libuv, protobuf-c, jansson, libyaml, PCRE2, http-parser, Criterion and UCX's
# headers): download Debian's packages here, unpack them there.
#
#   tools/gpu_deps.sh fetch DIR    on a Debian 12 machine with apt: download the .deb files into DIR
#   tools/gpu_deps.sh unpack DIR   on the GPU machine: unpack DIR's .deb files under /opt/duet-deps
#                                  and print the environment to use: eval "$(tools/gpu_deps.sh unpack DIR)"
#
# Keep DIR out of git (e.g. `echo /.devdeps/ >> .git/info/exclude`). bench/gpu_check.sh runs the
# unpack step itself when DEPS=DIR is set.
set -euo pipefail
cmd=${1:-}
dir=${2:-.devdeps}
root=/opt/duet-deps
case "$cmd" in
fetch)
  mkdir -p "$dir"
  cd "$dir"
  # The libraries, their -dev packages, and what they pull in that an Ubuntu 24.04 CUDA image lacks.
  pkgs=(libuv1 libuv1-dev libprotobuf-c1 libprotobuf-c-dev protobuf-c-compiler libprotoc32
        libprotobuf32 libjansson4 libjansson-dev libyaml-0-2 libyaml-dev libhttp-parser2.9
        libhttp-parser-dev libpcre2-8-0 libpcre2-dev libxxhash0 libxxhash-dev libcriterion3
        libcriterion-dev libnanomsg5 libgit2-1.5 libmbedtls14 libmbedx509-1 libmbedcrypto7
        libssh2-1 libffi8 libucx-dev libucx0)
  failed=0
  for p in "${pkgs[@]}"; do
    apt-get download "$p" > /dev/null 2>&1 || { echo "gpu_deps: could not download $p" >&2; failed=1; }
  done
  echo "gpu_deps: $(ls ./*.deb | wc -l) packages in $dir" >&2
  exit $failed
  ;;
unpack)
  [ -d "$dir" ] || { echo "gpu_deps: no folder $dir" >&2; exit 1; }
  mkdir -p "$root"
  for f in "$dir"/*.deb; do dpkg -x "$f" "$root"; done
  # The .pc and CMake files name /usr as their prefix: point them at the unpacked tree.
  find "$root" -name '*.pc' -exec sed -i "s#^prefix=/usr#prefix=$root/usr#" {} +
  find "$root" -path '*cmake/ucx*' -name '*.cmake' -exec sed -i "s#set(prefix \"/usr\")#set(prefix \"$root/usr\")#" {} +
  # Only shared libraries are carried, so drop criterion.pc's static-link requirements.
  find "$root" -name 'criterion.pc' -exec sed -i '/^Requires.private/d;/^Libs.private/d' {} +
  lib=$root/usr/lib/x86_64-linux-gnu
  echo "export PKG_CONFIG_PATH=$lib/pkgconfig:$root/usr/share/pkgconfig:\${PKG_CONFIG_PATH:-}"
  echo "export CMAKE_PREFIX_PATH=$root/usr:\${CMAKE_PREFIX_PATH:-}"
  echo "export LD_LIBRARY_PATH=$lib:\${LD_LIBRARY_PATH:-}"
  echo "export PATH=$root/usr/bin:\$PATH"
  echo "export CPATH=$root/usr/include:\${CPATH:-}"
  echo "export LIBRARY_PATH=$lib:\${LIBRARY_PATH:-}"
  ;;
*)
  sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'
  [ "$cmd" = "-h" ] || [ "$cmd" = "--help" ] && exit 0
  exit 2
  ;;
esac
