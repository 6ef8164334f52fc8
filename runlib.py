"""A toolbox for train_lm.py and train_nmt.py: flags, the method, the optimizer's parameter groups,
atomic writes, checkpoints loaded as data, and the steps of a run's life that each train() calls in
order: start (the resume rule), take_folder (the lock), write_provenance, restore, checkpoint,
log, stop_signals. Nothing here decides when they run."""

import argparse
import contextlib
import fcntl
import gc
import glob
import hashlib
import json
import math
import os
import pathlib
import platform
import re
import signal
import subprocess
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

import agg

ROOT = os.path.dirname(os.path.abspath(__file__))
# Config keys that steer an invocation, not the model: they may change on resume; runs differing
# only in them (and the seed) are one experiment. Each script adds its own.
RUN_CONTROL = {"out", "resume", "overwrite", "stop_at", "device", "compile", "eval_interval"}
RUN_CONTROL |= {"log_interval", "cache_dir", "prepare_only", "wandb"}
# These change the result but may be given again on resume: a run continued to a new length, in
# another precision, or its corpus at another path (accepted when the data fingerprint is the
# run's).
RESUME_MAY_CHANGE = {"max_steps", "dtype", "data_dir"}
# never taken from the saved config
FOLLOW_INVOCATION = ("device", "resume", "stop_at", "overwrite", "compile")
# what --overwrite removes
RUN_FILES = ("ckpt.pt", "ckpt_best.pt", "config.json", "log.jsonl", "tokenizer.json")


# ------------------------------------------------------------------------------------- flags
def add_run_flags(p, task):
    g = p.add_argument_group("run (the same in train_lm.py and train_nmt.py)")
    g.add_argument("--out", help=f"run folder (default out/{task}-METHOD-sSEED)")
    g.add_argument("--seed", type=int, default=0, help="seed of init, data order and dropout")
    g.add_argument(
        "--resume", action="store_true", help="continue OUT/ckpt.pt exactly, with its saved config"
    )
    g.add_argument(
        "--overwrite",
        action="store_true",
        help="start afresh in OUT (only a run's own files are removed)",
    )
    g.add_argument("--max-steps", type=int, help="optimizer steps (also the LR schedule's length)")
    g.add_argument("--stop-at", type=int, help="checkpoint and stop after this step (split a run)")
    g.add_argument("--device", help="cpu | cuda | cuda:N (default: cuda if available)")
    g.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        help="autocast dtype (default: bfloat16 on CUDA, float32 on CPU); "
        "float16 adds loss scaling",
    )
    g.add_argument("--compile", action="store_true", help="torch.compile the model")
    g.add_argument(
        "--wandb",
        action="store_true",
        help="also log to Weights & Biases (project $WANDB_PROJECT or agg)",
    )
    g.add_argument("--prepare-only", action="store_true", help="build the data cache and stop")
    g = p.add_argument_group(
        "method (agg.METHODS; hyper-parameters go to agg.build_method only when given), optimizer"
    )
    methods = list(agg.METHODS)
    g.add_argument(
        "--method",
        default="mle",
        choices=methods,
        metavar="METHOD",
        help=f"one of: {', '.join(methods)}",
    )
    agg.add_method_flags(g)
    g.add_argument(
        "--rare-share",
        type=float,
        help="AGG family: the alpha whose rare group is this share of the vocab",
    )
    g.add_argument(
        "--optimizer",
        default="adamw",
        choices=["adamw", "coupled-adam"],
        help="coupled-adam: the vocabulary matrices take Coupled Adam's update (agg.CoupledAdamW)",
    )
    g.add_argument(
        "--embedding-weight-decay",
        type=float,
        help="the vocabulary matrices' (default: --weight-decay)",
    )
    g.add_argument(
        "--embedding-lr",
        type=float,
        metavar="MULT",
        help="the vocabulary matrices' lr, times --lr (1)",
    )


def explicit_flags(parser, argv):
    """The config keys given on the command line (every default suppressed)."""
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv)))


def make_config(parser, resolve_config, fields):
    """A script's resolved config from its parser's defaults with `fields` (config keys) set, as
    if given as flags."""
    args = parser.parse_args([])
    unknown = set(fields) - set(vars(args))
    if unknown:
        raise TypeError(f"unknown config fields {sorted(unknown)}")
    vars(args).update(fields)
    return resolve_config(args, set(fields))


