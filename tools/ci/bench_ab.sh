#!/usr/bin/env bash
# `supermem bench train` at two versions of the code in one device call, interleaved: BEFORE, a source
# tree (git archive REV | tar -x -C DIR, untracked so the device gets it), then this tree, R times
# (default 2). BEFORE runs with this tree's built _C (the same allocator where csrc/ did not change, so
# the rows compare the Python above it). The arguments after DIR go to both benches. Prints per row the
# median step and peak of each side.
#   bash tools/ci/bench_ab.sh DIR --model all --modes "planned 75%,planned 50%" --repeats 1
# (--repeats 1: the bench runs its allocator rows --repeats times each; R repeats the whole comparison)
set -u
cd "$(dirname "$0")/../.."
before=$1
shift
export OUT=${OUT:-$(mktemp -d)}
t0=$SECONDS
if [ "${BUILT:-0}" != 1 ]; then  # BUILT=1: the caller built it already (as tools/ci/gpu_groups.sh)
  python -m pip install -q --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1 ||
    { tail -20 "$OUT/build.log"; exit 1; }
fi
cp supermem/_C*.so "$before/supermem/"
echo "built in $((SECONDS - t0)) s on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
(cd "$before" && PYTHONPATH=$PWD python -c "import supermem; print('before:', supermem.__file__)")
for r in $(seq "${R:-2}"); do
  (cd "$before" && PYTHONPATH=$PWD python -m supermem bench train "$@" --json "$OUT/before$r.json" >"$OUT/before$r.log" 2>&1)
  python -m supermem bench train "$@" --json "$OUT/after$r.json" >"$OUT/after$r.log" 2>&1
  echo "repeat $r done ($((SECONDS - t0)) s)"
done
python - "$OUT" "${R:-2}" <<'PY'
import json, statistics, sys
out, n = sys.argv[1], int(sys.argv[2])
runs = {side: [json.load(open(f"{out}/{side}{r}.json")) for r in range(1, n + 1)] for side in ("before", "after")}
for model in runs["after"][0]["models"]:
    print(f"{model}: config | before ms (runs) | after ms (runs) | after/before | peak GiB before / after")
    for row in runs["after"][0]["models"][model]:
        c = row["config"]
        def pick(side, key):
            return [r.get(key) for run in runs[side] for r in run["models"][model] if r["config"] == c and r.get(key)]
        b, a = pick("before", "step_ms"), pick("after", "step_ms")
        pb, pa = pick("before", "peak_alloc_bytes"), pick("after", "peak_alloc_bytes")
        if not a or not b:
            print(f"  {c}: missing (before {len(b)}, after {len(a)} runs)")
            continue
        mb, ma = statistics.median(b), statistics.median(a)
        gib = lambda v: f"{statistics.median(v) / 2**30:.2f}" if v else "-"
        print(f"  {c} | {mb:.1f} ({', '.join(f'{x:.1f}' for x in b)}) | {ma:.1f} ({', '.join(f'{x:.1f}' for x in a)})"
              f" | {ma / mb:.3f} | {gib(pb)} / {gib(pa)}")
PY
