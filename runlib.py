"""Run plumbing shared by train_lm.py and train_nmt.py: the run and method flags, the resume policy, seeding and RNG
state, checkpoints (data only, loaded with weights_only=True), provenance and the JSON-lines log.
Models, data and training loops stay in each script; agg.py does not depend on this file."""
import argparse
import contextlib
import datetime
import hashlib
import json
import math
import os
import pickle
import platform
import random
import re
import shlex
import socket
import subprocess

import numpy as np
import torch

import agg

ROOT = os.path.dirname(os.path.abspath(__file__))

# The one list of run-control keys: config keys that steer an invocation and leave the trained model unchanged. They
# may change when a run is resumed, and runs that differ only in them are one experiment (eval.py's variants, grid.py's
# flag check). Each script adds its own (train_lm.RUN_CONTROL, train_nmt.RUN_CONTROL).
RUN_CONTROL = {"out", "resume", "overwrite", "stop_at", "device", "compile", "eval_interval", "log_interval", "log_to",
               "cache_dir"}
# These change the result but may be given again on resume: a run continued to a new length, or in another precision;
# and the corpus at another path (data_dir), which Run.begin accepts only when its fingerprint is the run's.
RESUME_MAY_CHANGE = {"max_steps", "dtype", "data_dir"}
# Of the run-control keys, the ones that follow the current invocation (not the saved config) unless given.
FOLLOW_INVOCATION = ("device", "resume", "stop_at", "overwrite", "compile")


# ------------------------------------------------------------------------------------------------------------ flags
def default_out(task, method, seed):
    """The run folder of a run without --out: out/TASK-METHOD-sSEED next to the scripts (grid.py: OUT/runs/METHOD-sSEED)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", f"{task}-{method}-s{seed}")


def add_run_flags(p, task):
    g = p.add_argument_group("run (the same in train_lm.py and train_nmt.py)")
    g.add_argument("--out", default=None, help=f"run folder (default out/{task}-METHOD-sSEED)")
    g.add_argument("--seed", type=int, default=0, help="seed of init, data order and dropout (process r: seed + r)")
    g.add_argument("--resume", action="store_true",
                   help="continue OUT/ckpt.pt exactly; `--out OUT --resume` alone reuses the saved config, and any "
                        "other flag given must match it (except run-control flags such as --max-steps, --device)")
    g.add_argument("--overwrite", action="store_true",
                   help="start afresh in an OUT that already holds a run (its files are removed, nothing else), or "
                        "train in a folder of other files (they are kept)")
    g.add_argument("--max-steps", type=int, default=None, help="optimizer steps (also the LR schedule's length)")
    g.add_argument("--stop-at", type=int, default=None,
                   help="checkpoint and stop after this step without changing the schedule (split a run into jobs)")
    g.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda if available)")
    g.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="autocast dtype of the matmuls, on CPU too (default: bfloat16 on CUDA, float32 on CPU); "
                        "float16 (V100, T4) adds dynamic loss scaling")
    g.add_argument("--compile", action="store_true", help="torch.compile the model")
    g.add_argument("--log-to", default="none", choices=["none", "tensorboard", "wandb"],
                   help="also send the train/valid records to TensorBoard (OUT/tensorboard) or Weights & Biases "
                        "(project $WANDB_PROJECT, default agg); log.jsonl is always written")
    return g


# hyper-parameters whose agg default is None, with their types; every other flag takes the type of agg's default
def method_hparam_types():
    """{hyper-parameter: type} over every method of agg.METHODS (agg.HPARAMS): the method flags both scripts accept."""
    missing = {k for cls in agg.METHODS.values() for k in cls.defaults} - set(agg.HPARAMS)
    if missing:
        raise RuntimeError(f"agg.HPARAMS lacks {sorted(missing)}")
    return {k: typ for k, (typ, _help) in agg.HPARAMS.items()}


def _bool(text):
    if text.lower() in ("1", "true", "yes"):
        return True
    if text.lower() in ("0", "false", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def method_flag(key):
    """The command-line flag of a method hyper-parameter (agg.HPARAMS key): lambda_ -> --lambda."""
    return "--" + key.rstrip("_").replace("_", "-")


def add_method_flags(p):
    g = p.add_argument_group("method (agg.METHODS); hyper-parameters are passed to agg.build_method only when given")
    g.add_argument("--method", default="mle", choices=list(agg.METHODS), metavar="METHOD",
                   help=f"one of: {', '.join(agg.METHODS)}")
    users = {}
    for name, cls in agg.METHODS.items():
        for key in cls.defaults:
            users.setdefault(key, []).append(name)
    for key, typ in method_hparam_types().items():
        shown = ", ".join(users[key][:3]) + (", ..." if len(users[key]) > 3 else "")
        g.add_argument(method_flag(key), dest=key, default=None,
                       type=_bool if typ is bool else typ, help=f"{agg.HPARAMS[key][1]} [{shown}]")
    g.add_argument("--rare-share", type=float, default=None,
                   help="AGG family: the rare group as a share of the vocabulary, turned into alpha from the train "
                        "counts and tokens per step (agg.alpha_for_rare_share) and logged as method_hparams.alpha; "
                        "means the same at any batch size, unlike alpha. Give this or --alpha")
    return g


def make_config(parser, resolve_config, fields):
    """A script's resolved config from its parser's defaults with `fields` (config keys) set, as if given as flags."""
    args = parser.parse_args([])
    unknown = set(fields) - set(vars(args))
    if unknown:
        raise TypeError(f"unknown config fields {sorted(unknown)}")
    vars(args).update(fields)
    return resolve_config(args, set(fields))


def explicit_flags(parser, argv):
    """The config keys given on the command line (parsed with every default suppressed)."""
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv)))


def method_args(cfg, preset_method=None):
    """(keywords, rare share) for agg.build_method from a run's config: the method flags given (each must apply to
    the method), then the preset's method settings (`preset_method`, e.g. AGPS's paper values, an alpha or a rare
    share) where the method takes them. agg.build_method applies the papers' defaults (AGG's window K = one epoch,
    agg-static's static_after, alpha from the rare share)."""
    name = cfg["method"]
    if name not in agg.METHODS:
        raise SystemExit(f"unknown --method {name!r}; valid: {', '.join(agg.METHODS)}")
    accepted = agg.METHODS[name].defaults
    kw = {}
    for key in method_hparam_types():
        if cfg.get(key) is None:
            continue
        if key not in accepted:
            raise SystemExit(f"{method_flag(key)} does not apply to --method {name} "
                             f"(its hyper-parameters: {', '.join(accepted) or 'none'})")
        kw[key] = cfg[key]
    preset_method = preset_method or {}
    for key, value in preset_method.items():  # e.g. AGPS's paper settings in the paper presets
        if key in accepted and key != "alpha" and key not in kw:
            kw[key] = value
    share = cfg.get("rare_share")
    if "alpha" not in accepted:
        if share is not None:
            raise SystemExit(f"--rare-share applies to the AGG family only, not --method {name}")
        return kw, None
    if share is not None and "alpha" in kw:
        raise SystemExit("give --alpha or --rare-share, not both: each sets AGG's rarity threshold")
    if share is None and "alpha" not in kw:
        if "alpha" in preset_method:
            kw["alpha"] = preset_method["alpha"]
        else:
            share = preset_method.get("rare_share")
    if share is not None and not 0 < share < 1:
        raise SystemExit(f"--rare-share {share}: must be a share of the vocabulary in (0, 1), e.g. 0.2")
    for key, value in kw.items():  # nan and inf pass a comparison with 0 unnoticed
        if isinstance(value, float) and not math.isfinite(value):
            raise SystemExit(f"{method_flag(key)} {value}: must be a finite number")
    if kw.get("alpha", 0) < 0:
        raise SystemExit(f"--alpha {kw['alpha']}: must be >= 0 (appearances per optimizer step)")
    return kw, share