def check_ranges(cfg, ranges):
    """One line for the first flag outside its range: ranges {key: (lowest, highest or None)},
    unset flags skipped."""
    for key, (lo, hi) in ranges.items():
        value = cfg.get(key)
        if value is None:
            continue
        below_top = value < math.inf if hi is None else value <= hi
        if not (lo <= value and below_top):  # nan fails
            bound = f">= {lo} and finite" if hi is None else f"in [{lo}, {hi}]"
            raise SystemExit(f"--{key.replace('_', '-')} {value}: must be {bound}")


def check_device(device):
    """One line for a --device this machine cannot use."""
    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise SystemExit(f"--device {device}: unknown device; use cpu, cuda or cuda:N")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(
            f"--device {device}: CUDA is not available on this machine; use --device cpu"
        )


def check_run_flags(cfg, task, ranges):
    """Check the flags (both scripts' and the script's `ranges`) before anything is written; fill
    device, dtype, out and task."""
    shared = dict(seed=(0, None), max_steps=(1, None), stop_at=(1, cfg["max_steps"]))
    shared.update(lr=(0, None), warmup=(0, None), weight_decay=(0, None))
    shared.update(embedding_weight_decay=(0, None), embedding_lr=(0, None), dropout=(0, 1))
    check_ranges(cfg, dict(ranges, **shared))
    cuda = torch.cuda.is_available()
    device = cfg["device"] = cfg.get("device") or ("cuda" if cuda else "cpu")
    on_cuda = device.startswith("cuda")
    cfg["dtype"] = cfg.get("dtype") or ("bfloat16" if on_cuda else "float32")
    name = f"{task}-{cfg['method']}-s{cfg['seed']}"
    cfg["out"] = cfg["out"] or os.path.join(ROOT, "out", name)
    cfg["task"] = task
    check_device(device)
    for key in ("out", "cache_dir"):
        if os.path.exists(cfg[key]) and not os.path.isdir(cfg[key]):
            flag = key.replace("_", "-")
            raise SystemExit(f"--{flag} {cfg[key]}: is a file, not a folder; choose another")


def build_method(cfg, preset, share_to_alpha=None, **data):
    """The run's agg method and the hyper-parameters in force: the method flags given, then the
    preset's where the method takes them (an alpha, or a rare share: share_to_alpha(share) or
    agg's); agg.py checks every value."""
    name = cfg["method"]
    accepted = agg.METHODS[name].defaults
    share = cfg.get("rare_share")
    hp = {k: cfg[k] for k in agg.HPARAMS if cfg.get(k) is not None}
    for key in set(hp) - set(accepted):
        taken = ", ".join(accepted) or "none"
        raise SystemExit(
            f"{agg.method_flag(key)} does not apply to --method {name} (its hyper-parameters: "
            f"{taken})"
        )
    takes_alpha = "alpha" in accepted
    if share is not None and not takes_alpha:  # agg.py ignores it; on the command line, a mistake
        raise SystemExit(
            f"--method {name}: rare_share sets AGG's alpha; method {name!r} has none "
            "(drop --rare-share)"
        )
    if takes_alpha and share is None and "alpha" not in hp and "alpha" not in preset:
        share = preset.get("rare_share")
    for key, value in preset.items():
        if key in accepted and key not in hp and (key != "alpha" or share is None):
            hp[key] = value
    try:
        if share is not None and share_to_alpha is not None and takes_alpha and "alpha" not in hp:
            hp["alpha"] = share_to_alpha(share)
            share = None
        method = agg.build_method(name, rare_share=share, **data, **hp)
    except ValueError as e:
        raise SystemExit(f"--method {name}: {e}")
    shown = ("window", "static_after", "alpha")
    in_force = {}
    for key, value in method.hparams.items():
        if key in hp or (key in shown and value is not None):
            in_force[key] = value
    return method, in_force


