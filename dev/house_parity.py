"""What a set of runs produces, hashed: the check that a refactor changed no behaviour.

Runs a fixed set of configurations (every model, every cache policy and consistency, FAE, SCA,
Herald, dynamic tables, the disk store, prepared Criteo-format data with its recipe, W = 1 and 2)
for a few steps each and prints one JSON line per run: the hash of its loss log, of every table
file of its final checkpoint, and of its summary.json without the keys that differ between two
runs of the same code (times, rates, paths, sizes of the host).

    python -m dev.house_parity --out before.jsonl          # on the old tree
    python -m dev.house_parity --out after.jsonl           # on the new one
    python -m dev.house_parity --compare before.jsonl after.jsonl

The volatile keys are found, not listed: with --repeat the whole set runs twice and a summary key
that differs between the two runs is left out of both (printed once).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile

from dev import criteo_file
from trainer.tools.cli import bad_input

STEPS = ["train.steps=24", "train.log_every=1"]
RUNS: list[tuple[str, int, list[str]]] = [
    ("dlrm", 1, []),
    ("wdl", 1, ["model=wdl"]),
    ("deepfm", 1, ["model=deepfm"]),
    ("dcn", 1, ["model=dcn"]),
    ("lru-bsp", 1, ["cache=lru", "consistency=bsp"]),
    ("lfu-ssp", 1, ["cache=lfu", "consistency=ssp"]),
    ("lfu_pinned-asp", 1, ["cache=lfu_pinned", "consistency=asp"]),
    ("fae", 1, ["placement=fae"]),
    ("sca", 1, ["placement=sca"]),
    ("herald", 1, ["schedule=herald"]),
    ("dynamic", 1, ["embedding.kind=dynamic", "embedding.capacity=600"]),
    ("disk", 1, ["embedding.store=disk", "embedding.store_dir={tmp}/store", "embedding.store_cache_bytes=20000"]),
    ("criteo", 1, ["data=criteo", "data.dir={criteo}"]),
    ("w2-dlrm", 2, ["comm=torch"]),
    ("w2-lru-ssp", 2, ["comm=torch", "cache=lru", "consistency=ssp"]),
    ("w2-lfu_pinned-asp", 2, ["comm=torch", "cache=lfu_pinned", "consistency=asp"]),
    ("w2-sca", 2, ["comm=torch", "placement=sca"]),
    ("w2-herald", 2, ["comm=torch", "schedule=herald"]),
    ("w2-fae", 2, ["comm=torch", "placement=fae"]),
    ("w2-dynamic", 2, ["comm=torch", "embedding.kind=dynamic", "embedding.capacity=600"]),
    ("w2-criteo", 2, ["comm=torch", "data=criteo", "data.dir={criteo}"]),
]


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def _flat(d, prefix=""):
    if isinstance(d, dict):
        for k, v in d.items():
            yield from _flat(v, f"{prefix}{k}.")
    elif isinstance(d, list) and any(isinstance(x, (dict, list)) for x in d):
        for i, v in enumerate(d):
            yield from _flat(v, f"{prefix}{i}.")
    else:
        yield prefix[:-1], d


def prepare_criteo(root: str) -> str:
    train, test = os.path.join(root, "train.tsv"), os.path.join(root, "test.tsv")
    criteo_file.write(train, 3000, seed=1)
    criteo_file.write(test, 600, seed=2)
    out = os.path.join(root, "criteo-data")
    subprocess.run([sys.executable, "scripts/prepare_criteo.py", "--train", train, "--test", test, "--out", out], check=True, capture_output=True)
    return out


def run_one(name: str, world: int, args: list[str], tmp: str, criteo: str) -> dict:
    out = os.path.join(tmp, name)
    args = [a.format(tmp=out, criteo=criteo) for a in args]
    common = STEPS + [f"hydra.run.dir={out}", f"checkpoint.dir={out}/ck"] + args
    if world == 1:
        cmd = [sys.executable, "-m", "trainer"] + common
    else:
        cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nproc_per_node", str(world),
               "--master_port", "29731", "-m", "trainer"] + common
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if p.returncode != 0:
        return {"run": name, "error": p.returncode, "tail": (p.stdout + p.stderr)[-600:]}
    losses, tables = [], {}
    for folder, dirs, files in sorted(os.walk(out)):
        dirs.sort()
        if "metrics.jsonl" in files:
            losses += [json.loads(x).get("loss") for x in open(os.path.join(folder, "metrics.jsonl"))]
        for f in sorted(files):
            if f.endswith(".bin") and f"{os.sep}store" not in folder:
                with open(os.path.join(folder, f), "rb") as fh:
                    tables[os.path.relpath(os.path.join(folder, f), out)] = _sha(fh.read())
    summary = dict(_flat(json.loads(open(os.path.join(out, "summary.json")).read().replace(tmp, "<tmp>"))))
    return {"run": name, "losses": _sha(json.dumps(losses).encode()), "n_losses": len(losses),
            "tables": tables, "summary": summary}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dev.house_parity", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write the runs' lines (with their summaries) to this file")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="compare two --out files")
    ap.add_argument("--only", nargs="+", metavar="RUN", help=f"run only these ({', '.join(r[0] for r in RUNS)})")
    a = ap.parse_args(argv)
    if a.compare:
        for f in a.compare:
            if not os.path.isfile(f):
                return bad_input(FileNotFoundError(f"--compare {f}: no such file"))
        return compare(*a.compare)
    unknown = sorted(set(a.only or ()) - {r[0] for r in RUNS})
    if unknown:
        return bad_input(ValueError(f"--only {' '.join(unknown)}: not a run of this set "
                                    f"({', '.join(r[0] for r in RUNS)})"))
    tmp = tempfile.mkdtemp(prefix="house-parity-")
    try:
        criteo = prepare_criteo(tmp)
        lines = []
        for name, world, args in RUNS:
            if a.only and name not in a.only:
                continue
            r = run_one(name, world, args, tmp, criteo)
            print(json.dumps({k: v for k, v in r.items() if k != "summary"}), flush=True)
            lines.append(json.dumps(r))
        if a.out:
            with open(a.out, "w") as f:
                f.write("\n".join(lines) + "\n")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


# keys that differ between two runs of the same code: clocks, rates, memory and disk readings, and the
# disk store's byte counts and page faults (its read-ahead runs beside the step, so how much it read
# ahead varies) and its temporary directory
VOLATILE = ("time", "sec", "_s", "wall", "ms", "rate", "rss", "host", "pid", "date", "latency",
            "available", "started", "ended", "seconds", "elapsed", "peak", "bytes_free", "store.bytes_",
            "store.dir", "sync_faults")


def compare(before: str, after: str) -> int:
    b = {r["run"]: r for r in map(json.loads, open(before))}
    c = {r["run"]: r for r in map(json.loads, open(after))}
    bad = 0
    for name in b:
        x, y = b[name], c.get(name)
        if y is None:
            print(f"{name}: missing after"); bad += 1; continue
        if "error" in x or "error" in y:
            print(f"{name}: error before={x.get('error')} after={y.get('error')}"); bad += 1; continue
        diffs = []
        if x["losses"] != y["losses"]:
            diffs.append("losses")
        if x["tables"] != y["tables"]:
            diffs.append(f"tables {sorted(set(x['tables'].items()) ^ set(y['tables'].items()))[:4]}")
        for k in sorted(set(x["summary"]) | set(y["summary"])):
            if any(v in k.lower() for v in VOLATILE):
                continue
            if x["summary"].get(k) != y["summary"].get(k):
                diffs.append(f"summary {k}: {x['summary'].get(k)!r} -> {y['summary'].get(k)!r}")
        print(f"{name}: {'same' if not diffs else '; '.join(diffs)}")
        bad += bool(diffs)
    print(f"{len(b) - bad} of {len(b)} runs the same")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