def build_method(name, **kw):
    """agg.build_method for a training script: a hyper-parameter agg.py refuses (a share outside [0, 1], a window of
    2.5 steps) ends the run in one line that names it, before anything is written."""
    try:
        return agg.build_method(name, **kw)
    except ValueError as e:
        raise SystemExit(f"--method {name}: {e}") from None


# ----------------------------------------------------------------------------------------------------------- resume
def start_or_resume(cfg, explicit, task, run_control=RUN_CONTROL):
    """The resume policy of both scripts. Returns (cfg, checkpoint or None).
    --resume with a checkpoint: the saved config, updated with the flags given now; a flag given now that changes
    the run's result (not in run_control) must equal the saved value. Without --resume, an OUT that holds a run is
    refused unless --overwrite."""
    path = os.path.join(cfg["out"], "ckpt.pt")
    run_control = set(run_control) | RESUME_MAY_CHANGE
    if cfg["resume"] and os.path.exists(path):
        ck = load_checkpoint(path, task)
        saved = ck["config"]
        for key in sorted(explicit - set(run_control)):
            if saved.get(key) != cfg.get(key):
                raise SystemExit(f"{path} was written with {key}={saved.get(key)!r} but this run asks for "
                                 f"{key}={cfg.get(key)!r}. Resume with `--out {cfg['out']} --resume` alone (the "
                                 f"saved config is in {os.path.join(cfg['out'], 'config.json')}), or start a "
                                 f"separate run with a new --out.")
        merged = dict(saved)
        merged.update({k: cfg[k] for k in explicit if k in cfg})
        for key in FOLLOW_INVOCATION:
            merged[key] = cfg[key]
        return merged, ck
    if cfg["resume"]:  # no checkpoint yet: the same run from step 0, from its saved config (never from defaults)
        saved_path = os.path.join(cfg["out"], "config.json")
        if not os.path.exists(saved_path):
            raise SystemExit(f"--resume: {cfg['out']} holds no run to resume (no ckpt.pt, no config.json). Start it "
                             f"without --resume.")
        try:
            with open(saved_path) as f:
                saved = json.load(f)
        except (OSError, ValueError) as e:
            raise SystemExit(f"--resume: {saved_path} is unreadable ({e}); start the run afresh with --overwrite") from None
        if not isinstance(saved, dict) or "task" not in saved:
            raise SystemExit(f"--resume: {cfg['out']} holds no run to resume: its config.json was not written by "
                             f"train_lm.py / train_nmt.py (a Hugging Face export?); choose the run's folder")
        if saved["task"] != task:
            raise SystemExit(f"--resume: {cfg['out']} holds a {saved.get('task')!r} run, not {task!r}")
        for key in sorted(explicit - set(run_control)):
            if key in saved and saved[key] != cfg.get(key):
                raise SystemExit(f"{saved_path} was written with {key}={saved[key]!r} but this run asks for "
                                 f"{key}={cfg.get(key)!r}. Resume with `--out {cfg['out']} --resume` alone, or start "
                                 f"a separate run with a new --out.")
        merged = {k: saved.get(k, v) for k, v in cfg.items()}
        merged.update({k: cfg[k] for k in explicit if k in cfg})
        for key in FOLLOW_INVOCATION:
            merged[key] = cfg[key]
        print(f"--resume: no checkpoint in {cfg['out']} yet: restarting its run ({saved.get('method')}, seed "
              f"{saved.get('seed')}) from step 0 with its saved config")
        return merged, None
    if os.path.exists(path) and not cfg["overwrite"]:
        raise SystemExit(f"{path} already exists: pass --resume to continue it, --overwrite to start afresh, or "
                         f"choose another --out")
    check_new_out(cfg["out"], cfg["overwrite"])
    return cfg, None


_LOCKS = {}  # run folder -> the open file whose lock says "a process writes here" (released when the process ends)
RUN_FILES = ("ckpt.pt", "ckpt_best.pt", "config.json", "log.jsonl", "tokenizer.json")  # a run's files (--overwrite)
# the temporary files of a run's atomic writes (write_text, save_checkpoint): NAME.tmpPID
RUN_TMP = re.compile(r"(ckpt(_best|_\d+)?\.pt|config\.json|log\.jsonl|tokenizer\.json)\.tmp\d+")
# a run's sub-folders and the files it writes in them: --snapshot-steps, --log-to tensorboard
RUN_SUBDIRS = {"snapshots": re.compile(r"emb_\d+\.pt(\.tmp\d+)?"),
               "tensorboard": re.compile(r"events\.out\.tfevents\..+")}