def method_record(stats, targets):
    """The method's stats as log keys: rare_* become method_rare_*; R_over_B is AGG's R / B over
    the step's targets."""
    record = {}
    for key, value in stats.items():
        if key != "nll":
            record["method_" + key if key.startswith("rare") else key] = value
    if "rare_count" in stats:
        record["R_over_B"] = stats["rare_count"] / max(targets, 1)
    return record


def param_groups(model, cfg, vocab_matrices=()):
    """AdamW's parameter groups: weight decay on matrices, never on biases and gains; the
    vocabulary matrices take --embedding-weight-decay, --embedding-lr and, with coupled-adam,
    Coupled Adam (their group is the last, marked "coupled")."""
    lr = cfg["lr"]
    wd = cfg["weight_decay"]
    vocab_lr = cfg.get("embedding_lr")
    vocab_wd = cfg.get("embedding_weight_decay")
    coupled = cfg.get("optimizer", "adamw") == "coupled-adam"
    own = coupled or vocab_wd is not None or vocab_lr is not None  # a group of their own
    vocab = {id(p) for p in vocab_matrices} if own else set()
    params = list(model.parameters())
    matrices = [p for p in params if p.dim() >= 2 and id(p) not in vocab]
    gains = [p for p in params if p.dim() < 2]
    groups = [{"params": matrices, "weight_decay": wd}, {"params": gains, "weight_decay": 0.0}]
    if own:
        vocab_wd = wd if vocab_wd is None else vocab_wd
        vocab_lr = lr * (1.0 if vocab_lr is None else vocab_lr)
        groups.append({"params": list(vocab_matrices), "weight_decay": vocab_wd, "lr": vocab_lr})
    if coupled:
        groups = [dict(g, coupled=g is groups[-1]) for g in groups]
    return groups


def autocast(cfg):
    """A context factory: autocast to --dtype bfloat16 / float16 on the run's device (CPU too)."""
    if cfg["dtype"] not in ("bfloat16", "float16"):
        return contextlib.nullcontext
    device = torch.device(cfg["device"]).type
    dtype = getattr(torch, cfg["dtype"])
    return lambda: torch.autocast(device, dtype=dtype)


# -------------------------------------------------------------------- checkpoints and files
def digest(obj, h=None):
    """sha256 of a checkpoint's content, in order: tensors by dtype, shape and bytes, the rest by
    repr."""
    h = h or hashlib.sha256()
    if isinstance(obj, torch.Tensor):
        flat = obj.detach().cpu().contiguous().reshape(-1)
        h.update(f"{flat.dtype}{tuple(obj.shape)}".encode())
        h.update(flat.view(torch.uint8).numpy())
    elif isinstance(obj, dict):
        for key, value in obj.items():
            h.update(repr(key).encode())
            digest(value, h)
    elif isinstance(obj, (list, tuple)):
        h.update(f"{type(obj).__name__}{len(obj)}".encode())
        for value in obj:
            digest(value, h)
    else:
        h.update(repr(obj).encode())
    return h.hexdigest()


def save_checkpoint(path, state):
    """An atomic torch.save with the sha256 of the content, checked by load_checkpoint."""
    content = {k: v for k, v in state.items() if k != "sha256"}  # a loaded one saved again
    state = dict(content, sha256=digest(content))
    fix = "the previous checkpoint is intact; free space, then --resume"
    write_file(path, lambda tmp: torch.save(state, tmp), fix)


def load_error(e):
    """torch's message without its advice to load with weights_only=False (never the fix here)."""
    parts = re.split(r"(?<=[.:])\s+|\n+", str(e))
    advice = r"weights_only|trusted source|file an issue"
    kept = [p for p in parts if p.strip() and not re.search(advice, p, re.I)]
    return " ".join(kept)[:200]


