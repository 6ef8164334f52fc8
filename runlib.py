"""The life of a run, shared by train_lm.py and train_nmt.py: flags, method, optimizer, schedule, atomic checkpoints
loaded as data, and `Run` (resume, one writer per run folder, config.json with provenance, log.jsonl, signals)."""
import argparse
import contextlib
import fcntl
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

import numpy as np
import torch

import agg

ROOT = os.path.dirname(os.path.abspath(__file__))
# Config keys that steer an invocation, not the model: they may change on resume; runs differing only in them (and
# the seed) are one experiment. Each script adds its own.
RUN_CONTROL = {"out", "resume", "overwrite", "stop_at", "device", "compile", "eval_interval", "log_interval",
               "cache_dir", "prepare_only", "wandb"}
# These change the result but may be given again on resume: a run continued to a new length, in another precision,
# or its corpus at another path (Run.begin accepts it only when the data fingerprint is the run's).
RESUME_MAY_CHANGE = {"max_steps", "dtype", "data_dir"}
FOLLOW_INVOCATION = ("device", "resume", "stop_at", "overwrite", "compile")  # never taken from the saved config
RUN_FILES = ("ckpt.pt", "ckpt_best.pt", "config.json", "log.jsonl", "tokenizer.json")  # what --overwrite removes


def add_run_flags(p, task):
    g = p.add_argument_group("run (the same in train_lm.py and train_nmt.py)")
    g.add_argument("--out", help=f"run folder (default out/{task}-METHOD-sSEED)")
    g.add_argument("--seed", type=int, default=0, help="seed of init, data order and dropout")
    g.add_argument("--resume", action="store_true", help="continue OUT/ckpt.pt exactly, with its saved config")
    g.add_argument("--overwrite", action="store_true", help="start afresh in OUT (only a run's own files are removed)")
    g.add_argument("--max-steps", type=int, help="optimizer steps (also the LR schedule's length)")
    g.add_argument("--stop-at", type=int, help="checkpoint and stop after this step (split a run)")
    g.add_argument("--device", help="cpu | cuda | cuda:N (default: cuda if available)")
    g.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="autocast dtype (default: bfloat16 on CUDA, float32 on CPU); float16 adds loss scaling")
    g.add_argument("--compile", action="store_true", help="torch.compile the model")
    g.add_argument("--wandb", action="store_true", help="also log to Weights & Biases (project $WANDB_PROJECT or agg)")
    g.add_argument("--prepare-only", action="store_true", help="build the data cache and stop")
    g = p.add_argument_group("method (agg.METHODS; hyper-parameters go to agg.build_method only when given), optimizer")
    g.add_argument("--method", default="mle", choices=list(agg.METHODS), metavar="METHOD",
                   help=f"one of: {', '.join(agg.METHODS)}")
    add_method_flags(g)
    g.add_argument("--rare-share", type=float, help="AGG family: the alpha whose rare group is this share of the vocab")
    g.add_argument("--optimizer", default="adamw", choices=["adamw", "coupled-adam"],
                   help="coupled-adam: the vocabulary matrices take Coupled Adam's update (agg.CoupledAdamW)")
    g.add_argument("--embedding-weight-decay", type=float, help="the vocabulary matrices' (default: --weight-decay)")
    g.add_argument("--embedding-lr", type=float, metavar="MULT", help="the vocabulary matrices' lr, times --lr (1)")


add_method_flags = agg.add_method_flags  # the method flags live with the methods
method_flag = agg.method_flag


def explicit_flags(parser, argv):  # the config keys given on the command line (every default suppressed)
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv)))


def make_config(parser, resolve_config, fields):
    """A script's resolved config from its parser's defaults with `fields` (config keys) set, as if given as flags."""
    args = parser.parse_args([])
    if set(fields) - set(vars(args)):
        raise TypeError(f"unknown config fields {sorted(set(fields) - set(vars(args)))}")
    vars(args).update(fields)
    return resolve_config(args, set(fields))


def check_ranges(cfg, ranges):
    """One line for the first flag outside its range: ranges {key: (lowest, highest or None)}, unset flags skipped."""
    for key, (lo, hi) in ranges.items():
        value = cfg.get(key)
        if value is not None and not (lo <= value and (value < math.inf if hi is None else value <= hi)):  # nan fails
            bound = f">= {lo} and finite" if hi is None else f"in [{lo}, {hi}]"
            raise SystemExit(f"--{key.replace('_', '-')} {value}: must be {bound}")