def run_config(out):
    """The config.json in folder `out` as a dict; None when there is none or it does not parse; False when it is
    JSON that train_lm.py / train_nmt.py did not write (no "task": a Hugging Face export's, say)."""
    try:
        with open(os.path.join(out, "config.json")) as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return None
    return saved if isinstance(saved, dict) and "task" in saved else False


def is_run_file(name):
    """True for the names a run writes at the top of its folder (what --overwrite may remove, and .lock)."""
    return (name in RUN_FILES or name in RUN_SUBDIRS or name in (".lock", "wandb")
            or bool(re.fullmatch(r"ckpt_\d+\.pt", name) or RUN_TMP.fullmatch(name)))


def check_new_out(out, overwrite):
    """A new run's --out, before anything is written: a folder with files no run wrote (notes, a Hugging Face export)
    is refused unless --overwrite (which keeps them); a config.json of something else is refused always, since the
    run would replace it."""
    if not os.path.isdir(out):
        return
    if run_config(out) is False:
        raise SystemExit(f"--out {out}: its config.json was not written by train_lm.py / train_nmt.py (a Hugging Face "
                         f"export?) and a run would replace it: choose another --out")
    foreign = sorted(n for n in os.listdir(out) if not is_run_file(n))
    has_run = os.path.exists(os.path.join(out, "ckpt.pt")) or run_config(out)
    if foreign and not has_run and not overwrite:
        raise SystemExit(f"--out {out}: holds files no run wrote ({', '.join(foreign[:5])}"
                         f"{', ...' if len(foreign) > 5 else ''}) and no run: choose a new or empty --out, or pass "
                         f"--overwrite to train there anyway (those files are kept)")


def lock_run(out):
    """Make this process the one writer of run folder `out`: an exclusive lock on OUT/.lock that the kernel drops
    when the process ends (a crash never leaves it stuck). Another live writer is refused with its pid."""
    import fcntl
    if os.path.abspath(out) in _LOCKS:  # this process holds it already (a run resumed in the same process)
        return
    try:
        os.makedirs(out, exist_ok=True)
        f = open(os.path.join(out, ".lock"), "a+")
    except OSError as e:
        raise SystemExit(f"cannot write the run folder {out} ({e.strerror}): choose a writable --out") from None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        pid = f.read().strip() or "?"
        f.close()
        raise SystemExit(f"{out} is being written by another process (pid {pid}): wait for it to end, stop it, or "
                         f"choose another --out") from None
    f.seek(0)
    f.truncate()
    f.write(str(os.getpid()))
    f.flush()
    _LOCKS[os.path.abspath(out)] = f
    snaps = os.path.join(out, "snapshots")
    for folder, ours in ((out, RUN_TMP), (snaps, re.compile(r"emb_\d+\.pt\.tmp\d+"))):
        for name in os.listdir(folder) if os.path.isdir(folder) else ():
            if ours.fullmatch(name):  # temporary files of our writes that were killed (NAME.tmpPID), nothing else
                os.remove(os.path.join(folder, name))


def unlock_run(out):
    """Release lock_run's lock (the end of a run; a process that ends releases it anyway)."""
    f = _LOCKS.pop(os.path.abspath(out), None)
    if f is not None:
        f.close()


def clear_run(out):
    """--overwrite (and a new run in a folder with an old one's files): remove the files a run writes - RUN_FILES, the
    ckpt_STEP.pt snapshots, snapshots/emb_STEP.pt, the tensorboard/ events of --log-to - and nothing else. A
    sub-folder left empty is removed; files the run did not write stay."""
    for path in [os.path.join(out, n) for n in RUN_FILES] + snapshots(out):
        if os.path.isfile(path):
            os.remove(path)
    for sub, ours in RUN_SUBDIRS.items():
        folder = os.path.join(out, sub)
        if os.path.isdir(folder):
            for name in os.listdir(folder):
                if ours.fullmatch(name) and os.path.isfile(os.path.join(folder, name)):
                    os.remove(os.path.join(folder, name))
            if not os.listdir(folder):
                os.rmdir(folder)


def same_data(was, now):
    """True when a run's data fingerprint `was` (None: not recorded) names the data `now` (the cache folder's name:
    corpus and tokenizer hash). An NMT run saved when that name began with its --data-dir folder's name matches on
    the rest (languages and hash)."""
    return was is None or was == now or (now is not None and now.startswith("dir-") and was.endswith(now[3:]))


def run_segments(out, argv, resumed_step, ck=None):
    """Provenance of every segment of a run, oldest first: the earlier segments (from config.json, or from the
    checkpoint `ck` when config.json is missing or unreadable) plus this one (git commit, argv, agg.py's hash, the
    step it started at). A changed agg.py is reported on resume."""
    old = []
    if resumed_step is not None:
        saved = run_config(out)
        if saved:
            old = saved.get("segments") or [{k: saved.get(k) for k in ("git_commit", "argv", "agg_sha256")}
                                            | {"start_step": 0}]
        else:  # config.json lost or damaged: the copy the checkpoint carries
            old = list((ck or {}).get("provenance") or [])
            print(f"warning: {os.path.join(out, 'config.json')} is missing or unreadable: the earlier segments' "
                  f"provenance comes from the checkpoint" + ("" if old else " (which has none: it is lost)"))
    now = dict(provenance(argv), start_step=resumed_step or 0)
    if old and old[-1].get("agg_sha256") not in (None, now["agg_sha256"]):
        print(f"warning: agg.py changed since this run's last segment (sha256 {old[-1]['agg_sha256'][:12]} -> "
              f"{now['agg_sha256'][:12]}): the run continues with the new code; config.json keeps both")
    return old + [{k: now[k] for k in ("git_commit", "git_dirty", "argv", "agg_sha256", "start_step")}]


def method_record(stats, targets):
    """The method's stats (agg's method.stats, of the last micro-batch) as log keys: rare_* become method_rare_*, and
    R_over_B is the rare count over the step's `targets` (AGG's R / B)."""
    rec = {("method_" + k if k.startswith("rare") else k): v for k, v in stats.items() if k != "nll"}
    if "rare_count" in stats:
        rec["R_over_B"] = stats["rare_count"] / max(targets, 1)
    return rec