def load_checkpoint(path, task=None):
    """A checkpoint loaded as data (weights_only=True: a crafted pickle cannot run code) and
    checked; ck["task"] is its task."""
    if not os.path.isfile(path):
        raise SystemExit(
            f"{path}: no checkpoint there. Check --out, or start a new run without --resume."
        )
    try:
        ck = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        if "global" in str(e).lower():  # it names a function or class to call: a crafted pickle
            raise SystemExit(
                f"{path} is not a plain checkpoint of this project (its pickle asks to run code): "
                f"refused"
            )
        raise SystemExit(
            f"{path}: corrupted or not a checkpoint ({load_error(e)}); restore a good copy, or "
            f"train again with --overwrite"
        )
    if not isinstance(ck, dict) or "config" not in ck or "model" not in ck:
        raise SystemExit(f"{path} is not a checkpoint of train_lm.py / train_nmt.py")
    saved = ck.pop("sha256", None)  # a checkpoint saved before the checksum has none
    if saved is not None and saved != digest(ck):
        raise SystemExit(
            f"{path}: its content does not match its checksum (damaged: a flipped bit, a bad "
            f"copy); restore a good copy, or train again with --overwrite"
        )
    ck["task"] = ck.get("task") or ck["config"].get("task")
    if task is not None and ck["task"] != task:
        raise SystemExit(
            f"{path} is a checkpoint of task {ck['task']!r}, not {task!r}: use that task's script"
        )
    return ck


def checkpoint_file(path, checkpoint="last"):
    """A run folder's checkpoint (last: ckpt.pt; best: ckpt_best.pt, the lowest valid PPL), or
    `path` if a file."""
    if not os.path.isdir(path):
        return path
    name = {"last": "ckpt.pt", "best": "ckpt_best.pt"}[checkpoint]
    return os.path.join(path, name)


def load_state(model, ck, path):
    try:
        model.load_state_dict(ck["model"])
    except RuntimeError as e:
        raise SystemExit(
            f"checkpoint {path} does not fit this model ({str(e)[:300]}); use the run's own flags"
        )
    return model


def run_config(out):
    """OUT/config.json: a dict; None when it is missing or unreadable; False when no run wrote it
    (an HF export's)."""
    try:
        with open(os.path.join(out, "config.json")) as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return None
    return saved if isinstance(saved, dict) and "task" in saved else False


def snapshot_step(path):
    """The step of a ckpt_STEP.pt snapshot, None for any other file."""
    match = re.fullmatch(r"ckpt_(\d+)\.pt", os.path.basename(path))
    return int(match[1]) if match else None


def snapshots(out):
    """The ckpt_STEP.pt snapshots of a run (--keep-last), oldest first."""
    found = glob.glob(os.path.join(out, "ckpt_*.pt"))
    return sorted([p for p in found if snapshot_step(p) is not None], key=snapshot_step)


def same_data(was, now):
    """True when a run's data fingerprint `was` (None: not recorded) names the data `now` (the
    cache folder's name)."""
    if was is None or was == now:
        return True
    return now is not None and now.startswith("dir-") and was.endswith(now[3:])


def write_file(path, save, fix="free disk space or choose a writable folder"):
    """The one atomic write, save(tmp) then a rename: a crash mid-write leaves the old file (or
    none), never half."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        save(tmp)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:  # a full disk, a read-only folder (torch: RuntimeError)
        with contextlib.suppress(OSError):
            os.remove(tmp)
        reason = getattr(e, "strerror", None) or str(e)[:200]
        raise SystemExit(f"cannot write {path} ({reason}): {fix}")


def write_text(path, text):
    write_file(path, lambda tmp: pathlib.Path(tmp).write_text(text, encoding="utf-8"))


def write_json(path, obj):
    write_text(path, json.dumps(obj, indent=1, default=str) + "\n")


def kernel_fingerprint(threads=None):
    """A hash of one float32 step through the training kernels at `threads` threads: hosts whose
    kernels round differently end a run elsewhere (RESULTS: valid PPL 294.46 on one host, 286.42
    on another), so pairs share it."""
    F = torch.nn.functional
    before = torch.get_num_threads()
    g = torch.Generator().manual_seed(0)
    torch.set_num_threads(threads or before)
    x = torch.randn(1024, 128, generator=g, requires_grad=True)
    w = (torch.randn(8192, 128, generator=g) / 128**0.5).requires_grad_()
    logits = F.gelu(F.layer_norm(x, (128,))) @ w.T
    loss = F.cross_entropy(logits, torch.randint(0, 8192, (1024,), generator=g))
    loss.backward()
    torch.set_num_threads(before)
    computed = b"".join(t.detach().numpy().tobytes() for t in (loss, x.grad, w.grad))
    return hashlib.sha256(computed).hexdigest()[:16]


def log_step(path, number, line):
    """The step of line `number` of a log.jsonl; a damaged line ends in one line naming it."""
    try:
        step = json.loads(line).get("step", 0)
    except (ValueError, AttributeError):  # not JSON, or not a record
        step = None
    if type(step) is not int:
        raise SystemExit(
            f"{path} line {number} is damaged ({line.strip()[:40]!r}): delete or repair that line "
            f"(or restore the file), then --resume"
        )
    return step


# ------------------------------------------------------------------------------ the life of a run
def start_ddp(cfg):
    """torchrun's processes as one run (DistributedDataParallel): (rank, world size), (0, 1) for
    a plain process. nccl on GPUs (a process each: LOCAL_RANK), gloo on CPU; cfg's device set."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world == 1:
        return 0, 1
    cuda = cfg["device"].startswith("cuda")
    if cuda:
        cfg["device"] = f"cuda:{os.environ['LOCAL_RANK']}"
        torch.cuda.set_device(cfg["device"])
    backend = "nccl" if cuda else "gloo"
    # a rank that waits this long for the others stops (a dead rank: torchrun stops the rest)
    dist.init_process_group(backend, timeout=timedelta(minutes=30))
    return dist.get_rank(), world


