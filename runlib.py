"""The life of a run, shared by train_lm.py and train_nmt.py: the flags both take, resume, the run folder (one writer,
config.json with provenance, log.jsonl, atomic checkpoints loaded as data), seeding and RNG state, the optimizer and
schedule. Models, data and training loops stay in each script; agg.py does not depend on this file."""
import argparse
import contextlib
import fcntl
import glob
import hashlib
import json
import math
import os
import platform
import random
import re
import signal
import subprocess

import numpy as np
import torch

import agg

ROOT = os.path.dirname(os.path.abspath(__file__))
# Config keys that steer an invocation and leave the trained model unchanged: they may change when a run is resumed,
# and runs that differ only in them (and the seed) are one experiment. Each script adds its own.
RUN_CONTROL = {"out", "resume", "overwrite", "stop_at", "device", "compile", "eval_interval", "log_interval",
               "cache_dir", "prepare_only", "wandb"}
# These change the result but may be given again on resume: a run continued to a new length, in another precision,
# or its corpus at another path (Run.begin accepts it only when the data fingerprint is the run's).
RESUME_MAY_CHANGE = {"max_steps", "dtype", "data_dir"}
FOLLOW_INVOCATION = ("device", "resume", "stop_at", "overwrite", "compile")  # never taken from the saved config
RUN_FILES = ("ckpt.pt", "ckpt_best.pt", "config.json", "log.jsonl", "tokenizer.json")  # what --overwrite removes
RUN_TMP = re.compile(r"(ckpt(_best|_\d+)?\.pt|config\.json|log\.jsonl|tokenizer\.json)\.tmp\d+")  # atomic writes


# ------------------------------------------------------------------------------------------------------------ flags
def add_run_flags(p, task):
    g = p.add_argument_group("run (the same in train_lm.py and train_nmt.py)")
    g.add_argument("--out", default=None, help=f"run folder (default out/{task}-METHOD-sSEED)")
    g.add_argument("--seed", type=int, default=0, help="seed of init, data order and dropout (process r: seed + r)")
    g.add_argument("--resume", action="store_true", help="continue OUT/ckpt.pt exactly, with its saved config")
    g.add_argument("--overwrite", action="store_true", help="start afresh in OUT (only a run's own files are removed)")
    g.add_argument("--max-steps", type=int, default=None, help="optimizer steps (also the LR schedule's length)")
    g.add_argument("--stop-at", type=int, default=None, help="checkpoint and stop after this step (split a run)")
    g.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda if available)")
    g.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="autocast dtype (default: bfloat16 on CUDA, float32 on CPU); float16 adds loss scaling")
    g.add_argument("--compile", action="store_true", help="torch.compile the model")
    g.add_argument("--wandb", action="store_true", help="also log to Weights & Biases (project $WANDB_PROJECT or agg)")
    g.add_argument("--prepare-only", action="store_true", help="build the data cache and stop")
    g = p.add_argument_group("method (agg.METHODS); hyper-parameters go to agg.build_method only when given")
    g.add_argument("--method", default="mle", choices=list(agg.METHODS), metavar="METHOD",
                   help=f"one of: {', '.join(agg.METHODS)}")
    for key, (typ, text) in agg.HPARAMS.items():
        users = [name for name, cls in agg.METHODS.items() if key in cls.defaults]
        g.add_argument(method_flag(key), dest=key, default=None, help=f"{text} [{', '.join(users[:3])}]",
                       type=_bool if typ is bool else typ)
    g.add_argument("--rare-share", type=float, default=None,
                   help="AGG family: alpha set so that the rare group is this share of the vocabulary (or --alpha)")


def add_optimizer_flags(g):
    g.add_argument("--optimizer", default="adamw", choices=["adamw", "coupled-adam"],
                   help="coupled-adam: the vocabulary matrices take Coupled Adam's update (agg.CoupledAdamW)")
    g.add_argument("--embedding-weight-decay", type=float, default=None,
                   help="weight decay of the vocabulary matrices (default: --weight-decay)")
    g.add_argument("--embedding-lr", type=float, default=None, metavar="MULT",
                   help="the vocabulary matrices' lr as a multiple of --lr (on the same schedule; default 1)")