def check_run_flags(cfg):
    """The run flags both scripts share, checked before anything is written: one line per mistake, with the fix."""
    if cfg.get("stop_at") is not None and not 1 <= cfg["stop_at"] <= cfg["max_steps"]:
        raise SystemExit(f"--stop-at {cfg['stop_at']}: must be a step in [1, --max-steps {cfg['max_steps']}]")
    if not (math.isfinite(cfg["lr"]) and cfg["lr"] >= 0):
        raise SystemExit(f"--lr {cfg['lr']}: must be a finite number >= 0, e.g. 1e-3")
    if cfg.get("warmup") is not None and cfg["warmup"] < 0:
        raise SystemExit(f"--warmup {cfg['warmup']}: must be >= 0 steps")
    if not re.fullmatch(r"cpu|cuda(:\d+)?", str(cfg.get("device", "cpu"))):
        raise SystemExit(f"--device {cfg['device']}: unknown device; use cpu, cuda or cuda:N")
    if str(cfg.get("device", "cpu")).startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device {cfg['device']}: CUDA is not available on this machine; use --device cpu")
    if os.path.exists(cfg["out"]) and not os.path.isdir(cfg["out"]):
        raise SystemExit(f"--out {cfg['out']}: is a file, not a folder; choose another --out")


class StopSignal:
    """`with StopSignal() as stop:` SIGTERM (a preempted job), SIGHUP (the terminal or ssh session closed) and SIGINT
    (Ctrl-C) set a flag instead of killing the run, so the loop can write a checkpoint at the next step boundary and
    exit cleanly; a second Ctrl-C stops at once. The previous handlers come back on exit."""

    def __enter__(self):
        import signal
        self.name, self.signal, self.old = None, signal, {}
        try:
            for s in (signal.SIGTERM, signal.SIGINT) + ((signal.SIGHUP,) if hasattr(signal, "SIGHUP") else ()):
                self.old[s] = signal.signal(s, self._handle)
        except ValueError:  # not the main thread: signals keep their default behaviour
            pass
        return self

    def __exit__(self, *exc):
        for s, handler in self.old.items():
            self.signal.signal(s, handler)

    def _handle(self, signum, frame):
        if self.name is not None and signum == self.signal.SIGINT:
            raise KeyboardInterrupt
        self.name = self.signal.Signals(signum).name

    def received(self, ddp=False, device="cpu"):
        """True once a signal came (on any rank under DDP: every rank stops at the same step)."""
        flag = self.name is not None
        if ddp:
            t = torch.tensor([float(flag)], device=device)
            torch.distributed.all_reduce(t)
            flag = bool(t.item())
            if flag and self.name is None:
                self.name = "a signal on another rank"
        return flag


