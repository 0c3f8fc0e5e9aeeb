#!/usr/bin/env bash
# `pip install .` as a user types it, in a fresh venv that has torch (also run by .ci/run):
#   1. without torch, `pip install --no-deps .` stops at once with setup.py's one line (NO_TORCH);
#   2. with torch 2.13.0 (the CPU wheel on local disk), plain `pip install .` (build isolation on) builds
#      against that torch, with the C++ standard its TorchConfig.cmake declares, and leaves it installed.
# Works on a copy of the tracked tree (removed on exit), as a clean clone has it. About 3-4 minutes on
# 2 cores, almost all of it the extension's build.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir "$work/src"
git -C "$root" ls-files -z | (cd "$root" && xargs -0 cp --parents -t "$work/src")
python3 -m venv "$work/venv"
py="$work/venv/bin/python"
cd "$work/src"

start=$SECONDS
if "$py" -m pip install --no-deps . >"$work/no_torch.log" 2>&1; then
  echo "pip_install_check: the build went on without torch"; exit 1
fi
grep -q "supermem: no installed PyTorch to build against" "$work/no_torch.log" ||
  { tail -30 "$work/no_torch.log"; echo "pip_install_check: no NO_TORCH line"; exit 1; }
echo "pip_install_check: without torch, one line after $((SECONDS - start)) s"

"$py" -m pip install -q torch==2.13.0
start=$SECONDS
"$py" -m pip install -v . >"$work/install.log" 2>&1 || { tail -40 "$work/install.log"; exit 1; }
echo "pip_install_check: pip install . built in $((SECONDS - start)) s"
declared=$(grep -ohE "CXX_STANDARD[[:space:]]+[0-9]+" \
  "$("$py" -c 'import torch, os; print(os.path.dirname(torch.__file__))')/share/cmake/Torch/TorchConfig.cmake" |
  grep -oE "[0-9]+$" | head -1)
grep -q "supermem: C++${declared:-17}\b" "$work/install.log" ||
  { grep "supermem: C++" "$work/install.log"; echo "pip_install_check: not built as C++${declared:-17}"; exit 1; }
cd /  # import the installed package, not the source tree
"$py" - <<'EOF'
import torch

import supermem
import supermem._C

assert torch.__version__.startswith("2.13.0"), f"pip install . replaced torch: {torch.__version__}"
assert "site-packages" in supermem._C.__file__, supermem._C.__file__
print(f"pip_install_check: ok (torch {torch.__version__}, {supermem._C.__file__})")
EOF