def check_run_flags(cfg, task, ranges):
    """Check the flags (both scripts' and the script's `ranges`) before anything is written; fill device, dtype, out."""
    check_ranges(cfg, dict(ranges, seed=(0, None), max_steps=(1, None), stop_at=(1, cfg["max_steps"]), lr=(0, None),
                           warmup=(0, None), weight_decay=(0, None), embedding_weight_decay=(0, None),
                           embedding_lr=(0, None), dropout=(0, 1)))
    cfg["device"] = cfg.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
    cfg["dtype"] = cfg.get("dtype") or ("bfloat16" if cfg["device"].startswith("cuda") else "float32")
    cfg["out"], cfg["task"] = cfg["out"] or os.path.join(ROOT, "out", f"{task}-{cfg['method']}-s{cfg['seed']}"), task
    if not re.fullmatch(r"cpu|cuda(:\d+)?", cfg["device"]):
        raise SystemExit(f"--device {cfg['device']}: unknown device; use cpu, cuda or cuda:N")
    if cfg["device"].startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device {cfg['device']}: CUDA is not available on this machine; use --device cpu")
    for key in ("out", "cache_dir"):
        if os.path.exists(cfg[key]) and not os.path.isdir(cfg[key]):
            raise SystemExit(f"--{key.replace('_', '-')} {cfg[key]}: is a file, not a folder; choose another")


def build_method(cfg, preset, share_to_alpha=None, **data):
    """The run's agg method and the hyper-parameters in force: the method flags given, then the preset's where the
    method takes them (an alpha, or a rare share: share_to_alpha(share) or agg's); agg.py checks every value."""
    name, accepted, share = cfg["method"], agg.METHODS[cfg["method"]].defaults, cfg.get("rare_share")
    hp = {k: cfg[k] for k in agg.HPARAMS if cfg.get(k) is not None}
    for key in set(hp) - set(accepted):
        raise SystemExit(f"{method_flag(key)} does not apply to --method {name} (its hyper-parameters: "
                         f"{', '.join(accepted) or 'none'})")
    if "alpha" in accepted and share is None and "alpha" not in hp and "alpha" not in preset:
        share = preset.get("rare_share")
    hp.update({k: v for k, v in preset.items() if k in accepted and k not in hp and (k != "alpha" or share is None)})
    try:
        if share is not None and share_to_alpha is not None and "alpha" in accepted and "alpha" not in hp:
            hp["alpha"], share = share_to_alpha(share), None
        method = agg.build_method(name, rare_share=share, **data, **hp)
    except ValueError as e:
        raise SystemExit(f"--method {name}: {e}")
    return method, {k: v for k, v in method.hparams.items()
                    if k in hp or (k in ("window", "static_after", "alpha") and v is not None)}


def method_record(stats, targets):
    """The method's stats as log keys: rare_* become method_rare_*; R_over_B is AGG's R / B over the step's targets."""
    rec = {("method_" + k if k.startswith("rare") else k): v for k, v in stats.items() if k != "nll"}
    if "rare_count" in stats:
        rec["R_over_B"] = stats["rare_count"] / max(targets, 1)
    return rec


def make_optimizer(model, cfg, vocab_matrices=()):
    """AdamW (betas 0.9 / 0.98, as the papers' fairseq set-ups); weight decay on matrices, never on biases and gains.
    The vocabulary matrices take --embedding-weight-decay, --embedding-lr and, with coupled-adam, Coupled Adam."""
    lr, wd, vocab_lr = cfg["lr"], cfg["weight_decay"], cfg.get("embedding_lr")
    coupled, vocab_wd = cfg.get("optimizer", "adamw") == "coupled-adam", cfg.get("embedding_weight_decay")
    own = coupled or vocab_wd is not None or vocab_lr is not None  # the vocabulary matrices in a group of their own
    vocab = {id(p) for p in vocab_matrices} if own else set()
    groups = [{"params": [p for p in model.parameters() if p.dim() >= 2 and id(p) not in vocab], "weight_decay": wd},
              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    if own:
        groups.append({"params": list(vocab_matrices), "weight_decay": wd if vocab_wd is None else vocab_wd,
                       "lr": lr * (1.0 if vocab_lr is None else vocab_lr)})
    if not coupled:
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.98), eps=1e-8)
    return agg.CoupledAdamW([dict(g, coupled=g is groups[-1]) for g in groups], lr=lr, betas=(0.9, 0.98), eps=1e-8)