# ------------------------------------------------------------------------------------------------------------ a run
class Run:
    """The life of one run folder, the same in both training scripts: resolve the config (the saved one on --resume),
    DDP and seeding, the data cache built once, exact resume, the lock, config.json with provenance, log.jsonl,
    atomic checkpoints (with --keep-last snapshots), SIGTERM / SIGINT at a step boundary and a clean exit.

        with runlib.Run(cfg, explicit, argv, "lm", CKPT_FORMAT, RUN_CONTROL) as run:
            data = run.prepare(prepare_lm)                                # rank 0 builds the cache, the others wait
            ...model, method, optimizer, scheduler...
            step = run.restore(model, opt, sched, schedule, method, scaler)    # 0, or the checkpoint's step
            run.begin(n_params=...)                                       # config.json and log.jsonl
            while step < run.stop_step:
                ...; run.log(record); run.checkpoint(step, model, opt, sched, method, scaler)
                if run.stopping(step): break

    A run stopped by a signal exits with status 1 and says how to continue it."""

    def __init__(self, cfg, explicit, argv, task, fmt, run_control):
        self.cfg, self.ck = start_or_resume(cfg, set(explicit), task, run_control)
        self.argv, self.task, self.fmt = list(argv), task, fmt
        self.ddp, self.rank, self.world = setup_ddp(self.cfg)
        self.master = self.rank == 0
        self.device = self.cfg["device"]
        self.out = self.cfg["out"]
        self.ckpt_path = os.path.join(self.out, "ckpt.pt")
        self.stop_step = min(self.cfg["max_steps"], self.cfg["stop_at"] or self.cfg["max_steps"])
        self.tracker, self.signal, self.step, self.segments = None, None, 0, None
        if self.ck is not None:
            self.print(f"resuming {self.ckpt_path} at step {self.ck['step']}")
        seed_everything(self.cfg["seed"], self.rank)

    def print(self, *args, **kw):
        if self.master:
            print(*args, **kw)

    def __enter__(self):
        self.signal = StopSignal().__enter__()  # SIGTERM / SIGINT: checkpoint at the next step boundary
        return self

    def __exit__(self, exc_type, exc, tb):
        self.signal.__exit__()
        if self.tracker is not None:
            self.tracker.close()
        if self.ddp and exc_type is None:
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()
        if self.master:
            unlock_run(self.out)
        if exc_type is None and self.signal.name is not None and self.step < self.stop_step:
            script = "train_lm.py" if self.task == "lm" else "train_nmt.py"
            raise SystemExit(f"{self.signal.name}: stopped at step {self.step}, checkpoint {self.ckpt_path} written; "
                             f"`python {script} --out {self.out} --resume` continues it")
        return False

    def prepare(self, prepare_fn):
        """The task's data (prepare_fn(cfg, log) of data.py): rank 0 builds the cache, the other ranks wait for it
        without a time limit, then read it."""
        if not self.master:
            wait_for_rank0(self.ddp)
        data = prepare_fn(self.cfg, log=print if self.master else (lambda *a, **k: None))
        if self.master:
            wait_for_rank0(self.ddp)
        return data

    def restore(self, model, opt, sched, schedule, method, scaler):
        """A resumed run continues its checkpoint exactly (restore_training); returns the step (0 for a new run)."""
        if self.ck is not None:
            self.step = restore_training(self.ck, self.ckpt_path, model, opt, sched, schedule, method, scaler,
                                         self.rank, self.world, self.fmt, self.print)
        return self.step

    def begin(self, tokenizer_json, **info):
        """Take the folder (lock; a new run clears an old one's files), check that a resumed run reads the data it
        started with, write config.json (the config, provenance and `info`), the tokenizer and the log."""
        if self.master:
            lock_run(self.out)  # one writer per run folder
            resumed = self.ck is not None
            if not resumed:
                clear_run(self.out)  # a new run (or --overwrite, or a restart before any checkpoint): no old files
            was = self.ck["config"].get("data_fingerprint") if resumed else None
            if not same_data(was, self.cfg.get("data_fingerprint")):
                raise SystemExit(f"{self.ckpt_path}: the corpus or tokenizer changed since this run started (its "
                                 f"data was {was}, now {self.cfg['data_fingerprint']}): restore the original files, "
                                 f"or start a new run with another --out")
            write_text(os.path.join(self.out, "tokenizer.json"), tokenizer_json)
            segments = self.segments = run_segments(self.out, self.argv, self.step if resumed else None, self.ck)
            prov = provenance(self.argv)
            prov.update({k: segments[0][k] for k in ("git_commit", "argv", "agg_sha256") if k in segments[0]})
            write_json(os.path.join(self.out, "config.json"), dict(
                self.cfg, **prov, segments=segments, world_size=self.world, **info,
                resumed_from_step=self.step if resumed else None))
            start_log(os.path.join(self.out, "log.jsonl"), self.step if resumed else None)
        self.tracker = Tracker(self.cfg["log_to"] if self.master else "none", self.out, self.cfg)

    def wrap(self, model):
        """The module the forward pass goes through: `model` compiled (--compile) and under DDP its wrapper; the
        methods and checkpoints keep using `model` itself."""
        fwd = torch.compile(model) if self.cfg["compile"] else model
        if self.ddp:
            device = torch.device(self.device)
            fwd = torch.nn.parallel.DistributedDataParallel(
                fwd, device_ids=[device.index if device.index is not None else 0] if device.type == "cuda" else None)
        return fwd

    def log(self, record):
        """One record (step, split, numbers) to log.jsonl and the --log-to tracker."""
        if self.master:
            append_log(os.path.join(self.out, "log.jsonl"), record, self.tracker)

    def log_valid(self, step, record):
        """A validation record; a non-finite valid loss stops the run as diverged, before it is checkpointed."""
        self.log(dict(step=step, split="valid", **record))
        if not math.isfinite(record["loss"]):
            raise SystemExit(f"step {step}: the valid loss is {record['loss']} (diverged); {self.ckpt_path} keeps the "
                             f"last good checkpoint. Lower --lr or check the method's hyper-parameters")

    def checkpoint(self, step, model, opt, sched, method, scaler, **extra):
        """ckpt.pt, written atomically, with everything an exact resume needs (+ `extra`, e.g. the data position) and
        the provenance of the run's segments (run_segments: a copy of config.json's);
        --keep-last N also keeps the model of the last N checkpoints as ckpt_STEP.pt (checkpoint averaging). Every
        rank calls it (the RNG states are gathered); a model with non-finite weights is never saved."""
        self.step = step
        rngs = all_rng_states(self.ddp, self.world)
        if not all(bool(torch.isfinite(p).all()) for p in model.parameters()):
            raise SystemExit(f"step {step}: the model has non-finite weights (diverged); {self.ckpt_path} keeps the "
                             f"last good checkpoint. Lower --lr or check the method's hyper-parameters")
        if not self.master:
            return
        head = dict(format=self.fmt, model=model.state_dict(), step=step, config=self.cfg, task=self.task)
        # the provenance of every segment rides along: config.json can be lost or damaged, the checkpoint is the run
        save_checkpoint(self.ckpt_path, dict(head, optimizer=opt.state_dict(), scheduler=sched.state_dict(),
                                             method=method.state_dict(), scaler=scaler.state_dict(), rng=rngs,
                                             provenance=self.segments, **extra))
        if self.cfg.get("keep_last"):  # model-only snapshots for checkpoint averaging
            save_checkpoint(os.path.join(self.out, f"ckpt_{step}.pt"), head)
            for old in snapshots(self.out)[:-self.cfg["keep_last"]]:
                os.remove(old)

    def stopping(self, step):
        """True when a signal asks the run to stop (on any rank: every rank stops at the same step)."""
        self.step = step
        return step < self.stop_step and self.signal.received(self.ddp, self.device)


def snapshots(out_dir):
    """The ckpt_STEP.pt snapshots of a run (--keep-last), oldest first."""
    import glob
    found = [(int(m.group(1)), p) for p in glob.glob(os.path.join(out_dir, "ckpt_*.pt"))
             if (m := re.fullmatch(r"ckpt_(\d+)\.pt", os.path.basename(p)))]
    return [p for _, p in sorted(found)]


