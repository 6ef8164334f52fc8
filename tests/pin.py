"""Pin the numerics of a checkout before and after a refactor: tiny fixed-seed runs of both scripts
(straight, and stopped + resumed) hashed by model, optimizer, method, scheduler and RNG state, and
the data caches they built by their bytes. Exact hashes hold on one host only (its kernels round
their own way), so run both checkouts here:

    python tests/pin.py /path/to/old/checkout old.json
    python tests/pin.py . new.json
    cmp old.json new.json
"""

import glob
import hashlib
import json
import os
import subprocess
import sys
import tempfile

import torch

root, out = os.path.abspath(sys.argv[1]), sys.argv[2]
sys.path.insert(0, os.path.join(root, "tests"))
# (the checkout's own tiny flags and corpus)
from conftest import LM_TINY, NMT_TINY, write_corpus  # noqa: E402


def digest(obj, h):
    if torch.is_tensor(obj):
        h.update(obj.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, dict):
        for k in sorted(obj, key=str):
            h.update(str(k).encode())
            digest(obj[k], h)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            digest(v, h)
    else:
        h.update(repr(obj).encode())


def part(ck, key):
    h = hashlib.sha256()
    digest(ck.get(key), h)
    return h.hexdigest()[:16]


def run(script, args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(
        [sys.executable, script, *args], cwd=root, env=env, capture_output=True, text=True
    )
    if r.returncode:
        raise SystemExit(
            f"{script} {' '.join(args)} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
        )


def hashes(path):
    ck = torch.load(path, weights_only=True)
    # the RNG states a resume restores
    ck["rng"] = [{k: r[k] for k in ("torch", "cuda")} for r in ck["rng"]]
    return {
        k: part(ck, k)
        for k in ("model", "optimizer", "method", "scheduler", "scaler", "rng", "step")
    }


res = {}
tmp = tempfile.mkdtemp()
data = write_corpus(os.path.join(tmp, "data"))


def pin(name, script, base):
    """A run straight through and the same run stopped at step 3 and resumed: both hashed."""
    a, b = (os.path.join(tmp, name.replace(" ", "_") + end) for end in ("_a", "_b"))
    run(script, base + ["--out", a])
    run(script, base + ["--out", b, "--stop-at", "3"])
    run(script, ["--out", b, "--resume"])
    res[name], res[name + " (resumed)"] = (
        hashes(os.path.join(a, "ckpt.pt")),
        hashes(os.path.join(b, "ckpt.pt")),
    )
    print(name, res[name]["model"], res[name + " (resumed)"]["model"], flush=True)


steps = ["--seed", "3", "--max-steps", "6", "--eval-interval", "3"]
for m in [
    ("mle",),
    ("agg",),
    ("ul+agg",),
    ("agps",),
    ("frage",),
    ("center",),
    ("zloss",),
    ("cosreg",),
    ("freeze-rare",),
    ("mle", "--optimizer", "coupled-adam"),
    ("agg", "--untie"),
    ("agg", "--output-bias"),
]:
    pin(
        "lm " + " ".join(m),
        "train_lm.py",
        [
            "--data-dir",
            data,
            "--cache-dir",
            os.path.join(tmp, "cache"),
            *LM_TINY,
            "--method",
            *m,
            *steps,
        ],
    )
for m in ["mle", "agg", "frage"]:
    pin(
        "nmt " + m,
        "train_nmt.py",
        [
            *NMT_TINY,
            "--synthetic-size",
            "300",
            "--method",
            m,
            *steps,
            "--cache-dir",
            os.path.join(tmp, "nmtcache"),
        ],
    )
# the data caches the runs above built
for cache in sorted(glob.glob(os.path.join(tmp, "*cache", "*"))):
    h = hashlib.sha256()
    for f in sorted(os.listdir(cache)):
        h.update(f.encode())
        h.update(open(os.path.join(cache, f), "rb").read())
    res["cache " + os.path.basename(os.path.dirname(cache)) + "/" + os.path.basename(cache)] = (
        h.hexdigest()[:16]
    )
json.dump(res, open(out, "w"), indent=1, sort_keys=True)
print("wrote", out)
