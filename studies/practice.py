"""AGG against what practitioners do today, at the cpu preset, every rival tuned as in
studies.rivals.

    # train, evaluate, select; rerun to go on
    python -m studies.practice --jobs 2 --results results/lm_practice.json
    # the study so far: JSON, pictures
    python -m studies.practice --no-train --results results/lm_practice.json

The protocol (this project's choices):
- the knobs (PRACTICE): untie late (--untie-at 0.33 / 0.67: tied, then the output matrix a copy of
  the tied one; modded-nanogpt's speedrun unties at 2/3), a separate lr for the vocabulary matrices
  (--embedding-lr x0.3 / x3 / x10, then x30 and x100: x30 added after AGG's seed-0 sweep put its
  best at x10, the grid's edge, x100 when AGG's x30 runs were still improving at step 2,000 of
  2,400; nanochat trains its embedding far faster than its head), logit soft-capping
  (--logit-softcap 15 / 30 / 60: Gemma 2's 30, nanochat's 15); each with MLE and with AGG, AGG's
  share fixed at the preset's 0.2 (the headline's; studies.rivals' validation selects 0.05 for AGG
  alone); MLE, and AGG over its share 0.05 / 0.2 / 0.4, without them;
- each rival selected as in studies.rivals (its lr x its knob at seed 0, two finalists on seeds
  0-2), on seeds 0-4; every other knob value at the selected lr on seeds 0-2; each paired with MLE
  by seed (AGG's share 0.2 on seeds 0-4: the headline's pair on this host, fixed before AGG's sweep
  ran); AGG with a knob paired with MLE with the same knob too (does AGG add anything to the knob?),
  at their selections and at each knob value when both use one lr;
- pairs on one host and every run evaluated by eval.py as in studies.rivals; selections read
  validation only; each rival's lr sensitivity at its selected knob from the seed-0 sweep
  (rivals.lr_sensitivity), beside studies.rivals'.
"""

from studies import rivals, scale

KNOBS = {
    "untie-at": [(f"at{f:g}", ["--untie-at", f"{f:g}"]) for f in (0.33, 0.67)],
    "emb-lr": [(f"x{m:g}", ["--embedding-lr", f"{m:g}"]) for m in (0.3, 3, 10, 30, 100)],
    "softcap": [(f"cap{c:g}", ["--logit-softcap", f"{c:g}"]) for c in (15, 30, 60)],
}
# name: (method, flags, [(knob label, knob flags)]), as studies.rivals.RIVALS: each knob with MLE,
# then with AGG 0.2
PRACTICE = {
    "mle": rivals.RIVALS["mle"],
    "agg": rivals.RIVALS["agg"],
    **{
        name: rival
        for knob, knobs in KNOBS.items()
        for name, rival in (
            (knob, ("mle", [], knobs)),
            ("agg+" + knob, ("agg", ["--rare-share", "0.2"], knobs)),
        )
    },
}


class Practice(rivals.Rivals):
    label, name, title = "out/practice", "practice", "AGG and today's practice"
    table, seeds, knob_seeds = PRACTICE, {rival: 5 for rival in PRACTICE}, {("agg", "share0.2"): 5}
    pairs, lr_also = (
        [(knob, "agg+" + knob) for knob in KNOBS],
        f"{scale.ROOT}/results/lm_rivals.json",
    )


if __name__ == "__main__":
    scale.main(None, Practice)