# ------------------------------------------------------------------------------------------------------ checkpoints
def tensor_checksum(state):
    """sha256 over every tensor of a (nested) checkpoint dict, in key order: detects bytes changed on disk."""
    h = hashlib.sha256()

    def visit(obj, key):
        if torch.is_tensor(obj):
            h.update(key.encode())
            h.update(obj.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(obj, dict):
            for k in sorted(obj, key=str):
                if k != "checksum":
                    visit(obj[k], f"{key}/{k}")
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                visit(v, f"{key}/{i}")
    visit(state, "")
    return h.hexdigest()


def save_checkpoint(path, state):
    """Atomic (a crash mid-write never leaves a half checkpoint under the real name), with a checksum of its tensors
    that load_checkpoint verifies."""
    state = dict(state, checksum=tensor_checksum(state))
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        torch.save(state, tmp)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:  # a full disk or a folder that became read-only (torch wraps some as RuntimeError)
        if os.path.exists(tmp):
            os.remove(tmp)
        raise SystemExit(f"cannot write {path} ({type(e).__name__}: {str(e)[:200]}); the previous checkpoint is "
                         f"intact. Free disk space or make the folder writable, then --resume") from None


def load_error(e, limit=200):
    """The text of a torch.load error without torch's advice to load with weights_only=False, which would let a
    crafted file run code: never the fix for a checkpoint of this project."""
    parts = re.split(r"(?<=[.:])\s+|\n+", str(e))
    keep = [p for p in parts if p.strip() and not re.search(r"weights_only|trusted source|file an issue", p, re.I)]
    return " ".join(keep)[:limit]


def load_checkpoint(path, task=None):
    """Load a checkpoint as data (weights_only=True: a crafted pickle cannot run code) with clear errors."""
    if not os.path.isfile(path):
        raise SystemExit(f"{path}: no checkpoint there. Check --out, or start a new run without --resume.")
    try:
        ck = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if "global" in str(e).lower():  # it names a function or class to call: what a crafted pickle does
            raise SystemExit(f"{path} is not a plain checkpoint of this project: its pickle asks to run code or "
                             f"build objects a checkpoint never holds, so it was refused and nothing in it ran. "
                             f"Use a run folder written by train_lm.py / train_nmt.py.") from None
        raise SystemExit(f"{path}: corrupted or not a checkpoint ({type(e).__name__}: {load_error(e)}). Delete it "
                         f"(or start with --overwrite) and train again, or restore a good copy.") from None
    except Exception as e:
        raise SystemExit(f"{path}: corrupted or not a checkpoint ({type(e).__name__}: {load_error(e)}). Delete it "
                         f"(or start with --overwrite) and train again, or restore a good copy.") from None
    if not isinstance(ck, dict) or "config" not in ck or "model" not in ck:
        raise SystemExit(f"{path} is not a checkpoint of train_lm.py / train_nmt.py")
    if "checksum" in ck and tensor_checksum(ck) != ck["checksum"]:
        raise SystemExit(f"{path}: its tensors do not match the checksum written with them (the file was damaged "
                         f"after it was written). Restore a good copy, or resume from an earlier checkpoint.")
    found = ck["task"] = ck.get("task") or ck["config"].get("task")
    if task is not None and found != task:
        raise SystemExit(f"{path} is a checkpoint of task {found!r}, not {task!r}: use the script of that task, or "
                         f"give a different --out.")
    return ck


def checkpoint_file(path, checkpoint="last"):
    """The checkpoint of a run: `path` a run folder (checkpoint: last = ckpt.pt, best = ckpt_best.pt, the lowest
    validation PPL) or a checkpoint file."""
    return os.path.join(path, {"last": "ckpt.pt", "best": "ckpt_best.pt"}[checkpoint]) if os.path.isdir(path) else path


def load_state(model, ck, path):
    """Load a checkpoint's weights into the model its own config builds, with a clear error when they do not fit."""
    try:
        model.load_state_dict(ck["model"])
    except RuntimeError as e:
        raise SystemExit(f"{path} does not fit the model of its own config ({str(e)[:200]}): the checkpoint is "
                         f"inconsistent; retrain the run") from None
    return model


# -------------------------------------------------------------------------------------------------- seeding and RNG
def seed_everything(seed, rank=0):
    """Process r draws from seed + r, so ranks get different dropout masks."""
    torch.manual_seed(seed + rank)
    np.random.seed(seed + rank)
    random.seed(seed + rank)


def rng_state():
    """Every RNG of this process as tensors and plain Python values (loadable with weights_only=True)."""
    key, state, pos, has_gauss, gauss = np.random.get_state()
    version, mt, gauss_next = random.getstate()
    return dict(torch=torch.get_rng_state(),
                cuda=list(torch.cuda.get_rng_state_all()) if torch.cuda.is_available() else [],
                numpy=dict(key=key, state=torch.from_numpy(state.astype(np.int64)), pos=int(pos),
                           has_gauss=int(has_gauss), gauss=float(gauss)),
                python=dict(version=version, state=list(mt), gauss_next=gauss_next))


def set_rng_state(s):
    torch.set_rng_state(s["torch"])
    if s["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])
    n = s["numpy"]
    np.random.set_state((n["key"], n["state"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    p = s["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss_next"]))


def all_rng_states(ddp, world):
    """rng_state() of every rank, gathered (rank 0 saves them all)."""
    if not ddp:
        return [rng_state()]
    states = [None] * world
    torch.distributed.all_gather_object(states, rng_state())
    return states


def finished(folder):
    """True when the run folder's checkpoint holds its last step (runs a grid or regime map can reuse)."""
    path = os.path.join(folder, "ckpt.pt")
    if not os.path.exists(path):
        return False
    ck = load_checkpoint(path)
    return ck["step"] >= ck["config"]["max_steps"]


def restore_training(ck, path, model, opt, sched, schedule, method, scaler, rank, world, fmt, log=print):
    """Continue checkpoint `ck` (read from `path`) exactly, the one resume path of both training scripts: the
    weights, the optimizer, the scheduler (with this invocation's schedule: --max-steps may have changed), the
    method's state (AGG's counters, FRAGE's discriminator), the float16 loss scale and every process's RNG.
    Returns the step. The data position (LM: sequences, NMT: epoch and cursor) is the caller's."""
    missing = [k for k in ("model", "optimizer", "scheduler", "method", "step", "rng") if k not in ck]
    if ck.get("format", fmt) != fmt or missing:
        raise SystemExit(f"{path} is not a {fmt.split('/')[0]}.py checkpoint (format {ck.get('format')}, missing "
                         f"{missing}): use --overwrite or a new --out")
    try:
        model.load_state_dict(ck["model"])
    except RuntimeError as e:
        raise SystemExit(f"checkpoint {path} does not fit this model ({str(e)[:300]}); resume with the original "
                         f"flags or train into a new --out") from None
    opt.load_state_dict(ck["optimizer"])
    sched.load_state_dict(ck["scheduler"])
    sched.lr_lambdas = [schedule] * len(opt.param_groups)
    method.load_state_dict(ck["method"])
    method.to(next(model.parameters()).device)
    if ck.get("scaler") and scaler.is_enabled():
        scaler.load_state_dict(ck["scaler"])
    restore_rng(ck["rng"], rank, world, log)
    return ck["step"]


def restore_rng(states, rank, world, log=print):
    if len(states) == world:
        set_rng_state(states[rank])
    else:
        log(f"warning: the checkpoint holds the RNG states of {len(states)} processes, this run has {world}: "
            f"dropout noise will differ from an uninterrupted run")


# ---------------------------------------------------------------------------------------------------- DDP, autocast
def wait_for_rank0(ddp):
    """A barrier that does not time out while rank 0 prepares the data (BPE training and token ids of a large corpus
    can outlast NCCL's default timeout): a gloo group with a one-week limit. Every rank calls it once."""
    if ddp:
        group = torch.distributed.new_group(backend="gloo", timeout=datetime.timedelta(days=7))
        torch.distributed.barrier(group=group)


def setup_ddp(cfg):
    """Initialise torch.distributed under torchrun; returns (ddp, rank, world). CUDA ranks get their own device."""
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    if world > 1:
        backend = "nccl" if cfg["device"].startswith("cuda") else "gloo"
        if backend == "nccl":
            cfg["device"] = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
            torch.cuda.set_device(cfg["device"])
        torch.distributed.init_process_group(backend)
    return world > 1, rank, world


def default_device(cfg):
    if cfg.get("device") is None:
        cfg["device"] = "cuda" if torch.cuda.is_available() else "cpu"
    if cfg.get("dtype") is None:
        cfg["dtype"] = "bfloat16" if cfg["device"].startswith("cuda") else "float32"


def autocast(cfg):
    """A context factory: autocast to --dtype bfloat16 / float16 on the run's device (CPU too), else a no-op."""
    if cfg["dtype"] in ("bfloat16", "float16"):
        device_type, dtype = torch.device(cfg["device"]).type, getattr(torch, cfg["dtype"])
        return lambda: torch.autocast(device_type, dtype=dtype)
    return contextlib.nullcontext


def grad_scaler(cfg):
    """float16's dynamic loss scaling (torch.amp.GradScaler: a step with inf/NaN gradients is skipped and the scale
    lowered); for float32 / bfloat16 a disabled scaler whose calls are no-ops, so the step is unchanged."""
    return torch.amp.GradScaler(torch.device(cfg["device"]).type, enabled=cfg["dtype"] == "float16")


NO_SCALER = torch.amp.GradScaler("cpu", enabled=False)


def lr_schedule(kind, warmup, max_steps):
    """The LambdaLR factor of the peak lr at each step. cosine: linear warm-up, then cosine decay to 10% of the peak
    at max_steps; inverse-sqrt: Vaswani et al.'s, normalised so the peak (at step `warmup`) is the configured lr."""
    def cosine(step):
        if step < warmup:
            return (step + 1) / warmup
        t = min(1.0, (step - warmup) / max(1, max_steps - warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))

    def inverse_sqrt(step):
        if warmup == 0:  # no warm-up: the peak at the first step, then 1 / sqrt(step)
            return 1 / math.sqrt(step + 1)
        return min((step + 1) / warmup, math.sqrt(warmup / (step + 1)))
    return {"cosine": cosine, "inverse-sqrt": inverse_sqrt}[kind]


def add_optimizer_flags(g):
    g.add_argument("--optimizer", default="adamw", choices=["adamw", "coupled-adam"],
                   help="adamw; or coupled-adam: the vocabulary matrices (the tied embedding, and the output matrix with "
                        "--untie) take Coupled Adam's update (agg.CoupledAdamW: the second moment averaged over the "
                        "vocabulary), every other parameter AdamW's")
    g.add_argument("--embedding-weight-decay", type=float, default=None,
                   help="weight decay of the vocabulary matrices (default: --weight-decay, as every matrix)")


def make_optimizer(model, cfg, vocab_matrices=()):
    """AdamW (betas 0.9 / 0.98 as in Vaswani et al. and the papers' fairseq set-ups); weight decay (cfg weight_decay)
    on matrices and embeddings only, never on biases and LayerNorm gains. The vocabulary matrices take
    --embedding-weight-decay when given, and with --optimizer coupled-adam Coupled Adam's update (agg.CoupledAdamW)."""
    lr, wd = cfg["lr"], cfg["weight_decay"]
    coupled, vocab_wd = cfg.get("optimizer", "adamw") == "coupled-adam", cfg.get("embedding_weight_decay")
    own = coupled or vocab_wd is not None  # the vocabulary matrices in a group of their own
    vocab = {id(p) for p in vocab_matrices} if own else set()
    groups = [{"params": [p for p in model.parameters() if p.dim() >= 2 and id(p) not in vocab], "weight_decay": wd},
              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    if own:
        groups.append({"params": list(vocab_matrices), "weight_decay": wd if vocab_wd is None else vocab_wd})
    if not coupled:
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.98), eps=1e-8)
    return agg.CoupledAdamW([dict(g, coupled=g is groups[-1]) for g in groups], lr=lr, betas=(0.9, 0.98), eps=1e-8)


# ------------------------------------------------------------------------------------------ provenance and logging
def git_commit():
    """(HEAD's commit, whether the code differs from it): dirty counts the Python files and requirements only, so a
    results file or a document written beside the code does not mark a run."""
    try:
        c = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=5)
        d = subprocess.run(["git", "status", "--porcelain", "--", "*.py", "requirements*.txt"], cwd=ROOT,
                           capture_output=True, text=True, timeout=5)
        return (c.stdout.strip() or None), (bool(d.stdout.strip()) if c.returncode == 0 else None)
    except Exception:
        return None, None


def kernel_fingerprint(threads=None):
    """A hash of one fixed float32 step through the kernels training leans on (the tied head's matmul at the cpu
    preset's shapes, layer norm, GELU, cross-entropy and their backward), at this process's thread count. Two hosts
    whose kernels round differently (another instruction set, another BLAS path) get different hashes, and a run
    then ends elsewhere (RESULTS: the same command, valid PPL 294.46 on one host and 286.42 on another). `threads`:
    the thread count to hash at (default: this process's)."""
    if threads is not None and threads != torch.get_num_threads():
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return kernel_fingerprint()
        finally:
            torch.set_num_threads(before)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 128, generator=g, requires_grad=True)
    w = (torch.randn(8192, 128, generator=g) / 128 ** 0.5).requires_grad_()
    h = torch.nn.functional.gelu(torch.nn.functional.layer_norm(x, (128,)))
    loss = torch.nn.functional.cross_entropy(h @ w.T, torch.randint(0, 8192, (1024,), generator=g))
    loss.backward()
    data = b"".join(t.detach().numpy().tobytes() for t in (loss, x.grad, w.grad))
    return hashlib.sha256(data).hexdigest()[:16]


