import glob, json, os, numpy as np, torch, agg
def one_sign(w, flip=False):  # the I(W) of AGG Eq. 3 over the eigenvectors as eigh returns them (or negated)
    w = w.double(); _, v = torch.linalg.eigh(w.T @ w); v = -v if flip else v
    lz = torch.logsumexp(w @ v, 0); return float(torch.exp(lz.min() - lz.max()))
runs = {}
for ck_path in sorted(glob.glob("out/sweep/runs/*/ckpt.pt")):
    ck = torch.load(ck_path, weights_only=True); W = ck["model"]["tok_emb.weight"]
    counts = torch.from_numpy(np.load(os.path.join(json.load(open(os.path.dirname(ck_path) + "/config.json"))["data_cache"], "counts.npy")))
    seen = counts > 0
    runs[os.path.basename(os.path.dirname(ck_path))] = dict(
        one_sign=one_sign(W), one_sign_flipped=one_sign(W, True), both_signs_all=agg.isotropy(W),
        both_signs_seen=agg.isotropy(W[seen]), unseen_tokens=int((~seen).sum()),
        mean_cosine_all=agg.mean_cosine(W), mean_cosine_seen=agg.mean_cosine(W[seen]))
json.dump({"command": "python - < results/isotropy_sign.py", "runs": runs}, open("results/isotropy_sign.json", "w"), indent=1)
for k, v in runs.items(): print(k, {a: round(b, 3) for a, b in v.items()})