def lr_schedule(kind, warmup, max_steps):
    """The factor of the peak lr at each step. cosine: linear warm-up, then cosine decay to 10% of the peak at
    max_steps; inverse-sqrt: Vaswani et al.'s, normalised so the peak (at step `warmup`) is the configured lr."""
    def factor(step):
        if kind == "inverse-sqrt":  # without warm-up: the peak at the first step, then 1 / sqrt(step)
            return min((step + 1) / warmup, math.sqrt(warmup / (step + 1))) if warmup else 1 / math.sqrt(step + 1)
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, max_steps - warmup))))
    return factor


def autocast(cfg):  # a context factory: autocast to --dtype bfloat16 / float16 on the run's device (CPU too)
    if cfg["dtype"] in ("bfloat16", "float16"):
        return lambda: torch.autocast(torch.device(cfg["device"]).type, dtype=getattr(torch, cfg["dtype"]))
    return contextlib.nullcontext


def digest(obj, h=None):
    """sha256 of a checkpoint's content, in order: tensors by dtype, shape and bytes, the rest by
    repr."""
    h = h or hashlib.sha256()
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous().reshape(-1)
        h.update(f"{t.dtype}{tuple(obj.shape)}".encode())
        h.update(t.view(torch.uint8).numpy())
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


def save_checkpoint(path, state):  # with the sha256 of its content, checked by load_checkpoint
    content = {k: v for k, v in state.items() if k != "sha256"}  # a loaded one saved again
    state = dict(content, sha256=digest(content))
    write_file(path, lambda tmp: torch.save(state, tmp), "the previous checkpoint is intact; free space, then --resume")


def load_error(e):  # torch's message without its advice to load with weights_only=False (never the fix here)
    return " ".join(p for p in re.split(r"(?<=[.:])\s+|\n+", str(e))
                    if p.strip() and not re.search(r"weights_only|trusted source|file an issue", p, re.I))[:200]


def load_checkpoint(path, task=None):
    """A checkpoint loaded as data (weights_only=True: a crafted pickle cannot run code) and checked; ck["task"]."""
    if not os.path.isfile(path):
        raise SystemExit(f"{path}: no checkpoint there. Check --out, or start a new run without --resume.")
    try:
        ck = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        if "global" in str(e).lower():  # it names a function or class to call: what a crafted pickle does
            raise SystemExit(f"{path} is not a plain checkpoint of this project (its pickle asks to run code): refused")
        raise SystemExit(f"{path}: corrupted or not a checkpoint ({load_error(e)}); restore a good copy, or train "
                         f"again with --overwrite")
    if not isinstance(ck, dict) or "config" not in ck or "model" not in ck:
        raise SystemExit(f"{path} is not a checkpoint of train_lm.py / train_nmt.py")
    saved = ck.pop("sha256", None)  # a checkpoint saved before the checksum has none
    if saved is not None and saved != digest(ck):
        raise SystemExit(f"{path}: its content does not match its checksum (damaged: a flipped "
                         f"bit, a bad copy); restore a good copy, or train again with --overwrite")
    ck["task"] = ck.get("task") or ck["config"].get("task")
    if task is not None and ck["task"] != task:
        raise SystemExit(f"{path} is a checkpoint of task {ck['task']!r}, not {task!r}: use that task's script")
    return ck


def checkpoint_file(path, checkpoint="last"):
    """A run folder's checkpoint (last: ckpt.pt; best: ckpt_best.pt, the lowest valid PPL), or `path` if a file."""
    return os.path.join(path, {"last": "ckpt.pt", "best": "ckpt_best.pt"}[checkpoint]) if os.path.isdir(path) else path


def load_state(model, ck, path):
    try:
        model.load_state_dict(ck["model"])
    except RuntimeError as e:
        raise SystemExit(f"checkpoint {path} does not fit this model ({str(e)[:300]}); use the run's own flags")
    return model


def run_config(out):
    """OUT/config.json: a dict; None when it is missing or unreadable; False when no run wrote it (an HF export's)."""
    try:
        with open(os.path.join(out, "config.json")) as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return None
    return saved if isinstance(saved, dict) and "task" in saved else False


def snapshots(out):
    """The ckpt_STEP.pt snapshots of a run (--keep-last), oldest first."""
    found = [p for p in glob.glob(os.path.join(out, "ckpt_*.pt")) if re.fullmatch(r"ckpt_\d+\.pt", os.path.basename(p))]
    return sorted(found, key=lambda p: int(os.path.basename(p)[5:-3]))