def versions():
    out = dict(python=platform.python_version(), torch=torch.__version__, numpy=np.__version__,
               platform=platform.platform(), threads=torch.get_num_threads(),  # CPU results depend on the thread count
               cpu_capability=torch.backends.cpu.get_cpu_capability(),  # and on the kernels: AVX2 and AVX512 differ
               kernels=kernel_fingerprint())  # and on the host: pairs share it (eval.pair_difference)
    for name in ("tokenizers", "sacrebleu"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            pass
    return out


def segments_argv(segments):
    """One argv for a run made of segments: the first segment's flags, each overridden by the same flag of a later
    segment (a resumed run continued with a new --out or --max-steps), --resume dropped. Resume is exact, so this
    trains the same run unless a later --max-steps moved a cosine schedule (run_command then gives each segment)."""
    groups = []  # [flag, values...] in order of first appearance
    for seg in segments:
        new = []
        for a in seg.get("argv") or []:
            if a.startswith("--") or not new:
                new.append([a])
            else:
                new[-1].append(a)
        for g in new:
            if g[0] == "--resume":
                continue
            at = next((i for i, h in enumerate(groups) if h[0].split("=")[0] == g[0].split("=")[0]), None)
            if at is None:
                groups.append(g)
            else:
                groups[at] = g
    return [a for g in groups for a in g]


def run_command(saved, script, root=ROOT):
    """The command that reproduces a run from its config.json (`saved`): its argv (segments_argv when it was
    resumed) with paths relative to the repository, the thread count it ran with (CPU results depend on it), and
    --lr / --warmup spelled out when they came from a preset (presets can change; the values cannot)."""
    segments = saved.get("segments") or [saved]
    if saved.get("schedule") == "cosine" and any(a.split("=")[0] == "--max-steps" for s in segments[1:]
                                                 for a in s.get("argv") or []):
        # the cosine decay depends on --max-steps: a run continued to a new length is its segments, in order
        first = run_command({**saved, "segments": segments[:1]}, script, root)
        return " && ".join([first] + [shlex.join(["python", script, *map(str, segments_argv([s])), "--resume"])
                                      for s in segments[1:]])
    argv = [os.path.relpath(a, root) if os.path.isabs(a) else a for a in segments_argv(segments)]
    for key in ("lr", "warmup"):
        flag = "--" + key
        if flag not in argv and saved.get(key) is not None:
            argv += [flag, f"{saved[key]:g}" if isinstance(saved[key], float) else str(saved[key])]
    threads = (saved.get("versions") or {}).get("threads")
    threads = threads if isinstance(threads, int) and not isinstance(threads, bool) and threads > 0 else None
    # every word shell-quoted, the thread count a number: a crafted config.json cannot put shell text in the command
    return (f"OMP_NUM_THREADS={threads} " if threads else "") + shlex.join(["python", script, *map(str, argv)])


def provenance(argv):
    """What config.json records about the code and machine a run came from."""
    commit, dirty = git_commit()
    with open(agg.__file__, "rb") as f:
        agg_sha = hashlib.sha256(f.read()).hexdigest()
    return dict(versions=versions(), git_commit=commit, git_dirty=dirty, argv=list(argv), agg_sha256=agg_sha)


def write_json(path, obj):
    """Atomic JSON write."""
    write_text(path, json.dumps(obj, indent=1, default=str) + "\n")


def write_text(path, text):
    """Atomic text write: a crash mid-write leaves the old file (or none), never half a file. Makes the folder."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def start_log(path, resumed_step=None):
    """A new run empties log.jsonl; a resumed one drops the records an interrupted run wrote after its checkpoint."""
    if resumed_step is None or not os.path.exists(path):
        open(path, "w").close()
        return
    keep = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            try:
                if line.strip() and json.loads(line).get("step", 0) <= resumed_step:
                    keep.append(line)
            except json.JSONDecodeError:
                print(f"warning: {path} line {i} is not complete JSON (a torn write): dropped")
    with open(path, "w") as f:
        f.writelines(keep)


def append_log(path, record, tracker=None):
    """One record to the JSON-lines log (and the --log-to tracker). A full disk stops the run in one line: the last
    checkpoint is intact, and a resumed run drops a record cut short (start_log)."""
    try:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
    except OSError as e:
        raise SystemExit(f"cannot append to {path} ({e.strerror or e}): free disk space, then --resume") from None
    if tracker is not None:
        tracker(record)


class Tracker:
    """--log-to: mirrors each log.jsonl record's numbers to TensorBoard (OUT/tensorboard) or Weights & Biases, as
    SPLIT/KEY at the record's step. Off ("none") by default; log.jsonl stays the record of the run."""

    def __init__(self, kind, out, cfg):
        self.kind, self.writer = kind, None
        if kind == "tensorboard":
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise SystemExit("--log-to tensorboard needs the tensorboard package: pip install tensorboard") from None
            self.writer = SummaryWriter(os.path.join(out, "tensorboard"))
        elif kind == "wandb":
            try:
                import wandb
            except ImportError:
                raise SystemExit("--log-to wandb needs the wandb package: pip install wandb (and wandb login)") from None
            run_id = hashlib.sha256(os.path.abspath(out).encode()).hexdigest()[:16]  # one wandb run per folder
            self.writer = wandb.init(project=os.environ.get("WANDB_PROJECT", "agg"), name=os.path.basename(out),
                                     id=run_id, resume="allow", config=cfg, dir=out)

    def __call__(self, record):
        if self.writer is None:
            return
        split = record.get("split", "train")
        scalars = {f"{split}/{k}": float(v) for k, v in record.items()
                   if k not in ("step", "split") and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self.kind == "tensorboard":
            for k, v in scalars.items():
                self.writer.add_scalar(k, v, record["step"])
            self.writer.flush()
        else:
            self.writer.log(scalars, step=record["step"])

    def close(self):
        if self.writer is not None:
            (self.writer.close if self.kind == "tensorboard" else self.writer.finish)()


# ------------------------------------------------------------------------------------------------- Hugging Face hub
def hub_reachable(timeout=3.0):
    """True if a TCP connection to the Hugging Face hub (HF_ENDPOINT) opens within `timeout` seconds."""
    from urllib.parse import urlparse
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


@contextlib.contextmanager
def hub_offline(offline):
    """While loading with `datasets`: if `offline`, read the local cache only (no retry loop against an unreachable
    hub); the switches are restored afterwards."""
    import datasets
    import huggingface_hub.constants as hub_constants
    saved = (datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE)
    if offline:
        datasets.config.HF_HUB_OFFLINE = hub_constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE = saved