def distributed():
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def rank0_first(rank):
    """Rank 0 runs the block first (it builds a data cache), then the other ranks (they read it)."""
    if distributed() and rank > 0:
        dist.barrier()
    yield
    if distributed() and rank == 0:
        dist.barrier()


def agreed(flag):
    """Whether `flag` is true on any rank (a signal may reach the ranks at different steps)."""
    if not distributed():
        return flag
    seen = torch.tensor([float(flag)])
    dist.all_reduce(seen, op=dist.ReduceOp.MAX)
    return bool(seen.item())


def summed(*values):
    """The values (floats) summed over the ranks; themselves in a plain process."""
    if not distributed():
        return values
    total = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(total)
    return tuple(total.tolist())


def quiet(*args, **kwargs):
    """print's stand-in on the ranks that do not write (torchrun)."""


def end_ddp():
    """Leave the process group together: rank 0 may still be writing its last checkpoint. The
    callers drop their DDP model first: a reducer freed after the group would end it while holding
    Python's lock, which gloo's threads may wait for."""
    if distributed():
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


def start(cfg, explicit, run_control):
    """The resume rule: (the run's config, its checkpoint or None). --resume continues OUT/ckpt.pt
    with its saved config and the flags given now, and flags that change the run must agree with
    it; without --resume an existing checkpoint is replaced only with --overwrite."""
    out = cfg["out"]
    path = os.path.join(out, "ckpt.pt")
    ours = cfg["resume"] and os.path.exists(path)
    if run_config(out) is False and not ours:  # a run would replace it
        raise SystemExit(
            f"--out {out}: its config.json is not a run's (an HF export?): choose another --out"
        )
    if not cfg["resume"]:
        if os.path.exists(path) and not cfg["overwrite"]:
            raise SystemExit(
                f"{path} already exists: pass --resume to continue it or --overwrite to restart"
            )
        return cfg, None
    ck = load_checkpoint(path, cfg["task"])
    saved = ck["config"]
    fixed = set(explicit) - set(run_control) - RESUME_MAY_CHANGE
    for key in sorted(fixed):
        if key in saved and saved[key] != cfg.get(key):
            raise SystemExit(
                f"{path} was written with {key}={saved[key]!r} but this run asks for "
                f"{key}={cfg.get(key)!r}: resume with `--out {out} --resume` alone (its "
                f"config.json), or start a separate run with a new --out"
            )
    given = set(explicit) | set(FOLLOW_INVOCATION)
    cfg = dict(saved, **{k: cfg[k] for k in given if k in cfg})
    print(f"resuming {path} at step {ck['step']}")
    return cfg, ck