def _bool(text):
    if text.lower() not in ("1", "true", "yes", "0", "false", "no"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return text.lower() in ("1", "true", "yes")


def method_flag(key):
    return "--" + key.rstrip("_").replace("_", "-")  # lambda_ -> --lambda


def explicit_flags(parser, argv):
    """The config keys given on the command line (parsed with every default suppressed)."""
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
        if value is not None and not (lo <= value and (hi is None or value <= hi)):  # nan fails both
            raise SystemExit(f"--{key.replace('_', '-')} {value}: must be " + (f"in [{lo}, {hi}]" if hi is not None
                                                                                  else f">= {lo}"))


def check_run_flags(cfg, task, ranges):
    """Fill the run's device, dtype and folder; check the flags (those both scripts share, and `ranges`, the
    script's) before anything is written."""
    check_ranges(cfg, dict(ranges, seed=(0, None), max_steps=(1, None), weight_decay=(0, None),
                           embedding_weight_decay=(0, None), embedding_lr=(0, None), dropout=(0, 1)))
    cfg["device"] = cfg.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
    cfg["dtype"] = cfg.get("dtype") or ("bfloat16" if cfg["device"].startswith("cuda") else "float32")
    cfg["out"] = cfg["out"] or os.path.join(ROOT, "out", f"{task}-{cfg['method']}-s{cfg['seed']}")
    if cfg.get("stop_at") is not None and not 1 <= cfg["stop_at"] <= cfg["max_steps"]:
        raise SystemExit(f"--stop-at {cfg['stop_at']}: must be a step in [1, --max-steps {cfg['max_steps']}]")
    if not (math.isfinite(cfg["lr"]) and cfg["lr"] >= 0):
        raise SystemExit(f"--lr {cfg['lr']}: must be a finite number >= 0, e.g. 1e-3")
    if cfg.get("warmup") is not None and cfg["warmup"] < 0:
        raise SystemExit(f"--warmup {cfg['warmup']}: must be >= 0 steps")
    if not re.fullmatch(r"cpu|cuda(:\d+)?", cfg["device"]):
        raise SystemExit(f"--device {cfg['device']}: unknown device; use cpu, cuda or cuda:N")
    if cfg["device"].startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device {cfg['device']}: CUDA is not available on this machine; use --device cpu")
    if os.path.exists(cfg["out"]) and not os.path.isdir(cfg["out"]):
        raise SystemExit(f"--out {cfg['out']}: is a file, not a folder; choose another --out")
    cfg["task"] = task


def build_method(cfg, preset, share_to_alpha=None, **data):
    """The run's agg method, and the hyper-parameters in force that a flag, the preset or a paper default set. The
    method flags given come first, then the preset's settings where the method takes them (AGPS's paper values; an
    alpha, or a rare share: share_to_alpha(share), or agg's alpha_for_rare_share); agg.py checks every value."""
    name, accepted, share = cfg["method"], agg.METHODS[cfg["method"]].defaults, cfg.get("rare_share")
    hp = {k: cfg[k] for k in agg.HPARAMS if cfg.get(k) is not None}
    for key in set(hp) - set(accepted):
        raise SystemExit(f"{method_flag(key)} does not apply to --method {name} "
                         f"(its hyper-parameters: {', '.join(accepted) or 'none'})")
    hp.update({k: v for k, v in preset.items() if k in accepted and k not in hp and k != "alpha"})
    if "alpha" in accepted and share is None and "alpha" not in hp:
        if "alpha" in preset:
            hp["alpha"] = preset["alpha"]
        else:
            share = preset.get("rare_share")
    try:
        if share is not None and share_to_alpha is not None and "alpha" in accepted and "alpha" not in hp:
            hp["alpha"], share = share_to_alpha(share), None
        method = agg.build_method(name, rare_share=share, **data, **hp)
    except ValueError as e:
        raise SystemExit(f"--method {name}: {e}") from None
    return method, {k: v for k, v in method.hparams.items()
                    if k in hp or (k in ("window", "static_after", "alpha") and v is not None)}


def method_record(stats, targets):
    """The method's stats as log keys: rare_* become method_rare_*; R_over_B is AGG's R / B over the step's targets."""
    rec = {("method_" + k if k.startswith("rare") else k): v for k, v in stats.items() if k != "nll"}
    if "rare_count" in stats:
        rec["R_over_B"] = stats["rare_count"] / max(targets, 1)
    return rec


# ----------------------------------------------------------------------------------------------- optimizer, devices
def make_optimizer(model, cfg, vocab_matrices=()):
    """AdamW (betas 0.9 / 0.98, as the papers' fairseq set-ups); weight decay on matrices, never on biases and gains.
    The vocabulary matrices take --embedding-weight-decay, --embedding-lr, and Coupled Adam's update with --optimizer
    coupled-adam."""
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


def autocast(cfg):
    """A context factory: autocast to --dtype bfloat16 / float16 on the run's device (CPU too), else a no-op."""
    if cfg["dtype"] in ("bfloat16", "float16"):
        return lambda: torch.autocast(torch.device(cfg["device"]).type, dtype=getattr(torch, cfg["dtype"]))
    return contextlib.nullcontext


def grad_scaler(cfg):
    """float16's dynamic loss scaling (a step with inf/NaN gradients is skipped); otherwise its calls are no-ops."""
    return torch.amp.GradScaler(torch.device(cfg["device"]).type, enabled=cfg["dtype"] == "float16")


NO_SCALER = torch.amp.GradScaler("cpu", enabled=False)


# ------------------------------------------------------------------------------------------------------ checkpoints
def tensor_checksum(state):
    """sha256 over every tensor of a (nested) checkpoint dict, in key order: detects bytes changed on disk."""
    h = hashlib.sha256()

    def visit(obj, key):
        if torch.is_tensor(obj):
            h.update(key.encode())
            h.update(obj.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(obj, (dict, list, tuple)):
            items = sorted(obj.items(), key=lambda kv: str(kv[0])) if isinstance(obj, dict) else enumerate(obj)
            for k, v in items:
                if k != "checksum":
                    visit(v, f"{key}/{k}")
    visit(state, "")
    return h.hexdigest()


def save_checkpoint(path, state):
    """Atomic (a crash mid-write never leaves half a checkpoint), with a checksum load_checkpoint verifies."""
    state, tmp = dict(state, checksum=tensor_checksum(state)), f"{path}.tmp{os.getpid()}"
    try:
        torch.save(state, tmp)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:  # a full disk or a read-only folder (torch wraps some as RuntimeError)
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise SystemExit(f"cannot write {path} ({type(e).__name__}: {str(e)[:200]}); the previous checkpoint is "
                         f"intact. Free disk space or make the folder writable, then --resume") from None


def load_error(e):
    """A torch.load error without torch's advice to load with weights_only=False (never the fix here)."""
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
            raise SystemExit(f"{path} is not a plain checkpoint of this project: its pickle asks to run code or build "
                             f"objects a checkpoint never holds, so it was refused and nothing in it ran.") from None
        raise SystemExit(f"{path}: corrupted or not a checkpoint ({type(e).__name__}: {load_error(e)}). Delete it "
                         f"(or start with --overwrite) and train again, or restore a good copy.") from None
    if not isinstance(ck, dict) or "config" not in ck or "model" not in ck:
        raise SystemExit(f"{path} is not a checkpoint of train_lm.py / train_nmt.py")
    if "checksum" in ck and tensor_checksum(ck) != ck["checksum"]:
        raise SystemExit(f"{path}: its tensors do not match the checksum written with them (the file was damaged "
                         f"after it was written). Restore a good copy, or resume from an earlier checkpoint.")
    ck["task"] = ck.get("task") or ck["config"].get("task")
    if task is not None and ck["task"] != task:
        raise SystemExit(f"{path} is a checkpoint of task {ck['task']!r}, not {task!r}: use the script of that task, "
                         f"or give a different --out.")
    return ck


def checkpoint_file(path, checkpoint="last"):
    """A run folder's checkpoint (last: ckpt.pt; best: ckpt_best.pt, the lowest valid PPL), or `path` if a file."""
    return os.path.join(path, {"last": "ckpt.pt", "best": "ckpt_best.pt"}[checkpoint]) if os.path.isdir(path) else path


def load_state(model, ck, path):
    try:
        model.load_state_dict(ck["model"])
    except RuntimeError as e:
        raise SystemExit(f"checkpoint {path} does not fit this model ({str(e)[:300]}); use the run's own flags, or "
                         f"train into a new --out") from None
    return model


def rng_state():
    """Every RNG of this process as tensors and plain values (loadable with weights_only=True)."""
    key, state, pos, has_gauss, gauss = np.random.get_state()
    version, mt, gauss_next = random.getstate()
    return dict(torch=torch.get_rng_state(), cuda=list(torch.cuda.get_rng_state_all()) if torch.cuda.is_available()
                else [], numpy=dict(key=key, state=torch.from_numpy(state.astype(np.int64)), pos=int(pos),
                                    has_gauss=int(has_gauss), gauss=float(gauss)),
                python=dict(version=version, state=list(mt), gauss_next=gauss_next))


def set_rng_state(s):
    torch.set_rng_state(s["torch"])
    if s["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])
    n, p = s["numpy"], s["python"]
    np.random.set_state((n["key"], n["state"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    random.setstate((p["version"], tuple(p["state"]), p["gauss_next"]))


# ------------------------------------------------------------------------------------------ run folder, provenance
def run_config(out):
    """OUT/config.json: a dict; None when there is none or it does not parse; False when train_lm.py / train_nmt.py
    did not write it (a Hugging Face export's, say)."""
    try:
        with open(os.path.join(out, "config.json")) as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return None
    return saved if isinstance(saved, dict) and "task" in saved else False


def snapshots(out):
    """The ckpt_STEP.pt snapshots of a run (--keep-last), oldest first."""
    found = [(int(m.group(1)), p) for p in glob.glob(os.path.join(out, "ckpt_*.pt"))
             if (m := re.fullmatch(r"ckpt_(\d+)\.pt", os.path.basename(p)))]
    return [p for _, p in sorted(found)]


def same_data(was, now):
    """True when a run's data fingerprint `was` (None: not recorded) names the data `now` (the cache folder's name)."""
    return was is None or was == now or (now is not None and now.startswith("dir-") and was.endswith(now[3:]))


def write_text(path, text):
    """The one atomic write: a crash mid-write leaves the old file (or none), never half a file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(f"{path}.tmp{os.getpid()}", "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(f"{path}.tmp{os.getpid()}", path)


def write_json(path, obj):
    write_text(path, json.dumps(obj, indent=1, default=str) + "\n")


def kernel_fingerprint(threads=None):
    """A hash of one fixed float32 step through the kernels training leans on (the tied head's matmul at the cpu
    preset's shapes, layer norm, GELU, cross-entropy, backward) at `threads` threads: hosts whose kernels round
    differently end a run elsewhere (RESULTS: valid PPL 294.46 on one host, 286.42 on another), so pairs share it."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(1024, 128, generator=g, requires_grad=True)
        w = (torch.randn(8192, 128, generator=g) / 128 ** 0.5).requires_grad_()
        h = torch.nn.functional.gelu(torch.nn.functional.layer_norm(x, (128,)))
        loss = torch.nn.functional.cross_entropy(h @ w.T, torch.randint(0, 8192, (1024,), generator=g))
        loss.backward()
        return hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in (loss, x.grad, w.grad))).hexdigest()[:16]
    finally:
        torch.set_num_threads(before)


def provenance(argv):
    """What config.json records about the code and machine of a run segment."""
    run = lambda *cmd: subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True, timeout=5)
    try:
        commit, status = run("rev-parse", "HEAD"), run("status", "--porcelain", "--", "*.py", "requirements*.txt")
        commit, dirty = commit.stdout.strip() or None, bool(status.stdout.strip()) if commit.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        commit, dirty = None, None
    versions = dict(python=platform.python_version(), torch=torch.__version__, numpy=np.__version__,
                    platform=platform.platform(), threads=torch.get_num_threads(),  # CPU results depend on them
                    cpu_capability=torch.backends.cpu.get_cpu_capability(), kernels=kernel_fingerprint())
    for name in ("tokenizers", "sacrebleu"):
        with contextlib.suppress(ImportError):
            versions[name] = __import__(name).__version__
    with open(agg.__file__, "rb") as f:
        agg_sha = hashlib.sha256(f.read()).hexdigest()
    return dict(versions=versions, git_commit=commit, git_dirty=dirty, argv=list(argv), agg_sha256=agg_sha)


def flat(record, prefix=""):
    """A log record's numbers as {"prefix/key/sub": value}, nested groups flattened (for wandb)."""
    out = {}
    for k, v in record.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}/"))
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("step", "split"):
            out[prefix + k] = float(v)
    return out


# ------------------------------------------------------------------------------------------------------------ a run
class Run:
    """The life of one run folder in both training scripts: the resume policy, DDP and seeds (__init__), the data
    (prepare), an exact resume (restore), the folder's lock, config.json and log (begin), records (log), checkpoints,
    and signals: SIGTERM, SIGHUP and SIGINT set a flag (stopping), the loop checkpoints at the next step boundary
    and the run exits with status 1, saying how to continue it; a second Ctrl-C stops at once."""
    locks = {}  # run folder -> the open file whose flock says "a process writes here" (dropped when it ends)

    def __init__(self, cfg, explicit, argv, fmt, run_control):
        self.cfg, self.ck = cfg, None
        self.argv, self.task, self.fmt = list(argv), cfg["task"], fmt
        self.out = cfg["out"]
        self.ckpt_path, self.log_path = os.path.join(self.out, "ckpt.pt"), os.path.join(self.out, "log.jsonl")
        self._resume_policy(set(explicit), run_control)
        self.world, self.rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
        self.ddp, self.master = self.world > 1, self.rank == 0
        if self.ddp:  # under torchrun: one process per GPU (or gloo on CPU)
            if self.cfg["device"].startswith("cuda"):
                self.cfg["device"] = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
                torch.cuda.set_device(self.cfg["device"])
            torch.distributed.init_process_group("nccl" if self.cfg["device"].startswith("cuda") else "gloo")
        self.device = self.cfg["device"]
        self.stop_step = min(self.cfg["max_steps"], self.cfg["stop_at"] or self.cfg["max_steps"])
        self.wandb, self.signal, self.step, self.segments, self.handlers = None, None, 0, None, {}
        seed = self.cfg["seed"] + self.rank  # process r draws from seed + r: ranks get their own dropout masks
        torch.manual_seed(seed)
        np.random.seed(seed)
        random.seed(seed)

    def _resume_policy(self, explicit, run_control):
        """--resume: the saved config (of ckpt.pt, else config.json: the same run from step 0), updated with the flags
        given now; a flag that changes the result must equal the saved value. Else an OUT holding a run needs
        --overwrite, and an OUT of files no run wrote is refused unless --overwrite (which keeps them)."""
        cfg, out = self.cfg, self.out
        if not cfg["resume"]:
            if os.path.exists(self.ckpt_path) and not cfg["overwrite"]:
                raise SystemExit(f"{self.ckpt_path} already exists: pass --resume to continue it, --overwrite to start "
                                 f"afresh, or choose another --out")
            if run_config(out) is False:  # a run would replace it
                raise SystemExit(f"--out {out}: its config.json was not written by train_lm.py / train_nmt.py (a "
                                 f"Hugging Face export?): choose another --out")
            return
        self.ck = load_checkpoint(self.ckpt_path, self.task) if os.path.exists(self.ckpt_path) else None
        saved = self.ck["config"] if self.ck else run_config(out)
        if not saved:
            raise SystemExit(f"--resume: {out} holds no run to resume: " + (
                "its config.json was not written by train_lm.py / train_nmt.py (a Hugging Face export?)" if saved is
                False else "no ckpt.pt, no readable config.json; start it without --resume"))
        if saved["task"] != self.task:
            raise SystemExit(f"--resume: {out} holds a {saved['task']!r} run, not {self.task!r}")
        where = self.ckpt_path if self.ck else os.path.join(out, "config.json")
        for key in sorted(explicit - set(run_control) - RESUME_MAY_CHANGE):
            if key in saved and saved[key] != cfg.get(key):
                raise SystemExit(f"{where} was written with {key}={saved[key]!r} but this run asks for {key}="
                                 f"{cfg.get(key)!r}. Resume with `--out {out} --resume` alone (the saved config is in "
                                 f"{os.path.join(out, 'config.json')}), or start a separate run with a new --out.")
        self.cfg = dict(saved) if self.ck else {k: saved.get(k, v) for k, v in cfg.items()}
        self.cfg.update({k: cfg[k] for k in explicit | set(FOLLOW_INVOCATION) if k in cfg})
        print(f"resuming {self.ckpt_path} at step {self.ck['step']}" if self.ck else f"--resume: no checkpoint in "
              f"{out} yet: restarting its run from step 0 with its saved config")

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
        if self.ddp and exc_type is None:
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()
        if os.path.abspath(self.out) in Run.locks:
            Run.locks.pop(os.path.abspath(self.out)).close()
        if exc_type is None and self.signal is not None and self.step < self.stop_step:
            raise SystemExit(f"{self.signal}: stopped at step {self.step}, checkpoint {self.ckpt_path} written; "
                             f"`python train_{self.task}.py --out {self.out} --resume` continues it")

    def print(self, *args, **kw):
        if self.master:
            print(*args, **kw)

    def prepare(self, prepare_fn):
        """The task's data (prepare_fn(cfg, log) of data.py): rank 0 builds the cache while the others wait (prepare a
        large corpus with --prepare-only first: NCCL's barrier times out), then every rank reads it."""
        if self.ddp and not self.master:
            torch.distributed.barrier()  # rank 0 builds the cache
        data = prepare_fn(self.cfg, log=print if self.master else (lambda *a, **k: None))
        if self.ddp and self.master:
            torch.distributed.barrier()
        return data

    def restore(self, model, opt, sched, method, scaler):
        """Continue the checkpoint exactly: weights, optimizer, scheduler, the method's state (AGG's counters, FRAGE's
        discriminator), the float16 loss scale, every process's RNG. Returns the step; the data position is the
        caller's."""
        ck = self.ck
        if ck is None:
            return 0
        missing = [k for k in ("model", "optimizer", "scheduler", "method", "step", "rng") if k not in ck]
        if ck.get("format", self.fmt) != self.fmt or missing:
            raise SystemExit(f"{self.ckpt_path} is not a train_{self.task}.py checkpoint (format {ck.get('format')}, "
                             f"missing {missing}): use --overwrite or a new --out")
        load_state(model, ck, self.ckpt_path)
        opt.load_state_dict(ck["optimizer"])
        sched.load_state_dict(ck["scheduler"])  # keeps this invocation's lr function (--max-steps may have changed)
        method.load_state_dict(ck["method"])
        method.to(next(model.parameters()).device)
        if ck.get("scaler") and scaler.is_enabled():
            scaler.load_state_dict(ck["scaler"])
        if len(ck["rng"]) == self.world:
            set_rng_state(ck["rng"][self.rank])
        else:
            self.print(f"warning: the checkpoint holds the RNG states of {len(ck['rng'])} processes, this run has "
                       f"{self.world}: dropout noise will differ from an uninterrupted run")
        self.step = ck["step"]
        return self.step

    def begin(self, tokenizer_json, **info):
        """Take the folder and write config.json (the config, every segment's provenance, `info`), the tokenizer and
        the log; a resumed run must read the data it started with."""
        if self.master:
            self._lock()
            resumed = self.ck is not None
            was = self.ck["config"].get("data_fingerprint") if resumed else None
            if not same_data(was, self.cfg.get("data_fingerprint")):
                raise SystemExit(f"{self.ckpt_path}: the corpus or tokenizer changed since this run started (its data "
                                 f"was {was}, now {self.cfg['data_fingerprint']}): restore the original files, or "
                                 f"start a new run with another --out")
            write_text(os.path.join(self.out, "tokenizer.json"), tokenizer_json)
            old = ((run_config(self.out) or {}).get("segments") or self.ck.get("provenance") or []) if resumed else []
            if resumed and not run_config(self.out):
                print(f"warning: {self.out}/config.json is missing or unreadable: provenance from the checkpoint")
            prov = provenance(self.argv)
            self.segments = old + [dict({k: prov[k] for k in ("git_commit", "git_dirty", "argv", "agg_sha256")},
                                        start_step=self.step)]
            if old and old[-1].get("agg_sha256") not in (None, prov["agg_sha256"]):
                print("warning: agg.py changed since this run's last segment: the run continues with the new code")
            prov.update({k: self.segments[0][k] for k in ("git_commit", "argv", "agg_sha256") if k in self.segments[0]})
            write_json(os.path.join(self.out, "config.json"), dict(self.cfg, **prov, segments=self.segments,
                                                                   world_size=self.world, **info,
                                                                   resumed_from_step=self.step if resumed else None))
            # a new run empties log.jsonl; a resumed one drops the records after its checkpoint (and a torn line)
            path, keep = self.log_path, []
            for i, line in enumerate(open(path) if resumed and os.path.exists(path) else (), 1):
                try:
                    keep += [line] if line.strip() and json.loads(line).get("step", 0) <= self.step else []
                except json.JSONDecodeError:
                    print(f"warning: {path} line {i} is not complete JSON (a torn write): dropped")
            with open(path, "w") as f:
                f.writelines(keep)
        if self.master and self.cfg.get("wandb"):
            try:
                import wandb
            except ImportError:
                raise SystemExit("--wandb needs the wandb package: pip install wandb, then wandb login") from None
            self.wandb = wandb.init(project=os.environ.get("WANDB_PROJECT", "agg"), name=os.path.basename(self.out),
                                    id=hashlib.sha256(os.path.abspath(self.out).encode()).hexdigest()[:16],
                                    resume="allow", config=self.cfg, dir=self.out)  # one wandb run per folder

    def _lock(self):
        """Make this process the one writer of the folder (an exclusive flock on OUT/.lock that the kernel drops when
        the process ends); then remove our killed writes' NAME.tmpPID files and, for a new run, an old run's files."""
        if os.path.abspath(self.out) in Run.locks:  # this process holds it already
            return
        for name in RUN_FILES + (".lock", "snapshots"):  # a link would lead our writes and deletes elsewhere
            if os.path.islink(os.path.join(self.out, name)):
                raise SystemExit(f"{os.path.join(self.out, name)} is a symbolic link: a run writes its own files in "
                                 f"its folder only; remove the link (or choose another --out)")
        try:
            os.makedirs(self.out, exist_ok=True)
            f = open(os.path.join(self.out, ".lock"), "a+")
        except OSError as e:
            raise SystemExit(f"cannot write the run folder {self.out} ({e.strerror}): choose a writable --out") \
                from None
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.seek(0)
            raise SystemExit(f"{self.out} is being written by another process (pid {f.read().strip() or '?'}): wait "
                             f"for it to end, stop it, or choose another --out") from None
        f.truncate(0)
        f.write(str(os.getpid()))
        f.flush()
        Run.locks[os.path.abspath(self.out)] = f
        snaps = os.path.join(self.out, "snapshots")
        new = self.ck is None  # --overwrite, or a restart before any checkpoint: no old files
        for folder, tmp, files in ((self.out, RUN_TMP, r"ckpt_\d+\.pt|" + "|".join(map(re.escape, RUN_FILES))),
                                   (snaps, re.compile(r"emb_\d+\.pt\.tmp\d+"), r"emb_\d+\.pt")):
            for name in os.listdir(folder) if os.path.isdir(folder) else ():
                path = os.path.join(folder, name)
                if tmp.fullmatch(name) or new and os.path.isfile(path) and re.fullmatch(files, name):
                    os.remove(path)
        if new and os.path.isdir(snaps) and not os.listdir(snaps):
            os.rmdir(snaps)

    def wrap(self, model):
        """The module the forward pass goes through: compiled (--compile), under DDP its wrapper; the methods and
        checkpoints keep using `model` itself."""
        fwd = torch.compile(model) if self.cfg["compile"] else model
        if self.ddp:
            device = torch.device(self.device)
            fwd = torch.nn.parallel.DistributedDataParallel(
                fwd, device_ids=[device.index if device.index is not None else 0] if device.type == "cuda" else None)
        return fwd

    def log(self, record):
        """One record (step, split, numbers) to log.jsonl (and wandb); a full disk stops the run in one line."""
        if not self.master:
            return
        try:
            with open(self.log_path, "a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as e:
            raise SystemExit(f"cannot append to {self.log_path} ({e.strerror or e}): free disk space, then --resume") \
                from None
        if self.wandb is not None:
            self.wandb.log(flat(record, record["split"] + "/"), step=record["step"])

    def log_valid(self, step, record):
        """A validation record; a non-finite valid loss or PPL stops the run as diverged, before it is checkpointed."""
        self.log(dict(step=step, split="valid", **record))
        if not (math.isfinite(record["loss"]) and math.isfinite(record["ppl"])):
            raise SystemExit(f"step {step}: the valid loss is {record['loss']:.4g}, PPL {record['ppl']:.4g} (diverged); "
                             f"{self.ckpt_path} keeps the last good checkpoint. Lower --lr or check the method's "
                             f"hyper-parameters")

    def checkpoint(self, step, model, opt, sched, method, scaler, **extra):
        """ckpt.pt, written atomically, with everything an exact resume needs (+ `extra`: the data position) and the
        segments' provenance; --keep-last N also keeps the last N models as ckpt_STEP.pt. Every rank calls it (the RNG
        states are gathered); non-finite weights are never saved."""
        self.step, rngs = step, [rng_state()]
        if self.ddp:
            rngs = [None] * self.world
            torch.distributed.all_gather_object(rngs, rng_state())
        if not all(bool(torch.isfinite(p).all()) for p in model.parameters()):
            raise SystemExit(f"step {step}: the model has non-finite weights (diverged); {self.ckpt_path} keeps the "
                             f"last good checkpoint. Lower --lr or check the method's hyper-parameters")
        if not self.master:
            return
        head = dict(format=self.fmt, model=model.state_dict(), step=step, config=self.cfg, task=self.task)
        save_checkpoint(self.ckpt_path, dict(head, optimizer=opt.state_dict(), scheduler=sched.state_dict(),
                                             method=method.state_dict(), scaler=scaler.state_dict(), rng=rngs,
                                             provenance=self.segments, **extra))
        if self.cfg.get("keep_last"):  # model-only snapshots for checkpoint averaging
            save_checkpoint(os.path.join(self.out, f"ckpt_{step}.pt"), head)
            for old in snapshots(self.out)[:-self.cfg["keep_last"]]:
                os.remove(old)

    def stopping(self, step):
        """True when a signal asks the run to stop (on any rank under DDP: every rank stops at the same step)."""
        self.step, flag = step, self.signal is not None
        if self.ddp:
            t = torch.tensor([float(flag)], device=self.device)
            torch.distributed.all_reduce(t)
            flag, self.signal = bool(t.item()), self.signal or ("a signal on another rank" if t.item() else None)
        return step < self.stop_step and flag