def same_data(was, now):
    """True when a run's data fingerprint `was` (None: not recorded) names the data `now` (the cache folder's name)."""
    return was is None or was == now or (now is not None and now.startswith("dir-") and was.endswith(now[3:]))


def write_file(path, save, fix="free disk space or choose a writable folder"):
    """The one atomic write, save(tmp) then a rename: a crash mid-write leaves the old file (or none), never half."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        save(tmp)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:  # a full disk, a read-only folder (torch wraps some as RuntimeError)
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise SystemExit(f"cannot write {path} ({getattr(e, 'strerror', None) or str(e)[:200]}): {fix}")


def write_text(path, text):
    write_file(path, lambda tmp: pathlib.Path(tmp).write_text(text, encoding="utf-8"))


def write_json(path, obj):
    write_text(path, json.dumps(obj, indent=1, default=str) + "\n")


def kernel_fingerprint(threads=None):
    """A hash of one float32 step through the training kernels at `threads` threads: hosts whose kernels round
    differently end a run elsewhere (RESULTS: valid PPL 294.46 on one host, 286.42 on another), so pairs share it."""
    before, F, g = torch.get_num_threads(), torch.nn.functional, torch.Generator().manual_seed(0)
    torch.set_num_threads(threads or before)
    x = torch.randn(1024, 128, generator=g, requires_grad=True)
    w = (torch.randn(8192, 128, generator=g) / 128 ** 0.5).requires_grad_()
    loss = F.cross_entropy(F.gelu(F.layer_norm(x, (128,))) @ w.T, torch.randint(0, 8192, (1024,), generator=g))
    loss.backward()
    torch.set_num_threads(before)
    return hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in (loss, x.grad, w.grad))).hexdigest()[:16]


def log_step(path, number, line):
    """The step of line `number` of a log.jsonl; a damaged line ends in one line naming it."""
    try:
        step = json.loads(line).get("step", 0)
    except (ValueError, AttributeError):  # not JSON, or not a record
        step = None
    if type(step) is not int:
        raise SystemExit(f"{path} line {number} is damaged ({line.strip()[:40]!r}): delete or "
                         f"repair that line (or restore the file), then --resume")
    return step


class Run:
    """One run folder's life. SIGTERM, SIGHUP or SIGINT sets a flag (stopping): the loop checkpoints at the next step
    and the run exits with status 1; a second Ctrl-C stops at once."""

    def __init__(self, cfg, explicit, argv, run_control):
        self.cfg, self.ck, self.argv, self.task, self.out = cfg, None, argv, cfg["task"], cfg["out"]
        self.ckpt_path, self.log_path = os.path.join(self.out, "ckpt.pt"), os.path.join(self.out, "log.jsonl")
        ours = cfg["resume"] and os.path.exists(self.ckpt_path)  # resume: the ckpt's config
        if run_config(self.out) is False and not ours:  # a run would replace it
            raise SystemExit(f"--out {self.out}: its config.json is not a run's (an HF export?): choose another --out")
        if cfg["resume"]:  # the checkpoint's config with the flags given now; those that change the run must agree
            self.ck = load_checkpoint(self.ckpt_path, self.task)
            saved = self.ck["config"]
            for key in sorted(set(explicit) - set(run_control) - RESUME_MAY_CHANGE):
                if key in saved and saved[key] != cfg.get(key):
                    raise SystemExit(f"{self.ckpt_path} was written with {key}={saved[key]!r} but this run asks for "
                                     f"{key}={cfg.get(key)!r}: resume with `--out {self.out} --resume` alone (its "
                                     f"config.json), or start a separate run with a new --out")
            self.cfg = dict(saved, **{k: cfg[k] for k in set(explicit) | set(FOLLOW_INVOCATION) if k in cfg})
            print(f"resuming {self.ckpt_path} at step {self.ck['step']}")
        elif os.path.exists(self.ckpt_path) and not cfg["overwrite"]:
            raise SystemExit(f"{self.ckpt_path} already exists: pass --resume to continue it or --overwrite to restart")
        if int(os.environ.get("WORLD_SIZE", 1)) > 1:
            raise SystemExit("one process per run: run without torchrun (a study's runs go to separate GPUs instead)")
        self.device = self.cfg["device"]
        self.stop_step = min(self.cfg["max_steps"], self.cfg["stop_at"] or self.cfg["max_steps"])
        self.wandb, self.signal, self.step, self.segments, self.handlers, self.lock = None, None, 0, None, {}, None
        torch.manual_seed(self.cfg["seed"])  # init and dropout masks

    def _on_signal(self, signum, frame):
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal = signal.Signals(signum).name

    def __enter__(self):
        with contextlib.suppress(ValueError):  # not the main thread: signals keep their default behaviour
            self.handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT,
                                                                             signal.SIGHUP)}
        return self

    def __exit__(self, exc_type, exc, tb):
        for s, handler in self.handlers.items():
            signal.signal(s, handler)
        if self.wandb is not None:
            self.wandb.finish()
        if self.lock is not None:
            self.lock.close()  # and with it the flock
        if exc_type is None and self.signal is not None and self.step < self.stop_step:
            raise SystemExit(f"{self.signal}: stopped at step {self.step}, checkpoint {self.ckpt_path} written; "
                             f"`python train_{self.task}.py --out {self.out} --resume` continues it")

    def restore(self, model, opt, sched, method, scaler):
        """Continue the checkpoint exactly (weights, optimizer, schedule, the method's state, loss scale, RNGs)."""
        if self.ck is None:
            return 0
        load_state(model, self.ck, self.ckpt_path)
        opt.load_state_dict(self.ck["optimizer"])
        sched.load_state_dict(self.ck["scheduler"])  # keeps this invocation's lr function (--max-steps may change)
        method.load_state_dict(self.ck["method"])
        method.to(next(model.parameters()).device)
        if self.ck.get("scaler") and scaler.is_enabled():
            scaler.load_state_dict(self.ck["scaler"])
        rng = self.ck["rng"][0]  # torch's (the data order has seeded generators of its own)
        torch.set_rng_state(rng["torch"])
        if rng["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        self.step = self.ck["step"]
        return self.step

    def begin(self, tokenizer_json, **info):
        """Take the folder, check the data and write config.json (with `info`), the tokenizer and the log."""
        self._lock()
        resumed, now = self.ck is not None, self.cfg.get("data_fingerprint")
        if resumed and not same_data(was := self.ck["config"].get("data_fingerprint"), now):
            raise SystemExit(f"{self.ckpt_path}: the corpus or tokenizer changed since this run started (its data was "
                             f"{was}, now {now}): restore the original files, or start a new run with another --out")
        write_text(os.path.join(self.out, "tokenizer.json"), tokenizer_json)
        # provenance: the code and command of each segment (the first's also at the top), this machine's versions
        git = lambda *cmd: subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True, timeout=5).stdout
        try:  # outside a git checkout: None
            commit = git("rev-parse", "HEAD").strip() or None
            dirty = bool(git("status", "--porcelain", "--", "*.py", "requirements*.txt").strip()) if commit else None
        except (OSError, subprocess.SubprocessError):
            commit, dirty = None, None
        with open(agg.__file__, "rb") as f:
            segment = dict(git_commit=commit, git_dirty=dirty, argv=list(self.argv),
                           agg_sha256=hashlib.sha256(f.read()).hexdigest(), start_step=self.step)
        old = (self.ck.get("provenance") or (run_config(self.out) or {}).get("segments") or []) if resumed else []
        self.segments = old + [segment]
        versions = dict(python=platform.python_version(), torch=torch.__version__, numpy=np.__version__,
                        platform=platform.platform(), threads=torch.get_num_threads(),  # CPU results depend on them
                        cpu_capability=torch.backends.cpu.get_cpu_capability(), kernels=kernel_fingerprint())
        first = {k: self.segments[0].get(k, segment[k]) for k in ("git_commit", "argv", "agg_sha256")}
        write_json(os.path.join(self.out, "config.json"), dict(self.cfg, versions=versions, git_dirty=dirty, **first,
                   segments=self.segments, **info, resumed_from_step=self.step if resumed else None))
        # a new run empties log.jsonl; a resumed one keeps the records up to its checkpoint, a torn last line dropped
        lines = open(self.log_path).readlines() if resumed and os.path.exists(self.log_path) else []
        if lines and not lines[-1].endswith("\n"):
            print(f"warning: the last line of {self.log_path} is not complete (a torn write): dropped")
            lines.pop()
        numbered = [(n, line) for n, line in enumerate(lines, 1) if line.strip()]
        kept = [line for n, line in numbered if log_step(self.log_path, n, line) <= self.step]
        write_text(self.log_path, "".join(kept))
        if self.cfg.get("wandb"):  # one wandb run per folder
            try:
                import wandb
            except ImportError:
                raise SystemExit("--wandb needs the wandb package: pip install wandb, then wandb login")
            self.wandb = wandb.init(project=os.environ.get("WANDB_PROJECT", "agg"), name=os.path.basename(self.out),
                                    id=hashlib.sha256(os.path.abspath(self.out).encode()).hexdigest()[:16],
                                    resume="allow", config=self.cfg, dir=self.out)

    def _lock(self):
        """One writer per folder: a flock on OUT/.lock (gone when the process ends); then clean the run's own files."""
        for path in (os.path.join(self.out, name) for name in RUN_FILES + (".lock", "snapshots")):
            if os.path.islink(path):  # it would lead our writes and deletes elsewhere
                raise SystemExit(f"{path} is a symbolic link: a run writes in its own folder only; remove the link")
        try:
            os.makedirs(self.out, exist_ok=True)
            self.lock = open(os.path.join(self.out, ".lock"), "a+")
            fcntl.flock(self.lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # the flock is another process's
            self.lock.seek(0)
            raise SystemExit(f"{self.out} is being written by another process (pid {self.lock.read().strip() or '?'})"
                             f": wait for it to end, stop it, or choose another --out")
        except OSError as e:
            raise SystemExit(f"cannot write the run folder {self.out} ({e.strerror}): choose a writable --out")
        self.lock.truncate(0)
        print(os.getpid(), file=self.lock, flush=True)
        new, snaps = self.ck is None, os.path.join(self.out, "snapshots")
        own = r"(ckpt_\d+\.pt|snapshots/emb_\d+\.pt|" + "|".join(map(re.escape, RUN_FILES)) + r")(\.tmp\d+)?"
        for path in [os.path.join(d, n) for d in (self.out, snaps) if os.path.isdir(d) for n in os.listdir(d)]:
            if (m := re.fullmatch(own, os.path.relpath(path, self.out))) and (new or m[2]) and os.path.isfile(path):
                os.remove(path)  # a new run: the previous run's files; any run: what a killed write left
        if new and os.path.isdir(snaps) and not os.listdir(snaps):
            os.rmdir(snaps)

    def log(self, record):
        """One record to log.jsonl and wandb (as SPLIT/key); a non-finite valid loss or PPL stops the run."""
        try:
            with open(self.log_path, "a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as e:
            raise SystemExit(f"cannot append to {self.log_path} ({e.strerror or e}): free disk space, then --resume")
        if self.wandb is not None:  # wandb names the numbers of a nested group SPLIT/group.key
            self.wandb.log({f"{record['split']}/{k}": v for k, v in record.items() if k not in ("step", "split")},
                           step=record["step"])
        if record["split"] == "valid" and not (math.isfinite(record["loss"]) and math.isfinite(record["ppl"])):
            raise self.diverged(f"step {record['step']}: the valid loss is {record['loss']:.4g}, PPL "
                                f"{record['ppl']:.4g}")

    def diverged(self, what):
        kept = "was never written"
        if os.path.exists(self.ckpt_path):
            kept = "keeps the last good checkpoint"
        return SystemExit(f"{what} (diverged); {self.ckpt_path} {kept}. Lower --lr or check the "
                          f"method's hyper-parameters")

    def checkpoint(self, step, model, opt, sched, method, scaler, **extra):
        """ckpt.pt: all an exact resume needs (+ `extra`: the data position), never non-finite weights."""
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
        self.step, rngs = step, [dict(torch=torch.get_rng_state(), cuda=cuda)]  # all that training draws from
        if not all(bool(torch.isfinite(p).all()) for p in model.parameters()):
            raise self.diverged(f"step {step}: the model has non-finite weights")
        head = dict(model=model.state_dict(), step=step, config=self.cfg, task=self.task)
        save_checkpoint(self.ckpt_path, dict(head, optimizer=opt.state_dict(), scheduler=sched.state_dict(),
                                             method=method.state_dict(), scaler=scaler.state_dict(), rng=rngs,
                                             provenance=self.segments, **extra))
        if self.cfg.get("keep_last"):  # --keep-last N: the last N models also as ckpt_STEP.pt, for averaging
            save_checkpoint(os.path.join(self.out, f"ckpt_{step}.pt"), head)
            for old in snapshots(self.out)[:-self.cfg["keep_last"]]:
                os.remove(old)

    def stopping(self, step):
        """True when a signal asks the run to stop."""
        self.step = step
        return step < self.stop_step and self.signal is not None