def restore(ck, model, opt, sched, method, scaler):
    """Continue checkpoint ck exactly (weights, optimizer, schedule, the method's state, loss
    scale, RNGs); returns its step, 0 without one."""
    if ck is None:
        return 0
    load_state(model, ck, ck["config"]["out"])
    opt.load_state_dict(ck["optimizer"])
    sched.load_state_dict(ck["scheduler"])  # keeps this invocation's lr function
    method.load_state_dict(ck["method"])
    method.to(next(model.parameters()).device)
    if ck.get("scaler") and scaler.is_enabled():
        scaler.load_state_dict(ck["scaler"])
    rng = ck["rng"][0]  # torch's (the data order has seeded generators of its own)
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return ck["step"]


def rng_state():
    """All the random state that training draws from, as a checkpoint keeps it."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    return [dict(torch=torch.get_rng_state(), cuda=cuda)]


def take_folder(out, new, rank=0):
    """One writer per folder: a flock on OUT/.lock (released when the returned file closes or the
    process ends). Then clean the run's own files: a new run's predecessor's, and what a killed
    write left. Under torchrun rank 0 writes; the others take nothing."""
    if rank > 0:
        return contextlib.nullcontext()
    for name in RUN_FILES + (".lock", "snapshots"):
        path = os.path.join(out, name)
        if os.path.islink(path):  # it would lead our writes and deletes elsewhere
            raise SystemExit(
                f"{path} is a symbolic link: a run writes in its own folder only; remove the link"
            )
    try:
        os.makedirs(out, exist_ok=True)
        lock = open(os.path.join(out, ".lock"), "a+")
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # the flock is another process's
        lock.seek(0)
        pid = lock.read().strip() or "?"
        raise SystemExit(
            f"{out} is being written by another process (pid {pid}): wait for it to end, "
            f"stop it, or choose another --out"
        )
    except OSError as e:
        raise SystemExit(
            f"cannot write the run folder {out} ({e.strerror}): choose a writable --out"
        )
    lock.truncate(0)
    print(os.getpid(), file=lock, flush=True)
    files = "|".join(map(re.escape, RUN_FILES))
    own = re.compile(rf"(ckpt_\d+\.pt|snapshots/emb_\d+\.pt|{files})(\.tmp\d+)?")
    snaps = os.path.join(out, "snapshots")
    paths = glob.glob(os.path.join(out, "*")) + glob.glob(os.path.join(snaps, "*"))
    for path in paths:
        match = own.fullmatch(os.path.relpath(path, out))
        unfinished = match and match[2]  # a write that was killed
        if match and (new or unfinished) and os.path.isfile(path):
            os.remove(path)
    if new and os.path.isdir(snaps) and not os.listdir(snaps):
        os.rmdir(snaps)
    return lock


def git(*args):
    """A git command's output in this checkout: "" where it fails, None outside git."""
    command = ["git", *args]
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout


