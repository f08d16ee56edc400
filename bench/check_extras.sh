#!/usr/bin/env bash
# Checks that the accelerator extras (cuda12, cuda13, tpu) resolve with constraints.txt to JAX's
# plugins of exactly the pinned jax, without installing anything: pip's resolver in a dry run
# (`pip install --dry-run --ignore-installed --report`), which reads the wheels' metadata from the
# index (PEP 658) instead of downloading the GPU wheels. Needs the package index; about 1.5 minutes
# per extra, so it is run by hand (its output is in docs/performance.md), not in CI.
#
#     bash bench/check_extras.sh [PYTHON]      # default: .venv/bin/python
set -euo pipefail
cd "$(dirname "$0")/.."
python="${1:-.venv/bin/python}"
jax_pin="$(sed -n 's/^jax==//p' constraints.txt)"
reports="$(mktemp -d)"
status=0
for extra in cuda12 cuda13 tpu; do
  "$python" -m pip install -q --dry-run --ignore-installed --no-cache-dir -c constraints.txt \
    ".[$extra]" --report "$reports/$extra.json" 2>/dev/null
  "$python" - "$reports/$extra.json" "$extra" "$jax_pin" <<'EOF' || status=1
import json
import sys

report, extra, jax_pin = sys.argv[1:]
installed = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.load(open(report))["install"]}
# The plugin and its PJRT runtime carry jax's version; libtpu has its own numbering (jax[tpu] names it).
family = sorted(n for n in installed if n.startswith(("jax", "libtpu")))
print(f"[{extra}] " + ", ".join(f"{n}=={installed[n]}" for n in family))
expected = {"cuda12": ["jax-cuda12-plugin", "jax-cuda12-pjrt"], "cuda13": ["jax-cuda13-plugin", "jax-cuda13-pjrt"], "tpu": []}[extra]
wrong = [n for n in ["jax", "jaxlib", *expected] if installed.get(n) != jax_pin]
if extra == "tpu" and "libtpu" not in installed:
    wrong.append("libtpu")
print(f"[{extra}] " + (f"does not match jax {jax_pin}: {wrong}" if wrong else f"resolves to jax {jax_pin}'s plugin"))
sys.exit(1 if wrong else 0)
EOF
done
exit "$status"
