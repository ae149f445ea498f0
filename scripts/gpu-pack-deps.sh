#!/usr/bin/env bash
# Packs the build dependencies a GPU machine without Debian's packages lacks (header-only
# nlohmann_json and CLI11, Gloo's headers, GoogleTest's static libraries and CMake
# packages) into .gpu-deps/ (ignored by git), for scripts/gpu-check.sh to use there as
# CMAKE_PREFIX_PATH. Run it here, after scripts/setup.sh; carry .gpu-deps with the tree.
set -euo pipefail
cd "$(dirname "$0")/.."
D=.gpu-deps
rm -rf "$D" && mkdir -p "$D/include" "$D/lib/cmake" "$D/share/cmake"
cp -r /usr/include/nlohmann /usr/include/CLI /usr/include/gloo /usr/include/gtest /usr/include/gmock "$D/include/"
cp -r /usr/share/cmake/nlohmann_json /usr/share/cmake/CLI11 "$D/share/cmake/"
cp /usr/lib/x86_64-linux-gnu/libgtest*.a /usr/lib/x86_64-linux-gnu/libgmock*.a "$D/lib/"
cp -r /usr/lib/x86_64-linux-gnu/cmake/GTest "$D/lib/cmake/"
# The packages name absolute Debian paths; point them at this folder instead.
grep -rl '/usr/include\|/usr/lib/x86_64-linux-gnu' "$D/share/cmake" "$D/lib/cmake" | while read -r f; do
  sed -i "s|/usr/lib/x86_64-linux-gnu|\${CMAKE_CURRENT_LIST_DIR}/../..|g; s|/usr/include|\${CMAKE_CURRENT_LIST_DIR}/../../../include|g" "$f"
done
du -sh "$D"