def write_provenance(cfg, ck, argv, step, tokenizer_json, world=1, **info):
    """Check the data of a resumed run, then write tokenizer.json and config.json: the config,
    `info`, this machine's versions and the code and command of each segment (the first's also
    at the top). Returns the segments, which each checkpoint keeps."""
    out = cfg["out"]
    now = cfg.get("data_fingerprint")
    was = ck and ck["config"].get("data_fingerprint")
    if ck and not same_data(was, now):
        raise SystemExit(
            f"{out}/ckpt.pt: the corpus or tokenizer changed since this run started (its data "
            f"was {was}, now {now}): restore the original files, or start a new run with "
            f"another --out"
        )
    write_text(os.path.join(out, "tokenizer.json"), tokenizer_json)
    commit = (git("rev-parse", "HEAD") or "").strip() or None
    dirty = None
    if commit:
        changes = git("status", "--porcelain", "--", "*.py", "requirements*.txt") or ""
        dirty = bool(changes.strip())
    with open(agg.__file__, "rb") as f:
        agg_sha256 = hashlib.sha256(f.read()).hexdigest()
    segment = dict(git_commit=commit, git_dirty=dirty, argv=list(argv), agg_sha256=agg_sha256)
    segment["start_step"] = step
    segment["world_size"] = world  # processes (torchrun) this segment ran on
    old = []
    if ck:
        old = ck.get("provenance") or (run_config(out) or {}).get("segments") or []
    segments = old + [segment]
    versions = dict(python=platform.python_version(), torch=torch.__version__)
    versions.update(numpy=np.__version__, platform=platform.platform())
    versions["threads"] = torch.get_num_threads()  # CPU results depend on them
    versions["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    versions["kernels"] = kernel_fingerprint()
    first = {k: segments[0].get(k, segment[k]) for k in ("git_commit", "argv", "agg_sha256")}
    resumed_from = step if ck else None
    config = dict(cfg, versions=versions, git_dirty=dirty, **first, segments=segments, **info)
    write_json(os.path.join(out, "config.json"), dict(config, resumed_from_step=resumed_from))
    return segments


def start_log(path, step, resumed):
    """A new run empties log.jsonl; a resumed one keeps the records up to its step, a torn last
    line dropped and a damaged one named."""
    lines = []
    if resumed and os.path.exists(path):
        lines = open(path).readlines()
    if lines and not lines[-1].endswith("\n"):
        print(f"warning: the last line of {path} is not complete (a torn write): dropped")
        lines.pop()
    kept = []
    for number, line in enumerate(lines, 1):
        if line.strip() and log_step(path, number, line) <= step:
            kept.append(line)
    write_text(path, "".join(kept))


def start_wandb(cfg):
    """With --wandb, the run's Weights & Biases run (one per folder, resumed with it), else None."""
    if not cfg.get("wandb"):
        return None
    try:
        import wandb
    except ImportError:
        raise SystemExit("--wandb needs the wandb package: pip install wandb, then wandb login")
    out = cfg["out"]
    run_id = hashlib.sha256(os.path.abspath(out).encode()).hexdigest()[:16]
    project = os.environ.get("WANDB_PROJECT", "agg")
    name = os.path.basename(out)
    return wandb.init(project=project, name=name, id=run_id, resume="allow", config=cfg, dir=out)


def log(path, record, wandb=None):
    """Append one record to log.jsonl, and to wandb as SPLIT/key."""
    try:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
    except OSError as e:
        reason = e.strerror or e
        raise SystemExit(f"cannot append to {path} ({reason}): free disk space, then --resume")
    if wandb is not None:  # wandb names the numbers of a nested group SPLIT/group.key
        numbers = {k: v for k, v in record.items() if k not in ("step", "split")}
        wandb.log({f"{record['split']}/{k}": v for k, v in numbers.items()}, step=record["step"])


def diverged(ckpt_path, what):
    """The exit of a run that diverged: `what`, and whether its last good checkpoint is kept."""
    kept = "was never written"
    if os.path.exists(ckpt_path):
        kept = "keeps the last good checkpoint"
    return SystemExit(
        f"{what} (diverged); {ckpt_path} {kept}. Lower --lr or check the method's hyper-parameters"
    )


def stopped(signals, step, ckpt_path, rank, script):
    """The exit of a run stopped by a signal: rank 0 says how to continue it, the others exit 1."""
    if rank > 0:
        return SystemExit(1)
    name = signals[-1] if signals else "a signal to another rank"
    out = os.path.dirname(ckpt_path)
    return SystemExit(
        f"{name}: stopped at step {step}, checkpoint {ckpt_path} written; "
        f"`python {script} --out {out} --resume` continues it"
    )


def checkpoint(path, model, step, cfg, **state):
    """Save ckpt.pt: the model, its step and config, and `state` (all that an exact resume needs);
    never non-finite weights."""
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    if not finite:
        raise diverged(path, f"step {step}: the model has non-finite weights")
    head = dict(model=model.state_dict(), step=step, config=cfg, task=cfg["task"])
    save_checkpoint(path, dict(head, **state))
    return head


@contextlib.contextmanager
def stop_signals():
    """SIGTERM, SIGHUP or SIGINT appends its name to the yielded list, so that the loop can
    checkpoint at the next step and stop; a second Ctrl-C stops at once. The handlers before are
    back on exit."""
    received = []

    def on_signal(signum, frame):
        if received and signum == signal.SIGINT:
            raise KeyboardInterrupt
        received.append(signal.Signals(signum).name)

    handlers = {}
    with contextlib.suppress(ValueError):  # not the main thread: signals keep their behaviour
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            handlers[s] = signal.signal(s, on_signal)
    try:
        yield received
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
